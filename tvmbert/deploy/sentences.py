"""A package's sentence-transformers layer, as sentence-transformers computes it, so that a user
swapping it for tvmbert gets the same vectors: pooling of per-token outputs, Normalize,
Matryoshka truncation and ``quantize_embeddings``' precisions. Shared by the server and the
corpus job (``embed``)."""

from __future__ import annotations

import numpy as np

from tvmbert.core.errors import InputError

MODES = ("mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens")  # sentence-transformers' pooling_mode_* names
# quantize_embeddings' precisions: int8/uint8 in 256 levels between calibrated bounds per
# dimension, binary/ubinary one sign bit per dimension packed eight to a byte.
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def pool(tokens: np.ndarray, mode: str) -> np.ndarray:
    """One text's [tokens, hidden] (its real tokens only, as the package returns them) -> [hidden]."""
    if mode == "cls_token":
        return tokens[0]
    if mode == "max_tokens":
        return tokens.max(axis=0)
    summed = tokens.sum(axis=0, dtype=np.float64)
    return (summed / (np.sqrt(len(tokens)) if mode == "mean_sqrt_len_tokens" else len(tokens))).astype(np.float32)


def vector_size(model) -> int:
    """The width of an exported encoder's token vectors, read off one run of a short text (the
    word embedding table's width is not it where embeddings are factorized, as ALBERT's and
    ELECTRA's are)."""
    return int(model.run_encodings(model.tokenize(["a"]))["last_hidden_state"][0].shape[-1])


def recorded_pooling(manifest: dict) -> tuple[str, bool]:
    """How export recorded the model's pooling (its 1_Pooling mode, and whether a Normalize
    module follows): mean over the tokens, then unit length, where the folder said nothing."""
    packaged = manifest.get("pooling") or {}
    return packaged.get("mode", "mean_tokens"), packaged.get("normalize", True)


def recorded_prompts(manifest: dict) -> tuple[dict[str, str], str | None]:
    """The model's config_sentence_transformers.json prompts as export recorded them, by name,
    and the name of the one it applies by default (None: none)."""
    recorded = manifest.get("prompts") or {}
    return recorded.get("prompts", {}), recorded.get("default")


def check_dimensions(dimensions: int | None, size: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= size:
        raise InputError(f"dimensions must lie between 1 and the model's {size}, got {dimensions}")


def sentence_vectors(hidden: list[np.ndarray], mode: str, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """[texts, size] float32 from each text's token vectors: pooled, cut to their first
    ``dimensions`` (a Matryoshka model's smaller sizes), then unit length where ``normalize``
    (sentence-transformers' ``truncate_dim`` with ``normalize_embeddings``: a cut unit vector is
    no longer one, and its users compare by dot product)."""
    vectors = np.stack([pool(tokens, mode) for tokens in hidden]).astype(np.float32, copy=False)
    if dimensions is not None:
        check_dimensions(dimensions, vectors.shape[1])
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(vectors, np.float32)


def quantization_ranges(vectors: np.ndarray) -> np.ndarray:
    """[2, size]: each dimension's least and greatest value over calibration vectors, the bounds
    int8 and uint8 divide into 256 levels (quantize_embeddings' ``ranges``)."""
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32)


def quantized(vectors: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """``quantize_embeddings(vectors, precision, ranges)``, value for value. int8 and uint8 need
    ``ranges``: quantize_embeddings calibrates on the vectors it is given when it has none, which
    for a corpus done in parts would give each part its own scale."""
    if precision == "float32":
        return vectors.astype(np.float32, copy=False)
    if precision in ("int8", "uint8"):
        if ranges is None:
            raise InputError(f"{precision} vectors need calibration ranges")
        starts = ranges[0].astype(np.float32)
        steps = (ranges[1].astype(np.float32) - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        levels = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return levels.astype(np.uint8) if precision == "uint8" else (levels - 128).astype(np.int8)
    if precision == "binary":
        return (np.packbits(vectors > 0, axis=-1) - 128).astype(np.int8)
    if precision == "ubinary":
        return np.packbits(vectors > 0, axis=-1)
    raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def stored_size(precision: str, dimensions: int) -> int:
    """The numbers one vector holds at ``precision``: a byte per eight dimensions for the binary ones."""
    return (dimensions + 7) // 8 if precision.endswith("binary") else dimensions


def stored_dtype(precision: str) -> str:
    return {"float32": "float32", "int8": "int8", "uint8": "uint8", "binary": "int8", "ubinary": "uint8"}[precision]

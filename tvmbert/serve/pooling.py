"""Sentence embeddings from per-token outputs, as sentence-transformers computes them: a user
swapping it for tvmbert gets the same vectors."""

from __future__ import annotations

import numpy as np

MODES = ("mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens")  # sentence-transformers' pooling_mode_* names


def pool(tokens: np.ndarray, mode: str) -> np.ndarray:
    """One text's [tokens, hidden] (its real tokens only, as the package returns them) -> [hidden]."""
    if mode == "cls_token":
        return tokens[0]
    if mode == "max_tokens":
        return tokens.max(axis=0)
    summed = tokens.sum(axis=0, dtype=np.float64)
    return (summed / (np.sqrt(len(tokens)) if mode == "mean_sqrt_len_tokens" else len(tokens))).astype(np.float32)


def normalized(vector: np.ndarray) -> np.ndarray:
    """Unit length (sentence-transformers' Normalize: a zero vector stays zero)."""
    norm = float(np.linalg.norm(vector))
    return vector / max(norm, 1e-12)

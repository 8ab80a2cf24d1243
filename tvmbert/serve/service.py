"""What each route computes, apart from HTTP: a request's texts tokenized, merged into a batch
with other requests', pooled as the model's sentence-transformers config pools them (export
records it), and shaped as OpenAI's or TEI's answer."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import asdict, dataclass

import numpy as np

from tvmbert.core.errors import InputError
from tvmbert.serve import requests
from tvmbert.serve.batcher import Batcher
from tvmbert.serve.metrics import Metrics
from tvmbert.serve.pooling import MODES, normalized, pool
from tvmbert.serve.requests import RequestError


@dataclass(frozen=True)
class Limits:
    max_batch_tokens: int = 16384  # rows x longest row merged into one run (TEI's default)
    max_wait_ms: float = 0.0  # how long a request may wait for others to join its batch
    max_concurrent_requests: int = 512  # in flight at once; beyond, 429
    max_inputs_per_request: int = 256  # texts in one request; beyond, 413
    max_body_bytes: int = 2 * 2**20  # a request's body; beyond, 413


class Service:
    """The model, its batcher, the limits and the metrics the routes share."""

    def __init__(self, model, limits: Limits, pooling: str | None = None, served_name: str | None = None):
        if limits.max_batch_tokens < model.max_seq_len:
            raise InputError(f"--max-batch-tokens {limits.max_batch_tokens} is below the package's longest input "
                             f"({model.max_seq_len} tokens): one such text could never run")
        model.tokenizer()  # a package without one (or without the tokenizers package) is refused at start, not per request
        self.model, self.limits, self.metrics = model, limits, Metrics()
        packaged = model.manifest.get("pooling") or {}
        self.pooling = pooling or packaged.get("mode", "mean_tokens")
        if self.pooling not in MODES:
            raise InputError(f"--pooling must be one of {', '.join(MODES)}, got '{self.pooling}'")
        self.normalize_default = packaged.get("normalize", True)
        self.labels = model.manifest.get("labels")
        self.served_name = served_name or model.path.resolve().name
        self.per_token = {o["name"] for o in model.outputs if o["per_token"]}  # one row per token
        self.per_text = {o["name"] for o in model.outputs if not o["per_token"]}
        self.batcher: Batcher | None = None

    def start(self) -> None:
        """On the event loop that serves: the batcher's task lives there."""
        self.batcher = Batcher(self.model.run_encodings, self.limits.max_batch_tokens, self.limits.max_wait_ms / 1000, self.metrics)
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def outputs(self, texts: list[str], truncate: bool) -> tuple[dict, int]:
        """The package's outputs for ``texts``, run in a batch with other requests', and their
        token count. A text over the largest bucket is a 413, unless ``truncate``."""
        try:
            encodings = await asyncio.to_thread(self.model.tokenize, texts, truncate)
        except InputError as exc:
            raise requests.too_large(f"{exc} (or send \"truncate\": true)") from None
        return await self.batcher.submit(encodings), sum(len(e.ids) for e in encodings)

    async def vectors(self, payload: dict, field: str, normalize: bool, truncate: bool) -> tuple[list[np.ndarray], int]:
        """One pooled vector per text of ``payload[field]``, and their token count."""
        if "last_hidden_state" not in self.per_token:
            raise RequestError(400, "this package's model gives no last_hidden_state, so no embeddings: export the encoder "
                               "(--task feature-extraction)", "unsupported")
        texts = requests.texts(payload, field, self.limits.max_inputs_per_request)
        outputs, tokens = await self.outputs(texts, truncate)
        vectors = [pool(hidden, self.pooling) for hidden in outputs["last_hidden_state"]]
        return [normalized(v) for v in vectors] if normalize else vectors, tokens

    # ---- the routes' bodies in, their answers out ---------------------------------------------

    async def openai_embeddings(self, payload: dict) -> dict:
        """OpenAI's ``POST /v1/embeddings``: float32 vectors as numbers, or as base64 of their
        little-endian bytes (what the OpenAI client asks for by default)."""
        encoding = requests.choice(payload, "encoding_format", ("float", "base64"))
        model = requests.optional_string(payload, "model")
        if payload.get("dimensions") is not None:
            raise RequestError(422, "'dimensions' is not taken: this model's vectors have one size")
        vectors, tokens = await self.vectors(payload, "input", self.normalize_default, truncate=False)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model or self.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def embed(self, payload: dict) -> list:
        """TEI's ``POST /embed``."""
        normalize = requests.flag(payload, "normalize", True)
        truncate = requests.flag(payload, "truncate", False)
        vectors, _ = await self.vectors(payload, "inputs", normalize, truncate)
        return [v.tolist() for v in vectors]

    async def predict(self, payload: dict) -> list:
        """TEI's ``POST /predict`` for a sequence classifier: per text, every label with its
        softmax score, most likely first."""
        if "logits" not in self.per_text:
            raise RequestError(400, "this package's model is not a sequence classifier: export one whose config names "
                               "a ...ForSequenceClassification (--task text-classification)", "unsupported")
        truncate = requests.flag(payload, "truncate", False)
        texts = requests.texts(payload, "inputs", self.limits.max_inputs_per_request)
        outputs, _ = await self.outputs(texts, truncate)
        logits = np.asarray(outputs["logits"], dtype=np.float64)
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
        names = self.labels if self.labels and len(self.labels) == logits.shape[1] else [f"LABEL_{i}" for i in range(logits.shape[1])]
        return [[{"label": names[i], "score": float(row[i])} for i in np.argsort(-row, kind="stable")] for row in scores]

    def info(self) -> dict:
        model = self.model
        return {"model": self.served_name, "source": model.manifest["model"]["name"], "dtype": model.manifest.get("dtype"),
                "target": model.variant["target_key"], "outputs": sorted(self.per_token | self.per_text),
                "buckets": [{"batch": b.batch, "seq_len": b.seq_len, **({"tokens": b.tokens} if b.tokens else {})} for b in model.buckets],
                "max_input_tokens": model.max_seq_len, "pooling": self.pooling, "normalize": self.normalize_default,
                "labels": self.labels, "limits": asdict(self.limits)}

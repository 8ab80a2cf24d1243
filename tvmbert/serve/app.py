"""The HTTP API over an exported package, on Starlette (uvicorn runs it): OpenAI's
``POST /v1/embeddings``, TEI's ``POST /embed`` and ``POST /predict``, ``GET /health``, ``/info``,
``/metrics`` (Prometheus) and ``/openapi.json``. Every mistake in a request is one 4xx whose JSON
body says what was wrong (``{"error": ..., "type": ...}``); the server serves on."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import time
from dataclasses import dataclass

import numpy as np

from tvmbert.core.errors import InputError, TvmbertError
from tvmbert.serve.batcher import Batcher
from tvmbert.serve.metrics import Metrics
from tvmbert.serve.pooling import MODES, normalized, pool


@dataclass(frozen=True)
class Limits:
    max_batch_tokens: int = 16384  # tokens merged into one run (TEI's default)
    max_wait_ms: float = 0.0  # how long an idle server's first request waits for company
    max_concurrent_requests: int = 512  # in flight at once; beyond, 429
    max_inputs: int = 256  # texts in one request; beyond, 413
    max_body_bytes: int = 2 * 2**20  # a request's body; beyond, 413


class RequestError(InputError):
    """A request the server refuses: its status and what was wrong."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_response(status: int, message: str, kind: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message, "type": kind}, status_code=status)


class Server:
    """What the routes share: the model, its batcher, the limits and the metrics."""

    def __init__(self, model, limits: Limits, pooling: str | None = None):
        self.model, self.limits, self.metrics = model, limits, Metrics()
        manifest = model.manifest
        packaged = manifest.get("pooling") or {}
        self.pooling = pooling or packaged.get("mode", "mean_tokens")
        if self.pooling not in MODES:
            raise InputError(f"--pooling must be one of {', '.join(MODES)}")
        self.normalize_default = packaged.get("normalize", True)
        self.labels = manifest.get("labels")
        self.model_name = manifest["model"]["name"]
        self.in_flight = 0
        self.batcher: Batcher | None = None

    # ---- the requests' parts ------------------------------------------------------------------

    async def body(self, request) -> dict:
        """The JSON object a request carries: refused whole when over the limit (by its
        Content-Length, or as it streams in), not UTF-8, not JSON, or not an object."""
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limits.max_body_bytes):
            raise RequestError(413, f"the body is over {self.limits.max_body_bytes} bytes", "payload_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise RequestError(413, f"the body is over {self.limits.max_body_bytes} bytes", "payload_too_large")
            chunks.append(chunk)
        try:
            payload = json.loads(b"".join(chunks).decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestError(400, "the body is not UTF-8") from None
        except json.JSONDecodeError as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(payload).__name__}")
        return payload

    def texts(self, payload: dict, field: str) -> list[str]:
        """A string or a non-empty list of strings, within the inputs limit."""
        value = payload.get(field)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise RequestError(422, f"'{field}' must be a string or a non-empty list of strings")
        if len(value) > self.limits.max_inputs:
            raise RequestError(413, f"'{field}' holds {len(value)} inputs; this server takes at most {self.limits.max_inputs} "
                               "a request", "payload_too_large")
        bad = next((i for i, text in enumerate(value) if not isinstance(text, str)), None)
        if bad is not None:
            raise RequestError(422, f"'{field}'[{bad}] is a {type(value[bad]).__name__}: every input must be a string "
                               "(token arrays are not taken)")
        return value

    @staticmethod
    def flag(payload: dict, field: str, default: bool) -> bool:
        value = payload.get(field, default)
        if not isinstance(value, bool):
            raise RequestError(422, f"'{field}' must be true or false")
        return value

    async def outputs(self, texts: list[str], truncate: bool) -> tuple[dict, int]:
        """The package's outputs for ``texts`` (merged with other requests' by the batcher), and
        their token count. A text over the largest bucket is a 413 unless ``truncate``."""
        try:
            encodings = await asyncio.to_thread(self.model.tokenize, texts, truncate)
        except InputError as exc:
            raise RequestError(413, f"{exc} (or send \"truncate\": true)", "payload_too_large") from None
        return await self.batcher.submit(encodings), sum(len(e.ids) for e in encodings)

    def embeddings(self, outputs: dict, normalize: bool) -> list[np.ndarray]:
        if "last_hidden_state" not in outputs:
            raise RequestError(400, "this package's model has no last_hidden_state (not an encoder's features): "
                               "export it with --task feature-extraction")
        vectors = [pool(tokens, self.pooling) for tokens in outputs["last_hidden_state"]]
        return [normalized(v) for v in vectors] if normalize else vectors

    # ---- routes -------------------------------------------------------------------------------

    async def openai_embeddings(self, request):
        payload = await self.body(request)
        texts = self.texts(payload, "input")
        encoding_format = payload.get("encoding_format", "float")
        if encoding_format not in ("float", "base64"):
            raise RequestError(422, "'encoding_format' must be 'float' or 'base64'")
        outputs, tokens = await self.outputs(texts, truncate=False)
        vectors = self.embeddings(outputs, self.normalize_default)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding_format == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": payload.get("model") or self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def embed(self, request):
        payload = await self.body(request)
        texts = self.texts(payload, "inputs")
        normalize, truncate = self.flag(payload, "normalize", True), self.flag(payload, "truncate", False)
        outputs, _ = await self.outputs(texts, truncate)
        return [v.tolist() for v in self.embeddings(outputs, normalize)]

    async def predict(self, request):
        payload = await self.body(request)
        texts = self.texts(payload, "inputs")
        truncate = self.flag(payload, "truncate", False)
        outputs, _ = await self.outputs(texts, truncate)
        logits = outputs.get("logits")
        if logits is None or isinstance(logits, list):
            raise RequestError(400, "this package's model is not a sequence classifier: export it with --task text-classification")
        answers = []
        for row in np.asarray(logits, dtype=np.float64):
            scores = np.exp(row - row.max())
            scores /= scores.sum()
            labels = self.labels if self.labels and len(self.labels) == len(scores) else [f"LABEL_{i}" for i in range(len(scores))]
            answers.append(sorted(({"label": labels[i], "score": float(s)} for i, s in enumerate(scores)),
                                  key=lambda answer: -answer["score"]))
        return answers

    def info(self) -> dict:
        model = self.model
        return {"model": self.model_name, "dtype": model.manifest.get("dtype"), "target": model.variant["target_key"],
                "buckets": [{"batch": b.batch, "seq_len": b.seq_len, **({"tokens": b.tokens} if b.tokens else {})} for b in model.buckets],
                "max_input_tokens": model.max_seq_len, "pooling": self.pooling, "normalize": self.normalize_default,
                "labels": self.labels, "limits": self.limits.__dict__}


OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "tvmbert serve", "version": "1"},
    "paths": {
        "/v1/embeddings": {"post": {"summary": "OpenAI embeddings: {input: string | [string], model?, encoding_format?: float | base64}"}},
        "/embed": {"post": {"summary": "TEI embed: {inputs: string | [string], normalize?: bool, truncate?: bool} -> [[float]]"}},
        "/predict": {"post": {"summary": "TEI predict (a classifier package): {inputs, truncate?} -> [[{label, score}]]"}},
        "/health": {"get": {"summary": "200 once the model is loaded"}},
        "/info": {"get": {"summary": "model, dtype, target, buckets, limits"}},
        "/metrics": {"get": {"summary": "Prometheus metrics"}},
    },
}


def make_app(server: Server):
    """The Starlette application: each POST route admitted under the concurrency limit, its
    errors answered as JSON, its status counted."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from starlette.routing import Route

    def admitted(route: str, handler):
        async def endpoint(request):
            status = 200
            if server.in_flight >= server.limits.max_concurrent_requests:
                status = 429
                server.metrics.count(route, status)
                return error_response(429, f"{server.in_flight} requests in flight: the server takes at most "
                                      f"{server.limits.max_concurrent_requests} at once; retry", "overloaded")
            server.in_flight += 1
            try:
                return JSONResponse(await handler(request))
            except RequestError as exc:
                status = exc.status
                return error_response(exc.status, str(exc), exc.kind)
            except TvmbertError as exc:  # the package refused the inputs (InputError), or could not run
                status = 400 if isinstance(exc, InputError) else 500
                return error_response(status, str(exc), "invalid_request_error" if status == 400 else "server_error")
            finally:
                server.in_flight -= 1
                server.metrics.count(route, status)

        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.batcher = Batcher(server.model.run_encodings, server.limits.max_batch_tokens, server.limits.max_wait_ms / 1000,
                                 server.metrics)
        server.batcher.start()
        yield
        await server.batcher.stop()  # uvicorn gets here once the requests in flight have been answered

    async def not_found(request, exc):
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "not_found"
                              if exc.status_code == 404 else "invalid_request_error")

    started = time.time()
    routes = [
        Route("/v1/embeddings", admitted("/v1/embeddings", server.openai_embeddings), methods=["POST"]),
        Route("/embed", admitted("/embed", server.embed), methods=["POST"]),
        Route("/predict", admitted("/predict", server.predict), methods=["POST"]),
        Route("/health", lambda request: JSONResponse({"status": "ok", "uptime_s": round(time.time() - started, 1)})),
        Route("/info", lambda request: JSONResponse(server.info())),
        Route("/metrics", lambda request: PlainTextResponse(server.metrics.text(), media_type="text/plain; version=0.0.4")),
        Route("/openapi.json", lambda request: JSONResponse(OPENAPI)),
        Route("/docs", lambda request: HTMLResponse(
            "<html><body><h1>tvmbert serve</h1><ul>" + "".join(f"<li><code>{method.upper()} {path}</code>: {op['summary']}</li>"
                                                                for path, ops in OPENAPI["paths"].items() for method, op in ops.items())
            + "</ul><p><a href='/openapi.json'>openapi.json</a></p></body></html>")),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})


def serve(package: str, host: str = "127.0.0.1", port: int = 8080, limits: Limits = Limits(), pooling: str | None = None,
          ready=None) -> None:
    """Loads the package and serves it until SIGINT or SIGTERM: uvicorn stops taking
    connections, answers the requests in flight, then returns (and this returns, for exit 0).
    ``ready(port)`` is called once it listens (port 0: the one the OS gave)."""
    import uvicorn

    from tvmbert.deploy.package import load

    server = Server(load(package), limits, pooling)
    runner = uvicorn.Server(uvicorn.Config(make_app(server), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=30))
    listening = runner.startup

    async def startup(sockets=None):
        await listening(sockets)
        if ready is not None and runner.servers:
            ready(runner.servers[0].sockets[0].getsockname()[1])

    runner.startup = startup
    # uvicorn raises the signal it stopped on again once it has drained: handled here, it ends
    # the command with exit 0 instead of killing it.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        runner.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

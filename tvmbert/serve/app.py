"""The HTTP API over a ``Service``, on Starlette: each POST route admitted under the concurrency
limit (429 beyond it), its body read and checked, its work cancelled when the client goes away
(its place freed, its batch run without it), and every refusal one 4xx whose JSON body says what
was wrong (``{"error": ..., "type": ...}``). Nothing a request holds reaches a 500; a fault of the
server's own is a JSON 500, and the server serves on."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from tvmbert.core.errors import InputError
from tvmbert.serve import openapi
from tvmbert.serve.requests import RequestError, read_json
from tvmbert.serve.service import Service

GONE = 499  # nginx's status for a client that closed the connection before its answer (counted, never sent)
log = logging.getLogger("tvmbert.serve")


def error_response(status: int, message: str, kind: str, route: str = ""):
    """``{"error": message, "type": kind}``; on OpenAI's routes ``error`` is OpenAI's object
    (message, type, param, code), which its clients read the message from."""
    from starlette.responses import JSONResponse

    said = {"message": message, "type": kind, "param": None, "code": None} if route.startswith("/v1/") else message
    return JSONResponse({"error": said, "type": kind}, status_code=status)


async def _client_gone(receive) -> None:
    """Returns once the client has closed its connection (ASGI's http.disconnect; the body has
    been read by then, so no other message is due)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _keyed(app, api_key: str, metrics, routes: set[str]):
    """``app`` answering only requests that carry ``Authorization: Bearer <api_key>`` (the key
    compared in constant time), but ``/health`` (a load balancer's probe has no key); any other is
    a 401 with a JSON body, counted under its route (a path no route serves: "other", so that a
    scan of paths cannot grow the metrics without bound)."""
    expected = api_key.encode()

    async def keyed(scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected):
            return await app(scope, receive, send)
        route = scope["path"] if scope["path"] in routes else "other"
        metrics.count(route, 401)
        response = error_response(401, "a missing or wrong API key: send 'Authorization: Bearer <key>'", "unauthorized", route)
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    return keyed


def make_app(service: Service, started=None, api_key: str | None = None):
    """``started()`` is called once the batcher runs, before the first request is taken;
    ``api_key``: the key every route but /health wants (``_keyed``)."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    in_flight = 0

    def admitted(route: str, handler):
        async def endpoint(request):
            nonlocal in_flight
            if in_flight >= service.limits.max_concurrent_requests:
                service.metrics.count(route, 429)
                return error_response(429, f"{in_flight} requests in flight: this server takes at most "
                                      f"{service.limits.max_concurrent_requests} at once; retry", "overloaded", route)
            in_flight += 1
            service.metrics.set_gauge("tvmbert_requests_in_flight", in_flight)
            status, work, gone = 500, None, None
            try:
                payload = await read_json(request, service.limits.max_body_bytes)
                work = asyncio.ensure_future(handler(payload))
                gone = asyncio.ensure_future(_client_gone(request.receive))
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
                if not work.done():  # the client went away: nobody to answer; its batch runs without it
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    status = GONE
                    return Response(status_code=GONE)
                answer = work.result()
                status = 200
                return JSONResponse(answer)
            except RequestError as exc:
                status = exc.status
                return error_response(exc.status, str(exc), exc.kind, route)
            except InputError as exc:  # the package refused what the checks let through
                status = 400
                return error_response(400, str(exc), "invalid_request_error", route)
            except Exception as exc:  # noqa: BLE001 - the server's own fault: said as JSON, logged, served on
                log.exception("%s failed", route)
                return error_response(500, f"the server failed on this request ({type(exc).__name__}: {exc})", "server_error",
                                      route)
            finally:
                for task in (work, gone):  # done ones ignore it; both, if this request itself was cancelled
                    if task is not None:
                        task.cancel()
                in_flight -= 1
                service.metrics.set_gauge("tvmbert_requests_in_flight", in_flight)
                service.metrics.count(route, status)

        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        if started is not None:
            started()
        yield
        await service.stop()  # uvicorn gets here once the requests in flight have been answered

    async def refused(request, exc):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind, request.url.path)

    up_since = time.time()
    routes = [
        Route("/v1/embeddings", admitted("/v1/embeddings", service.openai_embeddings), methods=["POST"]),
        Route("/embed", admitted("/embed", service.embed), methods=["POST"]),
        Route("/tokenize", admitted("/tokenize", service.tokenize), methods=["POST"]),
        Route("/decode", admitted("/decode", service.decode), methods=["POST"]),
        Route("/predict", admitted("/predict", service.predict), methods=["POST"]),
        Route("/rerank", admitted("/rerank", service.rerank), methods=["POST"]),
        Route("/classify_tokens", admitted("/classify_tokens", service.classify_tokens), methods=["POST"]),
        Route("/answer", admitted("/answer", service.answer), methods=["POST"]),
        Route("/health", lambda request: JSONResponse({"status": "ok", "uptime_s": round(time.time() - up_since, 1)})),
        Route("/info", lambda request: JSONResponse(service.info())),
        Route("/metrics", lambda request: PlainTextResponse(service.metrics.text(), media_type="text/plain; version=0.0.4")),
        Route("/openapi.json", lambda request: JSONResponse(openapi.document())),
        Route("/docs", lambda request: HTMLResponse(openapi.page(service.served_name))),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: refused, 405: refused})
    return _keyed(app, api_key, service.metrics, {route.path for route in routes}) if api_key else app

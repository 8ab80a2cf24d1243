"""`tvmbert serve`'s process: the package loaded, a socket bound (a port taken or refused is one
clear error, before anything serves), uvicorn serving the app until SIGINT or SIGTERM, then
draining: it stops taking connections, answers the requests in flight, and returns (exit 0)."""

from __future__ import annotations

import contextlib
import importlib.abc
import ipaddress
import signal
import socket
import sys

from tvmbert.core.errors import InputError
from tvmbert.serve.service import Limits, Service

DRAIN_S = 30  # the longest a SIGTERM waits for the requests in flight


class _TorchKeptOut(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` fail in the server's process. TVM's FFI imports torch whenever it
    is installed (for DLPack exchange a server never does): seconds at start and hundreds of MB
    resident for nothing. tvm_ffi takes the ImportError as "no torch", as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r} (tvmbert serve keeps torch out of its process)", name=name)
        return None


def keep_torch_out() -> None:
    """Before TVM is first imported; a process that has torch already keeps it."""
    if "torch" not in sys.modules and not any(isinstance(f, _TorchKeptOut) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchKeptOut())


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: one the OS picks)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to say when a server without a key listens beyond this machine (every interface, or
    an address others reach): anyone who reaches the port can use it."""
    if api_key:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if loopback:
        return None
    return (f"serve: warning: listening on {host} without --api-key: anyone who reaches this port can use the model "
            "(set --api-key, TVMBERT_API_KEY or --api-key-file)")


def serve(package: str, host: str = "127.0.0.1", port: int = 8080, limits: Limits | None = None, pooling: str | None = None,
          served_name: str | None = None, ready=None, api_key: str | None = None) -> None:
    """Serves ``package`` until SIGINT or SIGTERM. ``ready(host, port)`` is called once the
    socket listens and the batcher runs; ``api_key``: what every route but /health wants."""
    import uvicorn

    keep_torch_out()
    from tvmbert.deploy.package import load
    from tvmbert.serve.app import make_app

    service = Service(load(package), limits or Limits(), pooling, served_name)
    sock = listen(host, port)
    app = make_app(service, started=None if ready is None else lambda: ready(host, sock.getsockname()[1]), api_key=api_key)
    runner = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=DRAIN_S))
    # uvicorn raises the signal it stopped on again once it has drained: this handler then lets
    # this return, so the command exits 0 instead of being killed by it; before uvicorn takes the
    # signals (and after), it asks uvicorn to stop all the same.
    stopping = lambda *_: setattr(runner, "should_exit", True)
    previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.closing(sock):
            runner.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

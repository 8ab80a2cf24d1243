"""`tvmbert serve PKG --ray --replicas N`: the same application in N Ray Serve replicas, each
with its own package, batcher and limits, behind Ray's HTTP proxy, which spreads requests over
them and starts a new replica where one dies. Ray's own cluster (``ray start`` on each machine,
``--ray-address``) takes it past one machine; without one, a local cluster is started.

Each answer names the replica that gave it (``x-tvmbert-replica: <Ray's replica id>; pid=<pid>``).
A request in flight on a replica that dies is answered 5xx by the proxy: clients retry those, as
the OpenAI client does by default."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

from ray import serve

from tvmbert.core.errors import InputError, StageFailed
from tvmbert.serve.service import Limits, Service

APP_NAME = "tvmbert"
REPLICA_HEADER = b"x-tvmbert-replica"
SHUTDOWN_S = 30  # a replica stopping answers what it holds for at most this long
# SIGTERM to exit, at most: the replicas' drain, then Serve's and the cluster's own stop. Past it,
# or at a second SIGTERM, every process this one started (a local cluster's GCS, raylet,
# dashboard and replicas) is killed: Serve's delete waited on a replica Ray was replacing for minutes.
STOP_S = SHUTDOWN_S + 15
# Ray Serve gives its proxy 5 s to come up and kills it after three misses: on a machine busy
# with other work (or starting replicas) it missed them and never served. Read by Ray's
# processes at start, so set before the cluster starts; a value the user set wins.
RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def _named(app, name: str):
    """``app`` answering with REPLICA_HEADER on every response."""
    async def named(scope, receive, send):
        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, name.encode())]}
            await send(message)

        await app(scope, receive, send_named)

    return named


@serve.ingress()
class Replica:
    """One replica: the package loaded in its process (torch kept out), the app over it."""

    def __init__(self, package: str, limits: Limits, pooling: str | None, served_name: str | None, api_key: str | None = None):
        from tvmbert.serve.run import keep_torch_out

        keep_torch_out()
        from tvmbert.deploy.package import load

        self.service = Service(load(package), limits, pooling, served_name)
        self.api_key = api_key

    def __serve_build_asgi_app__(self):
        from tvmbert.serve.app import make_app

        replica = serve.get_replica_context().replica_id.unique_id
        return _named(make_app(self.service, api_key=self.api_key), f"{replica}; pid={os.getpid()}")


def deployment(package: str, limits: Limits, pooling: str | None, served_name: str | None, replicas: int, cpus: float,
               api_key: str | None = None):
    """The deployment bound to its arguments: ``replicas`` copies, each given ``cpus`` of Ray's
    CPUs and as many TVM threads (whole ones, at least one), at most the limit's requests each
    and as many waiting at Ray's proxy (beyond, it answers 503; its default queue has no end)."""
    threads = str(max(1, int(cpus)))
    return serve.deployment(Replica, name="tvmbert", num_replicas=replicas,
                            max_ongoing_requests=limits.max_concurrent_requests,
                            max_queued_requests=limits.max_concurrent_requests, graceful_shutdown_timeout_s=SHUTDOWN_S,
                            ray_actor_options={"num_cpus": cpus, "runtime_env": {"env_vars": {"TVM_NUM_THREADS": threads}}},
                            ).bind(os.path.abspath(package), limits, pooling, served_name, api_key)


def serve_on_ray(package: str, host: str, port: int, limits: Limits, pooling: str | None, served_name: str | None,
                 replicas: int, cpus: float, address: str | None = None, ready=None, api_key: str | None = None) -> None:
    """Serves until SIGINT or SIGTERM, then deletes the application (its replicas answer what
    they hold first) and leaves the cluster (a local one stops, with its Serve), within STOP_S."""
    import ray

    from tvmbert.deploy.package import load
    from tvmbert.serve.run import listen

    if port == 0:
        raise InputError("--ray needs a --port of its own: Ray's proxy does not say which one the OS picked")
    Service(load(package), limits, pooling, served_name)  # what a replica would refuse, said here in one line
    listen(host, port).close()  # a port taken, said here: Ray's proxy would retry it forever
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    try:
        address = address or os.environ.get("RAY_ADDRESS") or "local"  # local: a cluster of its own, never another's
        local_only = address == "local" and host in ("127.0.0.1", "localhost")  # the cluster's own ports on loopback too
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({"_node_ip_address": "127.0.0.1"} if local_only else {}))
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise InputError(f"cannot reach the Ray cluster at {address}: {exc}") from None
    stop, stopped, left = threading.Event(), threading.Event(), threading.Event()
    signals = []

    def on_signal(*_):
        signals.append(True)
        stop.set()
        if len(signals) > 1:
            stopped.set()  # a second one: no more waiting for the drain

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    leaving = None
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(deployment(package, limits, pooling, served_name, replicas, cpus, api_key), name=APP_NAME, route_prefix="/",
                      blocking=False)
        except RuntimeError as exc:  # a replica that failed to start: the package's error, said by Ray
            raise InputError(f"the replicas did not start: {str(exc).strip().splitlines()[-1]}") from None
        if ready is not None:
            ready(host, port)
        stop.wait()
        leaving = threading.Thread(target=_leave, args=(address == "local", left, stopped), daemon=True)
        leaving.start()
        stopped.wait(STOP_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if leaving is None:  # it never served: the cluster goes as it came
            ray.shutdown()
    if not left.is_set():
        _kill_started_processes()
        # Ray's exit hooks and its threads would wait on (or crash at) the cluster just killed:
        # once the CLI has said why, the process ends before them.
        atexit.register(_exit_now, StageFailed.exit_code)
        when = "at a second signal" if len(signals) > 1 else f"within {STOP_S} s of the first"
        raise StageFailed(f"Ray Serve had not stopped {when}: the processes this server started were killed")


def _leave(local: bool, left: threading.Event, stopped: threading.Event) -> None:
    """Deletes the application (its replicas answer what they hold first) and leaves the cluster
    (a local one stops, with its Serve; a cluster of others' keeps its Serve for their applications)."""
    import ray

    try:
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()
        ray.shutdown()
        left.set()
    finally:
        stopped.set()


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _kill_started_processes() -> None:
    """SIGKILL to every process this one started and theirs (Ray starts a local cluster's
    processes as children of its driver, the replicas as the raylet's)."""
    import psutil

    started = psutil.Process().children(recursive=True)
    for process in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(started, timeout=10)

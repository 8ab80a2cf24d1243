"""Where MetaSchedule candidates are built and measured: fast local workers, or an RPC tracker.

Stock LocalBuilder starts a new process pool for every batch, and each worker imports TVM and
registers every tensor intrinsic (~20 s); that is most of raw MetaSchedule's ~4 trials a minute
here. These workers live for the whole tuning run. This module must not import torch: its
functions travel to the workers by value.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading

import cloudpickle

from tvmbert.core.errors import InputError


def candidate_build(mod, target, _params=None):
    """meta_schedule's default build without importing the tensor-intrinsic registry, which a
    candidate (already tensorized if at all) does not need: its CUDA intrinsics alone outran the
    builder's 30 s timeout in each worker on 2 cores, and no GPU candidate was ever built."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def export_shared_library(rt_mod) -> str:
    """Linked in the builder's worker, not serially by the runner."""
    path = os.path.join(tempfile.mkdtemp(prefix="tvmbert_candidate_"), "candidate.so")
    rt_mod.export_library(path)
    return path


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _builder_class():
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class PersistentBuilder(PyBuilder):
        """LocalBuilder's isolation (child processes, timeout, a crash kills one worker), with
        one pool for the whole run; workers are recycled now and then to bound leaks."""

        def __init__(self, max_workers: int, timeout_sec: float = 30.0, max_uses: int = 256):
            super().__init__()
            self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec, maximum_process_uses=max_uses)
            self.timeout_sec = timeout_sec

        def build(self, build_inputs):
            # TVM's own default_build and default_export are registered FFI functions, which do not pickle.
            args = [(candidate_build, export_shared_library, item.mod, item.target, _serialize_params(item.params)) for item in build_inputs]
            results = []
            for outcome in self.pool.map_with_error_catching(lambda packed: _worker_func(*packed), args):
                if outcome.status == StatusKind.COMPLETE:
                    results.append(BuilderResult(outcome.value, None))
                elif outcome.status == StatusKind.TIMEOUT:
                    results.append(BuilderResult(None, f"build timed out after {self.timeout_sec} s"))
                else:
                    results.append(BuilderResult(None, f"build failed: {outcome.value}"))
            return results

        def shutdown(self):
            self.pool.shutdown()

    return PersistentBuilder


def make_builder(workers: int):
    return _builder_class()(max_workers=workers)


def evaluator(cold: bool):
    """How a candidate is timed. ``cold`` (CPU targets): every run starts with the kernel's inputs
    other than the first (the weights) flushed from the caches, as in an inference, which streams
    all the weights once; timed hot, a bert-base 1x14 matmul looks several times faster than it
    runs there (docs/benchmarks.md, Tuning), and the search picks schedules that read weights in cache-friendly but DRAM-hostile orders.
    Hot (GPUs): 3 runs of at least 100 ms."""
    from tvm.s_tir import meta_schedule as ms

    if cold:
        return ms.runner.EvaluatorConfig(number=1, repeat=10, min_repeat_ms=0, enable_cpu_cache_flush=True)
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=100, enable_cpu_cache_flush=False)


def make_local_runner(cold: bool):
    """LocalRunner already keeps one worker process for the run and restarts it on a crash."""
    from tvm.s_tir import meta_schedule as ms

    return ms.runner.LocalRunner(timeout_sec=30.0, evaluator_config=evaluator(cold))


def parse_tracker(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--rpc-tracker must be HOST:PORT, got '{address}'")
    return host, int(port)


def check_tracker(address: str, key: str, timeout: float = 3.0) -> int:
    """The number of free servers for ``key``; one clear error within ``timeout`` otherwise.

    tvm.rpc.connect_tracker retries a refused connection for 60 s, and asking a tracker for a key
    nobody serves blocks forever: probe first, with timeouts, in a thread.
    """
    from tvm import rpc

    host, port = parse_tracker(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise InputError(f"RPC tracker {address} is unreachable: {exc.strerror or exc}") from None
    answer: dict = {}

    def ask():
        try:
            session = rpc.connect_tracker(host, port)
            answer["summary"] = session.summary()
            session.close()
        except Exception as exc:  # noqa: BLE001 - reported as one line below
            answer["error"] = exc

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or "error" in answer:
        raise InputError(f"{address} is not answering as a TVM RPC tracker within {timeout:.0f} s")
    queues = answer["summary"].get("queue_info", {})
    if key not in queues:
        known = ", ".join(sorted(queues)) or "none"
        raise InputError(f"no device is registered with key '{key}' at tracker {address} (keys there: {known})")
    servers = sum(1 for server in answer["summary"].get("server_info", []) if server["key"].split(":", 1)[-1] == key)
    return max(servers, int(queues[key].get("free", 0)))


def make_rpc_runner(address: str, key: str, servers: int, cold: bool):
    from tvm.s_tir import meta_schedule as ms

    host, port = parse_tracker(address)
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key, session_priority=1,
                                 session_timeout_sec=60)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator(cold), max_workers=max(1, servers))

"""Fair timing: one thread count for every engine, interleaved rounds, summary statistics, and
the machine they were taken on."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import platform
import time
from collections.abc import Callable

import numpy as np

from tvmbert.core import targets
from tvmbert.core.registry import ENGINES
from tvmbert.core.targets import HOST_CPUS, cpu_count
from tvmbert.stages.bench.engines import Engine
from tvmbert.stages.job import Job

MAX_RUNS_FACTOR = 50  # a safety stop: never more than repeat x this many runs per engine
# A round of one engine: untimed calls for ROUND_WARM_S (at least one: its thread pool wakes),
# then timed calls for ROUND_S and at least ROUND_RUNS. Short calls thus get timed back to back
# in a steady state, as a user calling them sees them: a few calls after each quiet wait time the
# wait's wake-up too (bert-tiny's median and p99 both grew: CHANGELOG.md, 2026-11-25).
ROUND_RUNS = 3
ROUND_WARM_S = 0.002
ROUND_S = 0.02
# Thread pools spin after a call (OpenMP's, ONNX Runtime's, TVM's), then sleep: a round starts
# once the process has used less than QUIET_SHARE of a core for QUIET_WINDOW_S, so that no engine
# competes with the threads the previous one left spinning (at most QUIET_MAX_S of waiting).
QUIET_WINDOW_S = 0.005
QUIET_SHARE = 0.1
QUIET_MAX_S = 1.0
IDLE_S = 0.2  # "after idle": a call after this long without calls, as bursty traffic makes them
IDLE_RUNS = 5
# The machine's own jitter, timed in the same rounds: a fixed single-thread task (a SHA-256 of
# JITTER_BYTES, under a millisecond) JITTER_RUNS times a round. Its p99 over its median is the tail
# no engine can beat here (a shared VM's moves within the hour: docs/benchmarks.md).
JITTER_BYTES = 2**20
JITTER_RUNS = 3


def set_threads(threads: int) -> None:
    """The same thread count for every engine."""
    import torch
    import tvm

    torch.set_num_threads(threads)
    # -3: the threads share every core, unpinned like PyTorch's (mode 1 would pin this process).
    tvm.get_global_func("runtime.config_threadpool")(-3, threads, [str(cpu) for cpu in HOST_CPUS])


def wait_until_quiet() -> float:
    """Waits until this process's threads stop spinning; returns the seconds that took."""
    started = time.perf_counter()
    while time.perf_counter() - started < QUIET_MAX_S:
        cpu = time.process_time()
        time.sleep(QUIET_WINDOW_S)
        if time.process_time() - cpu < QUIET_SHARE * QUIET_WINDOW_S:
            break
    return time.perf_counter() - started


@contextlib.contextmanager
def engines_objects_frozen():
    """Python's cyclic garbage collector kept off every object the engines were set up with: one
    process holds them all (PyTorch, Inductor, OpenVINO: millions of objects), and a collection
    that traverses them lands in whichever engine's call happens to allocate, a cost no process
    running one engine pays (tvm's p99 in make demo on a loaded VM was up to twice as far from its
    median: CHANGELOG.md, 2026-11-25). What the rounds themselves allocate is collected between them."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def collector_off():
    """No collection inside timed calls, as ``timeit`` and pyperf time; the caller collects between."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def measure(engines: list[Engine], warmup: int, repeat: int, min_time_s: float,
            between_rounds: Callable[[], object] | None = None) -> dict:
    """Rounds per engine until every engine has enough: each starts once the previous engine's
    threads are quiet, with untimed calls that wake this engine's own (what a user calling it
    back to back never pays), then timed calls (ROUND_S, ROUND_RUNS). Then each engine's latency
    after idle. The garbage collector runs between rounds, never inside one. ``between_rounds``
    is called after each pass over the engines, once their threads are quiet: a probe of the
    machine (bench's floor) timed in the same rounds. Returns the machine's jitter in the same
    rounds (``jitter_summary``)."""
    for engine in engines:
        for _ in range(warmup):
            engine.run()
    with engines_objects_frozen():
        jitter_ms = _rounds(engines, repeat, min_time_s, between_rounds)
        for _ in range(IDLE_RUNS):
            for engine in engines:
                gc.collect()
                wait_until_quiet()
                time.sleep(IDLE_S)
                with collector_off():
                    started = time.perf_counter()
                    engine.run()
                    engine.after_idle_ms.append((time.perf_counter() - started) * 1000.0)
    return jitter_summary(jitter_ms)


def jitter_summary(jitter_ms: list[float]) -> dict:
    values = np.array(jitter_ms)
    median = float(np.median(values))
    return {"median_ms": round(median, 4), "p99_ratio": round(float(np.percentile(values, 99)) / median, 3),
            "runs": len(values)}


def _rounds(engines: list[Engine], repeat: int, min_time_s: float, between_rounds: Callable[[], object] | None) -> list[float]:
    """The engines' rounds; returns the jitter task's timings, a few after each round."""
    block = bytes(JITTER_BYTES)
    jitter_ms = []
    spent = {engine.name: 0.0 for engine in engines}
    while any(len(e.timings_ms) < repeat or spent[e.name] < min_time_s for e in engines):
        if all(len(e.timings_ms) >= repeat * MAX_RUNS_FACTOR for e in engines):
            break
        for engine in engines:
            gc.collect()
            engine.quiet_ms.append(wait_until_quiet() * 1000.0)
            timed, runs = 0.0, 0
            with collector_off():
                woken = time.perf_counter()
                engine.run()
                while time.perf_counter() - woken < ROUND_WARM_S:
                    engine.run()
                while runs < ROUND_RUNS or timed < ROUND_S:
                    started = time.perf_counter()
                    engine.run()
                    elapsed = time.perf_counter() - started
                    engine.timings_ms.append(elapsed * 1000.0)
                    timed, runs = timed + elapsed, runs + 1
                for _ in range(JITTER_RUNS):
                    started = time.perf_counter()
                    hashlib.sha256(block).digest()
                    jitter_ms.append((time.perf_counter() - started) * 1000.0)
            spent[engine.name] += timed
        if between_rounds is not None:
            gc.collect()
            wait_until_quiet()
            with collector_off():
                between_rounds()
    return jitter_ms


def _summary(engine: Engine, batch: int) -> dict:
    values = np.array(engine.timings_ms)
    median = float(np.median(values))
    return {
        "median_ms": round(median, 4),
        "p90_ms": round(float(np.percentile(values, 90)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "mean_ms": round(float(values.mean()), 4),
        "after_idle_ms": round(float(np.median(engine.after_idle_ms)), 4) if engine.after_idle_ms else None,
        "quiet_after_ms": round(float(np.median(engine.quiet_ms)), 2) if engine.quiet_ms else None,
        "runs": len(values),
        "throughput": round(batch * 1000.0 / median, 2),  # sequences per second
        "setup_s": round(engine.setup_s, 2),
        "memory_mb": round(engine.memory_mb, 1),
    }


def _ratios(engines: dict, dtype: str = "float32") -> dict:
    """ratio: tvm's median over the best other engine's (below 1: tvm is faster), for a quantized
    dtype the best engine quantized to it where one was timed (int8 against int8);
    speedup: torch-eager's median over tvm's; packed_speedup: tvm's over tvm-packed's (the
    padded build over the packed one; not a peer, so never the best other). An engine beyond the
    bench's bound is in none of them: a wrong answer's speed is no rival's (``left_out_of_ratio``)."""
    timed = {name: stats["median_ms"] for name, stats in engines.items() if "median_ms" in stats and not beyond_bound(stats)}
    if "tvm" not in timed:
        return {"ratio": None, "best_other": None, "speedup": None, "packed_speedup": None}
    others = {name: median for name, median in timed.items() if name not in ("tvm", "tvm-packed")}
    alike = {name: median for name, median in others.items() if ENGINES[name].quantized == dtype}
    others = alike or others
    best = min(others, key=others.get) if others else None
    return {
        "ratio": round(timed["tvm"] / others[best], 3) if best else None,
        "best_other": best,
        "speedup": round(timed["torch-eager"] / timed["tvm"], 3) if "torch-eager" in timed else None,
        "packed_speedup": round(timed["tvm"] / timed["tvm-packed"], 3) if "tvm-packed" in timed else None,
    }


def beyond_bound(stats: dict) -> bool:
    """A timed engine whose results differ from the reference by more than the bench's bound."""
    return "accuracy" in stats and not stats["accuracy"]["within"]


def left_out_of_ratio(name: str, measured: list[tuple[str | None, dict]]) -> str:
    """Why an engine beyond the bound is timed but in no ratio, with its error at each shape
    (``measured``: a shape's label, or None for one shape, and the engine's ``accuracy`` there)."""
    diffs = ", ".join(f"{accuracy['max_abs_diff']:.3g}" + (f" at {label}" if label else "") for label, accuracy in measured)
    return (f"{name}'s results are beyond the bench's bound ({measured[0][1]['bound']:.3g}): max abs diff {diffs}; timed, "
            + ("no tvm / best other" if name == "tvm" else "left out of tvm / best other"))


def environment(job: Job, threads: int) -> dict:
    import importlib.metadata

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = {"model name": platform.processor()}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor says it all
                key, _, value = line.partition(":")
                cpu[key.strip()] = value.strip()
    except OSError:
        pass
    family = f" (family {cpu['cpu family']} model {cpu['model']})" if "cpu family" in cpu and "model" in cpu else ""
    flags = targets.host_flags()
    return {
        "cpu": cpu["model name"] + family,
        # What the figures were measured with: an AVX2 machine and an AVX-512 one are different products.
        "instruction_sets": [name for name, flag in targets.INSTRUCTION_SETS.items() if flag in flags] + [name for name in ("amx-bf16", "amx-int8") if name.replace("-", "_") in flags],
        "cores": cpu_count(),
        "threads": threads,
        "target": job.target.key,
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "apache-tvm", "onnxruntime", "openvino", "transformers")},
    }

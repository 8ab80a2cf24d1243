"""Stage 7: latency of the TVM build against PyTorch, measured fairly in one run.

Same weights, same inputs, same thread count; outputs checked before timing; engines interleaved
call by call so that machine drift hits all of them alike; medians and percentiles reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import models
from .build import build
from .errors import ToolchainError
from .job import Job
from .runtime import CompiledModel
from .targets import HOST_CPUS, cpu_count
from .verify import DEFAULT_TOLERANCE

MAX_RUNS_FACTOR = 50  # a safety stop: never more than repeat x this many runs per engine


@dataclass
class Engine:
    name: str
    run: Callable[[], object]  # one inference, synchronized
    outputs: Callable[[], list[np.ndarray]]  # one inference, results on the host
    timings_ms: list[float] = field(default_factory=list)


def set_threads(threads: int) -> None:
    """The same thread count for every engine."""
    import torch
    import tvm

    torch.set_num_threads(threads)
    # -3: the threads share every core, unpinned like PyTorch's (mode 1 would pin this process).
    tvm.get_global_func("runtime.config_threadpool")(-3, threads, [str(cpu) for cpu in HOST_CPUS])


def _tvm_engine(job: Job) -> Engine:
    built = job.upstream("build", build)
    compiled = CompiledModel(built, job.target.device())
    device_inputs = compiled.to_device([t.numpy() for t in job.inputs.as_tuple()])

    def run():
        compiled.run_on_device(device_inputs)
        compiled.sync()

    return Engine("tvm", run, lambda: compiled([t.numpy() for t in job.inputs.as_tuple()]))


def _torch_engine(job: Job, name: str, attention: str) -> Engine:
    import torch

    model = models.load(job.source, job.config.dtype, job.config.seed, attn_implementation=attention)
    inputs = job.inputs.as_tuple()

    def run():
        with torch.inference_mode():
            return model(*inputs)

    return Engine(name, run, lambda: [t.numpy() for t in run()])


def _summary(timings_ms: list[float], batch: int) -> dict:
    values = np.array(timings_ms)
    median = float(np.median(values))
    return {
        "median_ms": round(median, 4),
        "p90_ms": round(float(np.percentile(values, 90)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "mean_ms": round(float(values.mean()), 4),
        "runs": len(timings_ms),
        "throughput": round(batch * 1000.0 / median, 2),  # sequences per second
    }


def measure(engines: list[Engine], warmup: int, repeat: int, min_time_s: float) -> None:
    """Round-robin: one timed call per engine per round, until every engine has enough."""
    for engine in engines:
        for _ in range(warmup):
            engine.run()
    spent = {engine.name: 0.0 for engine in engines}
    while any(len(e.timings_ms) < repeat or spent[e.name] < min_time_s for e in engines):
        if all(len(e.timings_ms) >= repeat * MAX_RUNS_FACTOR for e in engines):
            break
        for engine in engines:
            started = time.perf_counter()
            engine.run()
            elapsed = time.perf_counter() - started
            engine.timings_ms.append(elapsed * 1000.0)
            spent[engine.name] += elapsed


def bench(job: Job) -> dict:
    if not job.target.device_present():
        raise ToolchainError(f"bench runs the model: this machine has no {job.target.kind} device")
    options = job.config.bench
    threads = options.threads or cpu_count()
    set_threads(threads)
    reference = _torch_engine(job, "torch-eager", "eager")
    engines = [_tvm_engine(job), reference]
    expected = reference.outputs()
    tolerance = DEFAULT_TOLERANCE[job.config.dtype]
    report: dict = {}
    timed = []
    for engine in engines:
        error = max(float(np.abs(got - want).max()) for got, want in zip(engine.outputs(), expected))
        if error > tolerance:
            report[engine.name] = {"skipped": f"wrong results: max abs diff {error:.3g} > {tolerance:.3g}"}
        else:
            timed.append(engine)
    job.say(f"bench: {', '.join(e.name for e in timed)} on {threads} threads, warm-up {options.warmup}, "
            f">= {options.repeat} runs and >= {options.min_time_s} s each, interleaved")
    measure(timed, options.warmup, options.repeat, options.min_time_s)
    batch, seq_len = job.inputs.shape
    for engine in timed:
        report[engine.name] = _summary(engine.timings_ms, batch)
    result = {
        "model": job.source.name,
        "shape": {"batch": batch, "seq_len": seq_len},
        "dtype": job.config.dtype,
        "target": job.target.key,
        "threads": threads,
        "engines": report,
        "speedup": None,
    }
    if "median_ms" in report.get("tvm", {}) and "median_ms" in report.get("torch-eager", {}):
        result["speedup"] = round(report["torch-eager"]["median_ms"] / report["tvm"]["median_ms"], 3)
    return result

"""The inference bench: every engine on the same inputs, per shape of a sweep (batch, sequence
length, padding), checked then timed together."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import numpy as np

from tvmbert.core.config import torch_dtype
from tvmbert.core.errors import InputError, ToolchainError
from tvmbert.core.families import TASKS
from tvmbert.core.targets import cpu_count
from tvmbert.frontend.models import sizes
from tvmbert.stages.bench import floor
from tvmbert.stages.bench.engines import (
    IN_PEER_DTYPE,
    QUANTIZED_PEERS,
    Incomparable,
    _check,
    _make,
    check_engines,
    check_tolerance,
    default_engines,
    failure_line,
    peer_dtype,
    reference,
    why_unavailable,
)
from tvmbert.stages.bench.timing import _ratios, _summary, environment, left_out_of_ratio, measure, set_threads
from tvmbert.stages.build import build
from tvmbert.stages.job import Job


@dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    padding: float  # fraction of every sequence that is padding in the attention mask


def padded_inputs(job: Job, padding: float) -> tuple:
    """The job's example inputs with the last ``padding`` fraction of every sequence masked out
    (and zero there in every input)."""
    inputs = tuple(t.clone() for t in job.inputs.as_tuple())
    seq_len = inputs[0].shape[1]
    real = max(1, seq_len - int(round(seq_len * padding)))
    for tensor in inputs:
        tensor[:, real:] = 0
    return inputs


def bench_shape(job: Job, shape: Shape, engine_names: tuple[str, ...], threads: int,
                machine_floor: tuple[floor.Floor, floor.FmaProbe] | None) -> dict:
    """One shape: every engine set up, checked, then timed together; with ``machine_floor`` (fp32
    and fp64 on a CPU), the FMA probe timed between their rounds, the shape's floor at its median
    rate and each engine's share of it."""
    options = job.config.bench
    inputs = padded_inputs(job, shape.padding)
    mask = inputs[job.inputs.names.index("attention_mask")].numpy()
    report: dict = {}
    engines = []
    built = job.upstream("build", build)  # built (or found) first: memory_mb and setup_s are about running it
    per_token = [output["name"] in TASKS[job.source.task].per_token for output in built.meta["outputs"]]
    for name in engine_names:
        reason = why_unavailable(name, job)
        if reason is None and name == "tvm":
            engines.append(_make(name, job, inputs, threads))  # the subject: its failures are errors
            continue
        if reason is None:
            try:
                engines.append(_make(name, job, inputs, threads))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is skipped, with the reason
                reason = f"failed to set up: {failure_line(exc)}"
        if reason is not None:
            report[name] = {"skipped": reason}
            job.say(f"bench: {name} skipped: {reason}")
    eager = next((e for e in engines if e.name == "torch-eager"), None)
    if eager is not None and peer_dtype(job.config.dtype, job.target.is_gpu) == torch_dtype(job.config.dtype):
        expected = [np.asarray(o) for o in eager.outputs()]
    else:  # no eager engine, or it runs in bf16: the fp32 reference apart
        expected = reference(job, inputs)
    timed, accuracy = [], {}
    for engine in engines:
        try:
            accuracy[engine.name] = _check(engine, expected, mask, per_token,
                                           check_tolerance(engine.name, job.config.dtype, job.target.is_gpu))
        except Exception as exc:  # noqa: BLE001 - an engine that fails to run or answers nothing comparable is not timed
            problem = str(exc) if isinstance(exc, Incomparable) else f"failed to run: {failure_line(exc)}"
            report[engine.name] = {"skipped": problem}
            job.say(f"bench: {engine.name} not timed: {problem}")
            continue
        timed.append(engine)
        if not accuracy[engine.name]["within"]:
            job.say(f"bench: {left_out_of_ratio(engine.name, [(None, accuracy[engine.name])])}")
    job.say(f"bench: {shape.batch}x{shape.seq_len} padding {shape.padding:g}: {', '.join(e.name for e in timed)} on "
            f"{threads} threads, >= {options.repeat} runs and >= {options.min_time_s} s each, interleaved")
    start_floor, probe = machine_floor or (None, None)
    rates = []  # the probe's, between this shape's rounds
    jitter = measure(timed, options.warmup, options.repeat, options.min_time_s,
                     between_rounds=(lambda: rates.append(probe())) if probe else None)
    model_sizes = sizes(job.source)
    gflop = model_sizes.flops(shape.batch, shape.seq_len) / 1e9  # the whole shape's, padding included: what each engine runs
    floor_ms, bound, shape_floor = None, None, {}
    if start_floor and rates:  # (no rounds where no engine passed its check)
        peak = float(np.median(rates))
        floor_ms, bound = dataclasses.replace(start_floor, fma_gflop_per_s=peak).shape_ms(model_sizes, shape.batch, shape.seq_len)
        shape_floor = {"fma_gflop_per_s": round(peak, 1), "floor_ms": round(floor_ms, 3), "bound": bound}
    for engine in timed:
        report[engine.name] = _summary(engine, shape.batch)
        report[engine.name]["gflop_per_s"] = round(gflop / (report[engine.name]["median_ms"] / 1000), 1)
        if floor_ms is not None and floor.applies_to(engine.name):
            report[engine.name]["of_floor"] = round(floor_ms / report[engine.name]["median_ms"], 3)
        report[engine.name]["accuracy"] = accuracy[engine.name]
    ordered = {name: report[name] for name in engine_names if name in report}
    return {"batch": shape.batch, "seq_len": shape.seq_len, "padding": shape.padding, "gflop": round(gflop, 2), **shape_floor,
            "engines": ordered,
            **_ratios(ordered, job.config.dtype),
            "machine_jitter": jitter, "random_weights": built.meta.get("random_weights", [])}


def engine_dtypes(dtype: str, engines, gpu: bool = False) -> dict[str, str]:
    """What each engine computes in, as the report says it."""
    described = {}
    for name in engines:
        if name.startswith("tvm"):
            described[name] = {"float16": "float16 matmuls accumulating in fp32, the rest fp32",
                               "bfloat16": "bfloat16 weight matmuls on AMX accumulating in fp32, the rest fp32",
                               "int8": "int8 weight matmuls (weights per channel, rows per row at run time, int32 sums), "
                                       "the rest fp32"}.get(dtype, dtype)
        elif name in QUANTIZED_PEERS:
            described[name] = QUANTIZED_PEERS[name]
        elif name in IN_PEER_DTYPE:
            peer = peer_dtype(dtype, gpu)
            described[name] = f"{peer} (model cast to {peer})" if peer != torch_dtype(dtype) else peer
        else:
            described[name] = torch_dtype(dtype)
    return described


def bench(job: Job, batches: tuple[int, ...] = (), seq_lens: tuple[int, ...] = (), paddings: tuple[float, ...] = (0.0,),
          packed: bool = False) -> dict:
    """Every engine (default: ``default_engines`` of the job's dtype; ``packed`` adds tvm-packed)
    at each shape."""
    engines = job.config.bench.engines or default_engines(job.config.dtype, job.target.is_gpu)
    check_engines(job, engines)
    if not job.target.device_present():
        raise ToolchainError(f"bench runs the model: this machine has no {job.target.kind} device")
    if packed and "tvm-packed" not in engines:
        engines = (*engines, "tvm-packed")
    if any(not 0.0 <= p < 1.0 for p in paddings):
        raise InputError("--padding must be a fraction in [0, 1)")
    if "tvm" not in engines:
        engines = ("tvm", *engines)
    threads = job.config.bench.threads or cpu_count()
    set_threads(threads)
    machine_floor = floor.measure(job.target, threads, job.config.dtype)  # first, on a quiet process
    results = []
    for batch in batches or (job.config.batch,):
        for seq_len in seq_lens or (job.config.seq_len,):
            shaped = Job(replace(job.config, batch=batch, seq_len=seq_len), no_deps=job.no_deps, say=job.say)
            for padding in paddings:
                actual = Shape(*shaped.inputs.shape, padding)
                results.append(bench_shape(shaped, actual, engines, threads, machine_floor))
    # --allow-random-weights: the weights every engine ran drawn at random, said once for the report.
    drawn = sorted({name for result in results for name in result.pop("random_weights")})
    report = {"model": job.source.name, "dtype": job.config.dtype, "random_weights": drawn,
              "environment": environment(job, threads),
              "floor": dataclasses.asdict(machine_floor[0]) if machine_floor else None,
              "engine_dtypes": engine_dtypes(job.config.dtype, engines, job.target.is_gpu), "results": results}
    if len(results) == 1:  # one shape: its numbers at the top level too
        report.update({k: results[0][k] for k in ("engines", "ratio", "best_other", "speedup", "packed_speedup")})
        report["shape"] = {"batch": results[0]["batch"], "seq_len": results[0]["seq_len"], "padding": results[0]["padding"]}
    return report

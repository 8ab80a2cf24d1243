"""Stage 7: latency of the TVM build against the engines a user could pick instead, measured fairly.

Same weights, same inputs, same thread count for every engine; outputs checked against PyTorch
before timing (a wrong engine is reported, not timed); warm-up; engines interleaved round by
round so that machine drift hits all of them alike; repeats until both a minimum count and a
minimum time; medians and percentiles. Sweeps over batch, sequence length and padding.
"""

from __future__ import annotations

import csv
import io
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from . import models
from .build import build
from .config import torch_dtype
from .errors import CheckFailed, InputError, ToolchainError
from .job import Job
from .runtime import CompiledModel
from .targets import HOST_CPUS, cpu_count

MAX_RUNS_FACTOR = 50  # a safety stop: never more than repeat x this many runs per engine
ROUND_RUNS = 3  # consecutive runs of one engine per round: less cross-engine cache and thread-pool noise
# A sanity check of each engine, not verify's bar. In float16 mode the peers run in float32.
CHECK_TOLERANCE = {"float32": 1e-3, "float64": 1e-8, "float16": 2e-2, "bfloat16": 5e-2}
ENGINES = ("tvm", "torch-eager", "torch-sdpa", "torch-compile", "onnxruntime")


@dataclass
class Engine:
    name: str
    run: Callable[[], object]  # one inference, synchronized
    outputs: Callable[[], list[np.ndarray]]  # one inference, results on the host
    setup_s: float = 0.0  # export / compile / build / load: the one-time cost
    memory_mb: float = 0.0  # resident memory the engine added when set up and first run
    timings_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    padding: float  # fraction of every sequence that is padding in the attention mask


def set_threads(threads: int) -> None:
    """The same thread count for every engine."""
    import torch
    import tvm

    torch.set_num_threads(threads)
    # -3: the threads share every core, unpinned like PyTorch's (mode 1 would pin this process).
    tvm.get_global_func("runtime.config_threadpool")(-3, threads, [str(cpu) for cpu in HOST_CPUS])


def padded_inputs(job: Job, padding: float) -> tuple:
    """The job's example inputs with the last ``padding`` fraction of every sequence masked out."""
    ids, mask, segments = (t.clone() for t in job.inputs.as_tuple())
    seq_len = ids.shape[1]
    real = max(1, seq_len - int(round(seq_len * padding)))
    mask[:, real:] = 0
    ids[:, real:] = 0
    segments[:, real:] = 0
    return ids, mask, segments


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _tvm(job: Job, inputs) -> Engine:
    built = job.upstream("build", build)
    compiled = CompiledModel(built, job)
    device_inputs = compiled.to_device([t.numpy() for t in inputs])

    def run():
        compiled.run_on_device(device_inputs)
        compiled.sync()

    engine = Engine("tvm", run, lambda: compiled([t.numpy() for t in inputs]))
    engine.setup_s = float(built.meta.get("build_seconds", 0.0))
    return engine


def _torch(job: Job, inputs, attention: str, compiled: bool = False) -> Engine:
    import torch

    model = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed, attn_implementation=attention)
    if compiled:
        model = torch.compile(model, backend="inductor")

    def run():
        with torch.inference_mode():
            return model(*inputs)

    name = "torch-compile" if compiled else f"torch-{attention}"
    return Engine(name, run, lambda: [t.numpy() for t in run()])


def _onnxruntime(job: Job, inputs, threads: int) -> Engine:
    import onnxruntime as ort
    import torch

    path = job.stage_dir("build").parent / "onnx" / "model.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        model = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed, attn_implementation="eager")
        tmp = path.with_suffix(f".tmp-{os.getpid()}.onnx")
        torch.onnx.export(model, tuple(inputs), str(tmp), input_names=list(models.INPUT_NAMES),
                          dynamo=True, optimize=True, verbose=False)
        tmp.replace(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {name: t.numpy() for name, t in zip(models.INPUT_NAMES, inputs)}
    return Engine("onnxruntime", lambda: session.run(None, feed), lambda: session.run(None, feed))


def _available(name: str) -> str | None:
    """Why an engine cannot run here, or None."""
    import importlib.util

    if name == "onnxruntime":
        missing = [m for m in ("onnxruntime", "onnx", "onnxscript") if importlib.util.find_spec(m) is None]
        if missing:
            return f"not installed ({', '.join(missing)}): pip install 'tvmbert[peers]'"
    return None


def _make(name: str, job: Job, inputs, threads: int) -> Engine:
    factories = {
        "tvm": lambda: _tvm(job, inputs),
        "torch-eager": lambda: _torch(job, inputs, "eager"),
        "torch-sdpa": lambda: _torch(job, inputs, "sdpa"),
        "torch-compile": lambda: _torch(job, inputs, "sdpa", compiled=True),
        "onnxruntime": lambda: _onnxruntime(job, inputs, threads),
    }
    before, started = _rss_mb(), time.perf_counter()
    engine = factories[name]()
    engine.run()  # first call: lazy compilation (torch.compile) and allocation belong to setup
    engine.setup_s += time.perf_counter() - started
    engine.memory_mb = max(0.0, _rss_mb() - before)
    return engine


def _check(engine: Engine, expected: list[np.ndarray], mask: np.ndarray, tolerance: float) -> str | None:
    """Compares on real tokens only: padded positions are not part of anybody's answer."""
    got = engine.outputs()
    if len(got) != len(expected):
        return f"returned {len(got)} outputs, expected {len(expected)}"
    worst = 0.0
    for index, (have, want) in enumerate(zip(got, expected)):
        diff = np.abs(np.asarray(have, dtype=np.float64) - want.astype(np.float64))
        if index == 0 and diff.ndim == 3:
            diff = diff[mask.astype(bool)]
        worst = max(worst, float(diff.max()))
    return f"wrong results: max abs diff {worst:.3g} > {tolerance:.3g}" if worst > tolerance else None


def measure(engines: list[Engine], warmup: int, repeat: int, min_time_s: float) -> None:
    """Rounds of a few consecutive runs per engine, until every engine has enough."""
    for engine in engines:
        for _ in range(warmup):
            engine.run()
    spent = {engine.name: 0.0 for engine in engines}
    while any(len(e.timings_ms) < repeat or spent[e.name] < min_time_s for e in engines):
        if all(len(e.timings_ms) >= repeat * MAX_RUNS_FACTOR for e in engines):
            break
        for engine in engines:
            for _ in range(ROUND_RUNS):
                started = time.perf_counter()
                engine.run()
                elapsed = time.perf_counter() - started
                engine.timings_ms.append(elapsed * 1000.0)
                spent[engine.name] += elapsed


def _summary(engine: Engine, batch: int) -> dict:
    values = np.array(engine.timings_ms)
    median = float(np.median(values))
    return {
        "median_ms": round(median, 4),
        "p90_ms": round(float(np.percentile(values, 90)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "mean_ms": round(float(values.mean()), 4),
        "runs": len(values),
        "throughput": round(batch * 1000.0 / median, 2),  # sequences per second
        "setup_s": round(engine.setup_s, 2),
        "memory_mb": round(engine.memory_mb, 1),
    }


def environment(job: Job, threads: int) -> dict:
    import importlib.metadata

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": cpu_count(),
        "threads": threads,
        "target": job.target.key,
        "python": platform.python_version(),
        **{name: version(name) for name in ("torch", "apache-tvm", "onnxruntime", "transformers")},
    }


def bench_shape(job: Job, shape: Shape, engine_names: tuple[str, ...], threads: int) -> dict:
    """One shape: every engine set up, checked, then timed together."""
    options = job.config.bench
    inputs = padded_inputs(job, shape.padding)
    mask = inputs[1].numpy()
    report: dict = {}
    engines = []
    if "tvm" in engine_names:
        job.upstream("build", build)  # built (or found) first: memory_mb and setup_s are about running it
    for name in engine_names:
        reason = _available(name)
        if reason is None and name == "tvm":
            engines.append(_make(name, job, inputs, threads))  # the subject: its failures are errors
            continue
        if reason is None:
            try:
                engines.append(_make(name, job, inputs, threads))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is skipped, with the reason
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                reason = f"failed to set up: {type(exc).__name__}: {first}"
        if reason is not None:
            report[name] = {"skipped": reason}
            job.say(f"bench: {name} skipped: {reason}")
    eager = next((e for e in engines if e.name == "torch-eager"), None) or _make("torch-eager", job, inputs, threads)
    reference = [np.asarray(o) for o in eager.outputs()]
    timed = []
    for engine in engines:
        problem = _check(engine, reference, mask, CHECK_TOLERANCE[job.config.dtype])
        if problem:
            report[engine.name] = {"skipped": problem}
            job.say(f"bench: {engine.name} not timed: {problem}")
        else:
            timed.append(engine)
    job.say(f"bench: {shape.batch}x{shape.seq_len} padding {shape.padding:g}: {', '.join(e.name for e in timed)} on "
            f"{threads} threads, >= {options.repeat} runs and >= {options.min_time_s} s each, interleaved")
    measure(timed, options.warmup, options.repeat, options.min_time_s)
    for engine in timed:
        report[engine.name] = _summary(engine, shape.batch)
    ordered = {name: report[name] for name in engine_names if name in report}
    return {"batch": shape.batch, "seq_len": shape.seq_len, "padding": shape.padding, "engines": ordered, **_ratios(ordered)}


def _ratios(engines: dict) -> dict:
    """ratio: tvm's median over the best other engine's (below 1: tvm is faster);
    speedup: torch-eager's median over tvm's."""
    timed = {name: stats["median_ms"] for name, stats in engines.items() if "median_ms" in stats}
    if "tvm" not in timed:
        return {"ratio": None, "best_other": None, "speedup": None}
    others = {name: median for name, median in timed.items() if name != "tvm"}
    best = min(others, key=others.get) if others else None
    return {
        "ratio": round(timed["tvm"] / others[best], 3) if best else None,
        "best_other": best,
        "speedup": round(timed["torch-eager"] / timed["tvm"], 3) if "torch-eager" in timed else None,
    }


def bench(job: Job, batches: tuple[int, ...] = (), seq_lens: tuple[int, ...] = (), paddings: tuple[float, ...] = (0.0,)) -> dict:
    if not job.target.device_present():
        raise ToolchainError(f"bench runs the model: this machine has no {job.target.kind} device")
    engines = job.config.bench.engines or ENGINES
    if any(not 0.0 <= p < 1.0 for p in paddings):
        raise InputError("--padding must be a fraction in [0, 1)")
    if "tvm" not in engines:
        engines = ("tvm", *engines)
    threads = job.config.bench.threads or cpu_count()
    set_threads(threads)
    results = []
    for batch in batches or (job.config.batch,):
        for seq_len in seq_lens or (job.config.seq_len,):
            shaped = Job(replace(job.config, batch=batch, seq_len=seq_len), no_deps=job.no_deps, say=job.say)
            for padding in paddings:
                actual = Shape(*shaped.inputs.shape, padding)
                results.append(bench_shape(shaped, actual, engines, threads))
    report = {"model": job.source.name, "dtype": job.config.dtype, "environment": environment(job, threads), "results": results}
    if len(results) == 1:  # one shape: its numbers at the top level too
        report.update({k: results[0][k] for k in ("engines", "ratio", "best_other", "speedup")})
        report["shape"] = {"batch": results[0]["batch"], "seq_len": results[0]["seq_len"], "padding": results[0]["padding"]}
    return report


def to_csv(report: dict) -> str:
    buffer = io.StringIO()
    columns = ["model", "dtype", "batch", "seq_len", "padding", "engine", "median_ms", "p90_ms", "p99_ms", "mean_ms",
               "runs", "throughput", "setup_s", "memory_mb", "skipped"]
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    for result in report["results"]:
        for engine, stats in result["engines"].items():
            writer.writerow({"model": report["model"], "dtype": report["dtype"], "batch": result["batch"],
                             "seq_len": result["seq_len"], "padding": result["padding"], "engine": engine, **stats})
    return buffer.getvalue()


def plot(report: dict) -> bytes:
    """Latency against sequence length per engine, one panel per (batch, padding), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["batch"], r["padding"]) for r in report["results"]})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (batch, padding) in zip(axes[0], panels):
        rows = [r for r in report["results"] if r["batch"] == batch and r["padding"] == padding]
        for engine in ENGINES:
            points = sorted((r["seq_len"], r["engines"][engine]["median_ms"]) for r in rows
                            if "median_ms" in r["engines"].get(engine, {}))
            if points:
                axis.plot(*zip(*points), marker="o", label=engine)
        axis.set_title(f"{report['model']}, batch {batch}" + (f", {padding:.0%} padding" if padding else ""))
        axis.set_xlabel("sequence length")
        axis.set_ylabel("median latency (ms)")
        axis.grid(alpha=0.3)
        axis.legend()
    environment_line = report["environment"]
    figure.suptitle(f"{environment_line['cpu']}, {environment_line['threads']} threads, {report['dtype']}", fontsize=9)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120)
    plt.close(figure)
    return png.getvalue()


def to_markdown(report: dict, command: str) -> str:
    """A results table for docs/, with the command and the environment that produced it."""
    env = report["environment"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {env['cpu']}, {env['threads']} threads of {env['cores']} cores, target `{env['target']}`; "
        f"torch {env['torch']}, apache-tvm {env['apache-tvm']}, onnxruntime {env['onnxruntime']}, "
        f"transformers {env['transformers']}; {report['model']}, {report['dtype']}, median ms (p90).",
        "",
    ]
    names = [name for name in ENGINES if any(name in r["engines"] for r in report["results"])]
    lines.append("| batch x seq | padding | " + " | ".join(names) + " | tvm / best other |")
    lines.append("| --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    for result in report["results"]:
        cells = []
        for name in names:
            stats = result["engines"].get(name, {})
            cells.append(f"{stats['median_ms']:.2f} ({stats['p90_ms']:.2f})" if "median_ms" in stats else "skipped")
        ratio = f"{result['ratio']:.2f} vs {result['best_other']}" if result["ratio"] else "-"
        lines.append(f"| {result['batch']} x {result['seq_len']} | {result['padding']:g} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def bench_training(job: Job) -> dict:
    """Encoder layer 0, forward + backward in train mode (dropout on), as one training step runs
    it: TVM through add_tvm_dispatch against PyTorch eager, checked first, then interleaved."""
    import copy

    import torch

    from . import training

    if not job.target.device_present():
        raise ToolchainError(f"bench runs the model: this machine has no {job.target.kind} device")
    threads = job.config.bench.threads or cpu_count()
    set_threads(threads)
    layer, (hidden, mask) = training.job_layer(job)
    started = time.perf_counter()
    compiled = training.add_tvm_dispatch(copy.deepcopy(layer), (hidden, mask), target=job.config.target,
                                         log_dir=job.config.log_dir)
    setup_s = time.perf_counter() - started
    grad_output = torch.randn(hidden.shape, dtype=hidden.dtype, generator=torch.Generator().manual_seed(job.config.seed))
    x = hidden.clone().requires_grad_()  # as inside a model: the layer's input needs its gradient too

    def step(module):
        for p in module.parameters():
            p.grad = None
        x.grad = None
        output = module(x, mask)
        output.backward(grad_output)
        return output.detach(), x.grad

    engines = {"tvm": Engine("tvm", lambda: step(compiled), lambda: [], setup_s),
               "torch-eager": Engine("torch-eager", lambda: step(layer), lambda: [])}
    results = {}
    for name, module in (("tvm", compiled), ("torch-eager", layer)):
        torch.manual_seed(job.config.seed)
        results[name] = [t.clone() for t in step(module)]
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(results["tvm"], results["torch-eager"]))
    if worst > CHECK_TOLERANCE[job.config.dtype]:
        raise CheckFailed(f"bench --train: TVM's output or input gradient is off by {worst:.3g}; run verify --train")
    options = job.config.bench
    job.say(f"bench --train: {type(layer).__name__} {'x'.join(map(str, hidden.shape))}, forward + backward, "
            f"{threads} threads, >= {options.repeat} runs and >= {options.min_time_s} s each, interleaved")
    measure(list(engines.values()), options.warmup, options.repeat, options.min_time_s)
    dispatch = training.dispatch_of(compiled)
    current = dispatch.compiled_for(dispatch.mode())
    summaries = {name: _summary(engine, hidden.shape[0]) for name, engine in engines.items()}
    return {
        "model": job.source.name,
        "layer": f"{type(layer).__name__} 0",
        "shape": list(hidden.shape),
        "dtype": job.config.dtype,
        "environment": environment(job, threads),
        "engines": summaries,
        "ratio": round(summaries["tvm"]["median_ms"] / summaries["torch-eager"]["median_ms"], 3),
        "max_abs_diff": worst,
        "saved_bytes": {"tvm": training.saved_activation_bytes(compiled, (x, mask)),
                        "torch": training.saved_activation_bytes(layer, (x, mask))},
        "tasks_tuned": current.tasks_tuned,
        "tasks_total": current.tasks_total,
        "untuned": current.untuned,
    }

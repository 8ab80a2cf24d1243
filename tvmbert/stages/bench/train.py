"""bench --train: encoder layer 0 forward + backward, TVM (add_tvm_dispatch) against PyTorch eager."""

from __future__ import annotations

import time

from tvmbert.core.errors import CheckFailed, ToolchainError
from tvmbert.core.targets import cpu_count
from tvmbert.stages.bench.engines import CHECK_TOLERANCE, Engine
from tvmbert.stages.bench.timing import _summary, environment, measure, set_threads
from tvmbert.stages.job import Job


def bench_training(job: Job) -> dict:
    """Encoder layer 0, forward + backward in train mode (dropout on), as one training step runs
    it: TVM through add_tvm_dispatch against PyTorch eager, checked first, then interleaved."""
    import copy

    import torch

    from tvmbert.training import dispatch

    if not job.target.device_present():
        raise ToolchainError(f"bench runs the model: this machine has no {job.target.kind} device")
    threads = job.config.bench.threads or cpu_count()
    set_threads(threads)
    layer, (hidden, mask) = dispatch.job_layer(job)
    started = time.perf_counter()
    compiled = dispatch.add_tvm_dispatch(copy.deepcopy(layer), (hidden, mask), target=job.config.target,
                                         log_dir=job.log_root)
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
    jitter = measure(list(engines.values()), options.warmup, options.repeat, options.min_time_s)
    layer_dispatch = dispatch.dispatch_of(compiled)
    current = layer_dispatch.compiled_for(layer_dispatch.mode())
    summaries = {name: _summary(engine, hidden.shape[0]) for name, engine in engines.items()}
    return {
        "model": job.source.name,
        "layer": f"{type(layer).__name__} 0",
        "shape": list(hidden.shape),
        "dtype": job.config.dtype,
        "environment": environment(job, threads),
        "engines": summaries,
        "machine_jitter": jitter,
        "ratio": round(summaries["tvm"]["median_ms"] / summaries["torch-eager"]["median_ms"], 3),
        "max_abs_diff": worst,
        "saved_bytes": {"tvm": dispatch.saved_activation_bytes(compiled, (x, mask)),
                        "torch": dispatch.saved_activation_bytes(layer, (x, mask))},
        "tasks_tuned": current.tasks_tuned,
        "tasks_total": current.tasks_total,
        "untuned": current.untuned,
    }

"""Where one inference's time goes: each kernel call of a build timed from the Relax VM's
instrument hook, each kernel's median over the runs, grouped by what it is (int8 or AMX matmul,
attention, layer norm, ...), so that a speed-up is looked for where the time is, on the CPU at hand. Shares are of the median
total, each a median itself: they need not add up to 100%.

    python benchmarks/vm_profile.py bert-base --batch 8 --seq-len 128 --dtype int8 [--threads 2] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import re
import time

# What a kernel's name says it is, first match wins (the passes name their kernels).
KINDS = (("quantize rows", r"quantize"), ("matmul int8 / amx", r"int8|amx"), ("matmul fp32", r"fma|matmul|dense"), ("attention", r"attention|softmax"),
         ("layer norm", r"layer_norm"), ("embeddings", r"take|embed"),
         ("vm builtins", r"^vm\."))


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--workdir", default="build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import numpy as np

    from tvmbert import Job, JobConfig, build
    from tvmbert.deploy.compiled import CompiledModel
    from tvmbert.stages.bench.timing import set_threads

    job = Job(JobConfig(model=args.model, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype, target=args.target,
                        workdir=args.workdir))
    model = CompiledModel(build(job), job)
    set_threads(args.threads)
    inputs = model.to_device([t.numpy() for t in job.inputs.as_tuple()])
    for _ in range(3):
        model.run_on_device(inputs)
    # TVM 0.27's VM has no profiler: time each call from the VM's instrument hook (CPU calls are
    # synchronous). The hook's own cost, about 1 us a call, is inside each time: ~1% of bert-base's.
    run: dict[str, float] = collections.defaultdict(float)
    started: list[float] = []

    def instrument(func, name, before_run, ret_value, *call_args):
        if before_run:
            started.append(time.perf_counter())
        else:
            run[str(name)] += (time.perf_counter() - started.pop()) * 1e6
        return 0

    model.vm.set_instrument(instrument)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    totals, walls = [], []
    for _ in range(args.runs):
        run.clear()
        wall = time.perf_counter()
        model.run_on_device(inputs)
        walls.append(time.perf_counter() - wall)
        for name, us in run.items():
            per_kernel[name].append(us)
        totals.append(sum(run.values()))
    medians = {name: float(np.median(us)) for name, us in per_kernel.items()}
    total = float(np.median(totals))
    print(f"{args.model} {args.dtype} {args.batch} x {args.seq_len}, {args.threads} threads, {job.target.key}: "
          f"kernels sum to {total / 1e3:.2f} ms of {1e3 * float(np.median(walls)):.2f} (medians of {args.runs} instrumented runs)")
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, us in medians.items():
        by_kind[kind_of(name)] += us
    for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"  {kind:28s} {us / 1e3:9.2f} ms {100 * us / total:5.1f}%")
    print(f"{'kernel':64s} {'ms':>8s} {'share':>6s}")
    for name, us in sorted(medians.items(), key=lambda item: -item[1])[: args.top]:
        label = re.sub(r"^vm\.builtin\.", "", name)[:64]
        print(f"{label:64s} {us / 1e3:8.2f} {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()

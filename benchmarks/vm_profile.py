"""Where one inference's time goes: each kernel call of a build timed from the Relax VM's
instrument hook, so that a speed-up is looked for where the time is, on the CPU at hand. Each
kernel's median over the runs, and each kind's (int8 or AMX matmul, attention, layer norm, ...):
the median of its per-run sums. Shares are of the median total, each a median itself: they need
not add up to 100%.

With several dtypes (``--dtype float32,int8``) each is built, and the builds are called in turn in
one process, a call of each per round (every other round in reverse), so that a shared machine's
load falls on all of them alike; the kinds then stand side by side, with the first dtype's time
over each other's: what int8 buys over fp32, and where it does not.

    python benchmarks/vm_profile.py bert-base --batch 8 --seq-len 128 --dtype int8 [--threads 2] [--top 15]
    python benchmarks/vm_profile.py bert-base --batch 8 --seq-len 128 --dtype float32,int8
    python benchmarks/vm_profile.py bert-base --seq-len 128 --dtype float16 --target cuda

On a GPU the build is the one without a CUDA graph (a captured forward is one call), and each
call is timed to the device's sync after it: kernels run after their launch returns.
"""

from __future__ import annotations

import argparse
import collections
import re
import time

# What a kernel's name says it is, first match wins (the passes name their kernels).
KINDS = (("quantize rows", r"quantize"), ("attention", r"attention|softmax"), ("matmul int8 / amx", r"int8|amx"),
         ("matmul fp32", r"fma|matmul|dense"), ("layer norm", r"layer_norm"), ("embeddings", r"take|embed"),
         ("vm builtins", r"^vm\."))


WEIGHT_MATMULS = "weight matmuls"  # the matmul kinds' sum, run by run


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="one dtype, or several, comma-separated, called in turn")
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--workdir", default="build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import sys

    import numpy as np

    from tvmbert import Job, JobConfig, build
    from tvmbert.deploy.compiled import CompiledModel
    from tvmbert.stages.bench.timing import set_threads

    dtypes = list(dict.fromkeys(dtype.strip() for dtype in args.dtype.split(",") if dtype.strip()))
    builds = {}
    for dtype in dtypes:
        job = Job(JobConfig(model=args.model, batch=args.batch, seq_len=args.seq_len, dtype=dtype, target=args.target,
                            workdir=args.workdir, cuda_graph=False))
        built = build(job)
        if not job.target.device_present():
            print(f"error: the profile runs the model: this machine has no {job.target.kind} device", file=sys.stderr)
            sys.exit(2)
        model = CompiledModel(built, job)
        builds[dtype] = (model, model.to_device([t.numpy() for t in job.inputs.as_tuple()]))
    target = job.target.key
    set_threads(args.threads)
    # TVM 0.27's VM has no profiler: time each call from the VM's instrument hook (CPU calls are
    # synchronous). The hook's own cost, about 1 us a call, is inside each time: ~1% of bert-base's.
    run: dict[str, float] = collections.defaultdict(float)
    started: list[float] = []

    sync = job.target.device().sync if job.target.is_gpu else (lambda: None)

    def instrument(func, name, before_run, ret_value, *call_args):
        if before_run:
            started.append(time.perf_counter())
        else:
            sync()
            run[str(name)] += (time.perf_counter() - started.pop()) * 1e6
        return 0

    for model, inputs in builds.values():
        for _ in range(3):
            model.run_on_device(inputs)
        model.vm.set_instrument(instrument)
    per_kernel = {dtype: collections.defaultdict(list) for dtype in dtypes}
    per_kind = {dtype: collections.defaultdict(list) for dtype in dtypes}
    totals, walls = collections.defaultdict(list), collections.defaultdict(list)
    for round_ in range(args.runs):
        for dtype in dtypes[:: -1 if round_ % 2 else 1]:
            model, inputs = builds[dtype]
            run.clear()
            wall = time.perf_counter()
            model.run_on_device(inputs)
            sync()
            walls[dtype].append(time.perf_counter() - wall)
            kinds: dict[str, float] = collections.defaultdict(float)
            for name, us in run.items():
                per_kernel[dtype][name].append(us)
                kinds[kind_of(name)] += us
            for kind, us in kinds.items():
                per_kind[dtype][kind].append(us)
            per_kind[dtype][WEIGHT_MATMULS].append(sum(us for kind, us in kinds.items() if kind.startswith("matmul")))
            totals[dtype].append(sum(run.values()))

    # Each dtype's medians in ms, once: the wall time, the kernels' sum, then each kind's.
    summary = {dtype: {"wall": 1e3 * float(np.median(walls[dtype])), "kernels": float(np.median(totals[dtype])) / 1e3,
                       **{kind: float(np.median(us)) / 1e3 for kind, us in per_kind[dtype].items()}} for dtype in dtypes}
    for dtype in dtypes:
        ms = summary[dtype]
        print(f"{args.model} {dtype} {args.batch} x {args.seq_len}, {args.threads} threads, {target}: "
              f"kernels sum to {ms['kernels']:.2f} ms of {ms['wall']:.2f} (medians of {args.runs} instrumented runs)")
        for kind in sorted(per_kind[dtype].keys() - {WEIGHT_MATMULS}, key=lambda kind: -ms[kind]):
            print(f"  {kind:28s} {ms[kind]:9.2f} ms {100 * ms[kind] / ms['kernels']:5.1f}%")
        print(f"{'kernel':64s} {'ms':>8s} {'share':>6s}")
        medians = {name: float(np.median(us)) / 1e3 for name, us in per_kernel[dtype].items()}
        for name, kernel_ms in sorted(medians.items(), key=lambda item: -item[1])[: args.top]:
            label = re.sub(r"^vm\.builtin\.", "", name)[:64]
            print(f"{label:64s} {kernel_ms:8.2f} {100 * kernel_ms / ms['kernels']:5.1f}%")
    if len(dtypes) > 1:
        _side_by_side(dtypes, summary)


def _side_by_side(dtypes: list[str], summary: dict[str, dict[str, float]]) -> None:
    """Each row's median ms under every dtype, and the first dtype's over each other's. The weight
    matmuls also as one kind, whichever kernels run them: an int8 build's are not fp32's kinds."""
    first, others = dtypes[0], dtypes[1:]
    kinds = {kind for dtype in dtypes for kind in summary[dtype]} - {"wall", "kernels", WEIGHT_MATMULS}
    print(f"\n{'':28s}" + "".join(f" {d + ' ms':>14s}" for d in dtypes) + "".join(f" {first + ' / ' + d:>18s}" for d in others))
    for label in ["wall", "kernels", WEIGHT_MATMULS, *sorted(kinds)]:
        ms = {dtype: summary[dtype].get(label, 0.0) for dtype in dtypes}
        ratios = "".join(f" {ms[first] / ms[d]:18.3f}" if ms[d] and ms[first] else f" {'':18s}" for d in others)
        print(f"{label:28s}" + "".join(f" {ms[d]:14.2f}" for d in dtypes) + ratios)


if __name__ == "__main__":
    main()

"""Two builds of one model and shape against each other: each a `build` stage's folder (`tvmbert
build ... --json` prints it as "artifact"), such as two revisions' builds, each made from a
worktree of its own. Both are loaded into one process and called in turn, every other round in
reverse; then the same in a second process with the other build loaded first. A process's
first-loaded build measured ~4% slower than the same build loaded second (2026-11-28, an
A/B of one build against itself: 1.042), so one load order alone misleads by as much as most
changes gain: the geometric mean of both orders' ratios is what this prints last.

    python benchmarks/ab_builds.py bert-base --seq-len 512 --dtype bfloat16 NEW_BUILD OLD_BUILD [--rounds 100]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time


def one_order(args) -> float:
    """Medians of each build over ``args.rounds`` rounds, loaded in ``args.order``; returns new / old."""
    from pathlib import Path

    import numpy as np

    from tvmbert import Job, JobConfig
    from tvmbert.core.artifacts import read
    from tvmbert.deploy.compiled import CompiledModel
    from tvmbert.stages.bench.timing import set_threads

    job = Job(JobConfig(model=args.model, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype))
    set_threads(args.threads)
    folders = {"new": args.new, "old": args.old}
    models = {}
    for name in (("new", "old") if args.order == "new-first" else ("old", "new")):
        built = read("build", Path(folders[name]))
        if built is None:
            sys.exit(f"error: no build at {folders[name]}")
        model = CompiledModel(built, job)
        models[name] = (model, model.to_device([t.numpy() for t in job.inputs.as_tuple()]))
    for model, inputs in models.values():
        model.run_on_device(inputs)  # warm up
    times = {name: [] for name in models}
    for round_ in range(args.rounds):
        for name in (list(models) if round_ % 2 == 0 else list(models)[::-1]):
            model, inputs = models[name]
            started = time.perf_counter()
            model.run_on_device(inputs)
            times[name].append(time.perf_counter() - started)
    medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    ratio = medians["new"] / medians["old"]
    print(f"{args.order}: new {medians['new']:.2f} ms, old {medians['old']:.2f} ms, new / old {ratio:.3f}", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("new", help="the build folder of the change")
    parser.add_argument("old", help="the build folder to compare it with")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: every core this process may use")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--order", choices=("new-first", "old-first"), help="one process, one load order (else both, in two)")
    args = parser.parse_args()
    if args.order:
        one_order(args)
        return
    ratios = []
    for order in ("new-first", "old-first"):
        command = [sys.executable, *sys.argv, "--order", order]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:  # its own one line (a folder with no build), or the last of a traceback
            sys.exit((done.stderr.strip().splitlines() or [f"error: {order} run failed ({done.returncode})"])[-1])
        line = done.stdout.strip().splitlines()[-1]
        print(line, flush=True)
        ratios.append(float(line.rsplit(" ", 1)[-1]))
    print(f"new / old, both orders: {math.sqrt(ratios[0] * ratios[1]):.3f}")


if __name__ == "__main__":
    main()

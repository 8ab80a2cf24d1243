"""Per-kernel time inside one end-to-end inference (the Relax VM profiler), next to each kernel's
best time measured alone while tuning: where end-to-end time goes that tuning does not see.

    python benchmarks/profile_kernels.py bert-base 14 [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from tvmbert import Job, JobConfig, build, tuning_db
from tvmbert.bench import set_threads
from tvmbert.convert import PARAMS_FILE, load_params
from tvmbert.targets import cpu_count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("seq_len", type=int)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    import numpy as np
    import tvm
    from tvm import relax

    job = Job(JobConfig(model=args.model, seq_len=args.seq_len))
    built = build(job)
    set_threads(cpu_count())
    device = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(built.file("model.so"))), device, profile=True)
    weights = [tvm.runtime.tensor(w, device) for w in load_params(built.file(PARAMS_FILE)).values()]
    inputs = [tvm.runtime.tensor(t.numpy(), device) for t in job.inputs.as_tuple()]
    for _ in range(5):
        vm["main"](*inputs, *weights)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    totals = []
    for _ in range(args.runs):
        report = json.loads(vm.profile("main", *inputs, *weights).json())
        run: dict[str, float] = collections.defaultdict(float)
        for call in report["calls"]:
            run[call["Name"]["string"]] += call["Duration (us)"]["microseconds"]
        for name, us in run.items():
            per_kernel[name].append(us)
        totals.append(sum(run.values()))
    database = tuning_db.open_database(job.log_dir())
    alone = {}
    for task in tuning_db.extract_tasks(__import__("tvmbert.convert", fromlist=["x"]).load_module(job.stage_dir("optimize")), job.target):
        best = tuning_db.best_seconds(database, task)
        alone[task.name] = (best * 1e6 * task.weight if best else None, task.flops * task.weight)
    rows = sorted(((float(np.median(v)), k) for k, v in per_kernel.items()), reverse=True)
    print(f"{args.model} 1x{args.seq_len}: median of kernel sums {np.median(totals) / 1000:.2f} ms over {args.runs} profiled runs")
    print(f"{'kernel':60s} {'in e2e us':>10s} {'alone us':>10s} {'GFLOP/s':>8s}")
    for us, name in rows[: args.top]:
        base = re.sub(r"^vm\.builtin\.", "", name)
        alone_us, flops = alone.get(base, (None, 0))
        print(f"{base[:60]:60s} {us:10.1f} {alone_us if alone_us is None else round(alone_us, 1)!s:>10s} "
              f"{flops / us / 1e3 if us and flops else 0:8.1f}")


if __name__ == "__main__":
    main()

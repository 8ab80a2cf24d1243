"""How many ways the schedules a build applies split their work: the extents of their parallel
loops, per kernel, and the core count their records were measured at. A schedule tuned on 2 cores
keeps at most that many threads busy on a 64-core machine.

    python benchmarks/parallel_extents.py bert-base 14
"""

from __future__ import annotations

import argparse
import re


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("seq_len", type=int)
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--log-dir", help="your tuning logs (default: tvmbert's); the shipped ones are read after them")
    args = parser.parse_args()

    import tvm

    from tvmbert import Job, JobConfig, optimize
    from tvmbert.ir.files import load_module
    from tvmbert.ir.tasks import extract_tasks, inference_module
    from tvmbert.tuning.catalog import Catalog

    job = Job(JobConfig(model=args.model, seq_len=args.seq_len, target=args.target, log_dir=args.log_dir))
    catalog = Catalog(job.log_dir(), job.target.key, warn=print, cores=job.target.config.get("num-cores"))
    module = inference_module(load_module(optimize(job).path), job.target)
    module = catalog.prefer_measured_layouts(module, job.target)  # as build does
    print(f"{args.model} 1 x {args.seq_len}, {job.target.key}: the records a build applies")
    print("| kernel | calls | source | parallel loop extents | measured on cores |")
    print("| --- | --- | --- | --- | --- |")
    for task in sorted((t for t in extract_tasks(module, job.target) if not t.trivial), key=lambda t: -t.cost):
        source = catalog.nearest([task.module])
        if source is None:
            print(f"| {task.name} | {task.weight} | default | - | - |")
            continue
        record = catalog.records(source, task.module)[0]
        schedule = tvm.s_tir.Schedule(task.module)
        record.trace.apply_to_schedule(schedule, remove_postproc=False)
        extents = re.findall(r"T\.parallel\((?:T\.int64\()?(\d+)", schedule.mod["main"].script())
        print(f"| {task.name} | {task.weight} | {source.label(catalog.key)} | {', '.join(extents) or 'serial'} | "
              f"{record.target.attrs.get('num-cores')} |")


if __name__ == "__main__":
    main()

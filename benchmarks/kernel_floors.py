"""Per-task latency of the tuned kernels against their floors, as a Markdown table.

Each non-trivial task's best record is built and timed alone, hot (inputs in cache) and cold (all
inputs but the first flushed before every run, as inside an inference that streams every weight
once), next to its floor: the larger of its bytes at the machine's bandwidth and its FLOPs at its
peak. The sum of cold x calls is what tuning can still win, task by task.

    python benchmarks/kernel_floors.py bert-base 14 [--bandwidth-gbs 24] [--peak-gflops 340]
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("seq_len", type=int)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bandwidth-gbs", type=float, default=24.0)
    parser.add_argument("--peak-gflops", type=float, default=340.0)
    args = parser.parse_args()

    import numpy as np
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    from tvmbert import Job, JobConfig, optimize
    from tvmbert.core.targets import cpu_count
    from tvmbert.ir.files import load_module
    from tvmbert.ir.tasks import extract_tasks, inference_module
    from tvmbert.stages.bench.timing import set_threads
    from tvmbert.tuning import database
    from tvmbert.tuning.catalog import Catalog

    job = Job(JobConfig(model=args.model, seq_len=args.seq_len, dtype=args.dtype))
    records_db = database.open_database(job.log_dir(), read_also=database.shipped_folders(job.log_dir()))
    module = inference_module(load_module(optimize(job).path), job.target)
    module = Catalog(job.log_dir(), job.target.key, warn=print).prefer_measured_layouts(module, job.target)  # as build does
    tasks = [t for t in extract_tasks(module, job.target) if not t.trivial]
    target = job.target.tvm_target()
    set_threads(cpu_count())
    device = tvm.cpu()
    rows = []
    for task in sorted(tasks, key=lambda t: -t.cost):
        records = database.valid_records(records_db, task.module)
        schedule = tvm.s_tir.Schedule(task.module)
        if records:
            records[0].trace.apply_to_schedule(schedule, remove_postproc=False)
        # As in the model: weights the kernel reads in a layout of its own arrive repacked.
        scheduled = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(schedule.mod)
        (name, func), = scheduled.functions_items()
        library = tvm.compile(scheduled, target=target).mod
        arrays = [tvm.runtime.tensor(np.random.rand(*[int(d) for d in info.shape]).astype(info.dtype), device)
                  for info in ArgInfo.from_prim_func(func)]
        nbytes = sum(a.numpy().nbytes for a in arrays)
        hot = library.time_evaluator(name.name_hint, device, number=20, repeat=3)(*arrays).median
        cold = library.time_evaluator(name.name_hint, device, number=1, repeat=30,
                                      f_preproc="cache_flush_cpu_non_first_arg")(*arrays).median
        floor = max(nbytes / (args.bandwidth_gbs * 1e9), max(task.flops, 0) / (args.peak_gflops * 1e9))
        rows.append((task, len(records), nbytes, hot, cold, floor))
    print("| task | MFLOP | MB | calls | trials | hot µs | cold µs | floor µs | cold / floor | cold ms x calls |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for task, trials, nbytes, hot, cold, floor in rows:
        print(f"| {task.name} | {task.flops / 1e6:.2f} | {nbytes / 1e6:.2f} | {task.weight} | {trials} | {hot * 1e6:.1f} | "
              f"{cold * 1e6:.1f} | {floor * 1e6:.1f} | {cold / floor:.1f} | {cold * task.weight * 1e3:.2f} |")
    total_cold = sum(cold * task.weight for task, _, _, _, cold, _ in rows) * 1e3
    total_floor = sum(floor * task.weight for task, _, _, _, _, floor in rows) * 1e3
    print(f"\nSum over tasks: cold {total_cold:.2f} ms, floor {total_floor:.2f} ms "
          f"({args.bandwidth_gbs:g} GB/s, {args.peak_gflops:g} GFLOP/s).")


if __name__ == "__main__":
    main()

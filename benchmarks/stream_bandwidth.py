"""The memory bandwidth a TVM kernel can reach here: the real floor of a weight-streaming matmul.

Sums the rows of a weight-sized matrix with every thread streaming its own rows, 16-lane vectors,
timed cold (the matrix flushed from the caches before every run, as kernel_floors.py and tuning
time matmuls) and hot. A bert-base 1 x 14 matmul cannot read its weights faster than this.

    python benchmarks/stream_bandwidth.py [--megabytes 9.4 75]
"""

from __future__ import annotations

import argparse


def _row_sums(weight, rows: int, columns: int):
    """sums[i, lane] = sum over k of weight[i, 16 k + lane]: 16 vector accumulators per row."""
    from tvm import te

    k = te.reduce_axis((0, columns // 16), "k")
    return te.compute((rows, 16), lambda i, lane: te.sum(weight[i, k * 16 + lane], axis=k), name="sums")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, nargs="+", default=[9.4, 75.0])
    args = parser.parse_args()

    import numpy as np
    import tvm
    from tvm import te

    from tvmbert.core import targets
    from tvmbert.core.targets import cpu_count
    from tvmbert.stages.bench.timing import set_threads

    set_threads(cpu_count())
    columns = 3072
    target = targets.resolve("llvm").tvm_target()
    device = tvm.cpu()
    print("| MB | cold µs | cold GB/s | hot µs | hot GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for megabytes in args.megabytes:
        rows = max(1, int(megabytes * 1e6 / (columns * 4)))
        weight = te.placeholder((rows, columns), name="weight")
        first = te.placeholder((16,), name="first")  # the cache flush spares the first argument
        sums = _row_sums(weight, rows, columns)
        sch = tvm.s_tir.Schedule(te.create_prim_func([first, weight, sums]))
        block = sch.get_sblock("sums")
        i, lane, reduction = sch.get_loops(block)
        sch.reorder(i, reduction, lane)
        sch.parallel(i)
        sch.vectorize(lane)
        library = tvm.compile(sch.mod, target=target).mod
        arrays = [tvm.runtime.tensor(np.zeros(16, "float32"), device),
                  tvm.runtime.tensor(np.random.rand(rows, columns).astype("float32"), device),
                  tvm.runtime.tensor(np.zeros((rows, 16), "float32"), device)]
        cold = library.time_evaluator("main", device, number=1, repeat=50, f_preproc="cache_flush_cpu_non_first_arg")(*arrays).median
        hot = library.time_evaluator("main", device, number=20, repeat=5)(*arrays).median
        nbytes = rows * columns * 4
        print(f"| {nbytes / 1e6:.1f} | {cold * 1e6:.0f} | {nbytes / cold / 1e9:.1f} | {hot * 1e6:.0f} | {nbytes / hot / 1e9:.1f} |")


if __name__ == "__main__":
    main()

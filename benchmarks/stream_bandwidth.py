"""The memory bandwidth a TVM kernel can reach here: the real floor of a weight-streaming matmul.

Sums the rows of a weight-sized matrix with every thread streaming its own rows
(``tvmbert.stages.bench.floor.row_sums``, what bench measures its floor with), timed cold (the
matrix flushed from the caches before every run, as kernel_floors.py and tuning time matmuls) and
hot; the best of a few runs each. A bert-base 1 x 14 matmul cannot read its weights faster than this.

    python benchmarks/stream_bandwidth.py [--megabytes 9.4 75]
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, nargs="+", default=[9.4, 75.0])
    args = parser.parse_args()

    from tvmbert.core import targets
    from tvmbert.core.targets import cpu_count
    from tvmbert.stages.bench.floor import memory_gb_per_s
    from tvmbert.stages.bench.timing import set_threads

    set_threads(cpu_count())
    target = targets.resolve("llvm")
    print("| MB | cold µs | cold GB/s | hot µs | hot GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for megabytes in args.megabytes:
        cold, hot = (memory_gb_per_s(target, round(megabytes * 1e6), hot=hot) for hot in (False, True))
        print(f"| {megabytes:.1f} | {megabytes * 1e3 / cold:.0f} | {cold:.1f} | {megabytes * 1e3 / hot:.0f} | {hot:.1f} |")


if __name__ == "__main__":
    main()

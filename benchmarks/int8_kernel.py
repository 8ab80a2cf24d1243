"""The int8 kernel against the FMA kernel on bert-base's weight matmuls, alone (hot: weights in
cache), interleaved, the best of 20 rounds each: GOP/s of each and their ratio; on a CPU with
AMX-INT8, the AMX kernel (``tdpbusd``) too. With ``--peak``, the host's register-only rates too (``benchmarks/int8_peak.c``, built with gcc): what
the kernels can reach at most.

    python benchmarks/int8_kernel.py [--rows 14,128,1024] [--peak]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))  # bert-base's (N, K): Q/K/V, output, FFN up, down


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="14,128,1024")
    parser.add_argument("--peak", action="store_true")
    args = parser.parse_args()

    import numpy as np
    import tvm

    from tvmbert.core.targets import resolve, use_every_core
    from tvmbert.deploy.loader import request_amx_permission
    from tvmbert.kernels import amx, fma, int8

    use_every_core()
    target = resolve("llvm")
    lanes, device, rng = target.fp32_lanes, tvm.cpu(), np.random.default_rng(0)
    dot = int8.DOT_PRODUCTS[target.int8_instruction]
    if target.has_amx_int8:
        request_amx_permission()

    def timer(function, operands, rows):
        library = tvm.compile(tvm.IRModule({"main": function}), target=target.tvm_target()).jit()
        arrays = [tvm.runtime.tensor(a) for a in operands]
        evaluate = library.time_evaluator("main", device, number=max(1, 2000 // rows), repeat=1)
        return lambda: evaluate(*arrays).mean

    def int8_timer(m, n, k):
        width = int8.tile(n, lanes)[1] * lanes
        return timer(int8.kernel(m, n, k, lanes, dot=dot), [
            (rng.integers(-127, 128, (m, k)) + int8.ROW_OFFSET).astype(int8.ROWS_DTYPE), np.ones(m, "float32"),
            rng.integers(-64, 65, (n // width, k // int8.DEPTH, width * int8.DEPTH)).astype("int8"),  # pairs within 128
            np.zeros(n, "int32"), np.ones(n, "float32"),
            np.zeros(n, "float32"), np.zeros(1, "float32"), np.zeros((m, n), "float32")], m)

    def amx_timer(m, n, k):
        return timer(amx.int8_kernel(m, n, k), [
            (rng.integers(-127, 128, (amx.padded_rows(m), k)) + 128).astype("uint8"), np.ones(m, "float32"),
            rng.integers(-127, 128, (n // amx.TILE, k // 4, amx.TILE * 4)).astype("int8"), np.zeros(n, "int32"),
            np.ones(n, "float32"), np.zeros(n, "float32"), np.zeros(1, "float32"), np.zeros((m, n), "float32")], m)

    amx_columns = " AMX-INT8 GOP/s | AMX / int8 |" if target.has_amx_int8 else ""
    print(f"{target.key}, {lanes} fp32 lanes, int8 on {dot.instruction}" + (", and on AMX-INT8" if amx_columns else ""))
    print(f"| rows x N x K | fp32 FMA GFLOP/s | int8 GOP/s | int8 / fp32 |{amx_columns}")
    print("| --- | --- | --- | --- |" + " --- | --- |" * bool(amx_columns))
    for m in (int(r) for r in args.rows.split(",")):
        for n, k in SHAPES:
            width_f = fma.tile(n, lanes)[1] * lanes
            fp32 = timer(fma.kernel(m, n, k, lanes), [
                rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n // width_f, k, width_f), dtype=np.float32),
                np.zeros(n, "float32"), np.zeros(1, "float32"), np.zeros((m, n), "float32")], m)
            runs = (fp32, int8_timer(m, n, k)) + ((amx_timer(m, n, k),) if amx_columns else ())
            best = [float("inf")] * len(runs)
            for _ in range(20):
                best = [min(b, run()) for b, run in zip(best, runs)]
            fp32_rate, int8_rate, *amx_rate = (2 * m * n * k / seconds / 1e9 for seconds in best)
            print(f"| {m} x {n} x {k} | {fp32_rate:.0f} | {int8_rate:.0f} | {int8_rate / fp32_rate:.2f} |" + "".join(f" {rate:.0f} | {rate / int8_rate:.2f} |" for rate in amx_rate))
    if args.peak:
        with tempfile.TemporaryDirectory() as folder:
            binary = Path(folder) / "peak"
            subprocess.run(["gcc", "-O2", "-march=native", str(Path(__file__).with_name("int8_peak.c")), "-o", str(binary)], check=True)
            print(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()

"""The attention kernels (``kernels/attention.py``: fp32, and AMX-BF16 where the CPU has it) alone,
on a model's shapes: one sequence, heads x dim (ModernBERT-base's 12 x 64 by default), Q, K and V
as one fused projection's columns, a key-padding mask; global layers (every key) and, with
``--window``, local ones. With ``--baseline REV``, the kernels of that git revision too, called
in turn with the current ones round by round (every other round in reverse), so that a shared
machine's load falls on both: the medians of each, and their ratio.

    python benchmarks/attention_kernel.py [--seq-len 512,1024,2048,4096] [--window 64] [--baseline HEAD~1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from amx_kernels import module_at


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", default="512,1024,2048,4096")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, help="also time local layers: keys at most this far from the query")
    parser.add_argument("--kinds", default="fp32,amx-bf16", help="fp32, amx-bf16 (three products for the scores, int8 builds'), "
                        "amx-bf16-scores (one, bf16 builds'); the AMX ones skipped without AMX")
    parser.add_argument("--baseline", help="a git revision whose kernels are timed beside the current ones")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import numpy as np
    import tvm

    from tvmbert.core.targets import resolve, use_every_core
    from tvmbert.deploy.loader import request_amx_permission
    from tvmbert.kernels import attention

    use_every_core()
    target = resolve("llvm")
    if target.fp32_lanes < 8:
        sys.exit(f"{target.key}: no AVX2/AVX-512 here, no kernel of ours to time")
    kinds = [kind for kind in args.kinds.split(",") if kind == "fp32" or target.has_amx_bf16]
    if target.has_amx_bf16:
        request_amx_permission()
    rng = np.random.default_rng(0)
    heads, dim = args.heads, args.dim
    width = heads * dim
    with tempfile.TemporaryDirectory() as folder:
        versions = {"current": attention}
        if args.baseline:
            versions[args.baseline] = module_at(args.baseline, "tvmbert/kernels/attention.py", Path(folder))
        for seq in (int(s) for s in args.seq_len.split(",")):
            columns = tvm.runtime.tensor(rng.standard_normal((seq, 3 * width), dtype=np.float32))
            mask = np.zeros((1, 1, 1, seq), "float32")
            mask[..., seq - seq // 8:] = np.finfo(np.float32).min  # a padded tail
            operands = [columns] * 3 + [tvm.runtime.tensor(mask), tvm.runtime.tensor(np.zeros(1, "int32"))]
            y = tvm.runtime.tensor(np.zeros((1, seq, heads, dim), "float32"))
            sources = [(3 * width, i * width) for i in range(3)]
            for window in (None, args.window) if args.window else (None,):
                for kind in kinds:
                    calls = {}
                    for name, module in versions.items():
                        make = module.kernel if kind == "fp32" else module.amx_bf16_kernel
                        scores = {"bf16_scores": True} if kind == "amx-bf16-scores" else {}  # a bf16 build's: one product
                        function = make(1, heads, seq, dim, target.fp32_lanes, sources, mask.shape, dim ** -0.5, window=window, **scores)
                        calls[name] = tvm.compile(tvm.IRModule({"main": function}), target=target.tvm_target())["main"]
                        calls[name](*operands, y)  # warm up
                    times = {name: [] for name in versions}
                    for round_ in range(args.rounds):
                        for name in (list(versions) if round_ % 2 == 0 else list(versions)[::-1]):
                            started = time.perf_counter()
                            calls[name](*operands, y)
                            times[name].append(time.perf_counter() - started)
                    keys = seq if window is None else min(seq, 2 * window + 1)
                    flops = 4 * heads * seq * keys * dim
                    medians = {name: float(np.median(t)) for name, t in times.items()}
                    line = "  ".join(f"{name} {s * 1e3:8.2f} ms ({flops / s / 1e9:5.1f} GFLOP/s)" for name, s in medians.items())
                    ratio = f"  current / {args.baseline}: {medians['current'] / medians[args.baseline]:.3f}" if args.baseline else ""
                    layer = "global" if window is None else f"window {window}"
                    print(f"{kind} {seq} tokens, {layer}: {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()

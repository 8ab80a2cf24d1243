"""The AMX kernels (``kernels/amx.py``, bf16 and int8) on bert-base's four weight matmuls as a
model runs them: 12 layers, each with weights of its own (so that they come from memory, ~170 MB
in bf16, as in an inference), their epilogues included (GELU, residual, bf16 output). With
``--baseline REV``, the kernels of that git revision too, called in turn with the current ones
round by round (every other round in reverse), so that a shared machine's load falls on both:
the medians of each, and their ratio. Needs a CPU with AMX.

    python benchmarks/amx_kernels.py [--rows 128,512] [--dtype bfloat16,int8] [--baseline HEAD~1] [--rounds 12]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bert-base's (N, K, activation, output dtype in bf16 builds, residual): Q/K/V, attention output, FFN up, FFN down
SHAPES = ((2304, 768, None, "float32", False), (768, 768, None, "float32", True),
          (3072, 768, "relax.nn.gelu", "bfloat16", False), (768, 3072, None, "float32", True))
LAYERS = 12


def module_at(revision: str, path: str, folder: Path):
    """The module at ``path`` (``tvmbert/kernels/amx.py``) as it was at git ``revision``, imported
    as a module of its own (also by ``attention_kernel.py``)."""
    source = subprocess.run(["git", "show", f"{revision}:{path}"], check=True, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent).stdout
    file = folder / f"{Path(path).stem}_{revision.replace('~', '_').replace('/', '_')}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module  # a dataclass looks its module up as it is made
    spec.loader.exec_module(module)
    return module


def operands(dtype: str, m: int, n: int, k: int, out_dtype: str, residual: bool, rng):
    """(x operands, one weight per layer, the rest) as the kernel of ``dtype`` takes them."""
    import ml_dtypes
    import numpy as np
    import tvm

    from tvmbert.kernels import amx

    def tensor(array):
        return tvm.runtime.tensor(array)

    rest = [np.zeros((m, n) if residual else (1,), "float32")]
    if dtype == "bfloat16":
        x = [tensor(rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16))]
        weights = [tensor(rng.standard_normal((n // 16, k // 2, 16, 2)).astype(ml_dtypes.bfloat16)) for _ in range(LAYERS)]
        rest = [np.zeros(n, "float32"), *rest, np.zeros((m, n), ml_dtypes.bfloat16 if out_dtype == "bfloat16" else "float32")]
        return x, weights, [tensor(a) for a in rest]
    x = [tensor((rng.integers(-127, 128, (amx.padded_rows(m), k)) + 128).astype("uint8")), tensor(np.ones(m, "float32"))]
    weights = [tensor(rng.integers(-127, 128, (n // amx.TILE, k // 4, amx.TILE * 4)).astype("int8")) for _ in range(LAYERS)]
    rest = [np.zeros(n, "int32"), np.ones(n, "float32"), np.zeros(n, "float32"), *rest, np.zeros((m, n), "float32")]
    return x, weights, [tensor(a) for a in rest]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="128,512")
    parser.add_argument("--dtype", default="bfloat16,int8")
    parser.add_argument("--baseline", help="a git revision whose kernels are timed beside the current ones")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()

    import numpy as np
    import tvm

    from tvmbert.core.targets import resolve, use_every_core
    from tvmbert.deploy.loader import request_amx_permission
    from tvmbert.kernels import amx

    use_every_core()
    target = resolve("llvm")
    if not (target.has_amx_bf16 and target.has_amx_int8):
        sys.exit(f"{target.key}: no AMX here")
    request_amx_permission()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        versions = {"current": amx}
        if args.baseline:
            versions[args.baseline] = module_at(args.baseline, "tvmbert/kernels/amx.py", Path(folder))
        for dtype in args.dtype.split(","):
            for m in (int(r) for r in args.rows.split(",")):
                calls, data = {}, {}
                for n, k, activation, out_dtype, residual in SHAPES:
                    out_dtype = out_dtype if dtype == "bfloat16" else "float32"
                    data[n, k] = operands(dtype, m, n, k, out_dtype, residual, rng)
                    for name, module in versions.items():
                        kernel = (module.bf16_kernel(m, n, k, activation=activation, residual=residual, out_dtype=out_dtype)
                                  if dtype == "bfloat16" else module.int8_kernel(m, n, k, activation=activation, residual=residual))
                        calls[name, n, k] = tvm.compile(tvm.IRModule({"main": kernel}), target=target.tvm_target()).jit()["main"]
                totals = {name: [] for name in versions}
                for round_ in range(args.rounds):
                    for name in (list(versions) if round_ % 2 == 0 else list(versions)[::-1]):
                        total = 0.0
                        for layer in range(LAYERS):
                            for n, k, *_ in SHAPES:
                                x, weights, rest = data[n, k]
                                started = time.perf_counter()
                                calls[name, n, k](*x, weights[layer], *rest)
                                total += time.perf_counter() - started
                        totals[name].append(total)
                flops = 2 * m * sum(n * k for n, k, *_ in SHAPES) * LAYERS
                medians = {name: float(np.median(times)) for name, times in totals.items()}
                line = "  ".join(f"{name} {ms * 1e3:7.2f} ms ({flops / ms / 1e12:.2f} T{'FLOP' if dtype == 'bfloat16' else 'OP'}/s)"
                                 for name, ms in medians.items())
                ratio = f"  current / {args.baseline}: {medians['current'] / medians[args.baseline]:.3f}" if args.baseline else ""
                print(f"{dtype} {m} rows x 12 layers: {line}{ratio}", flush=True)


if __name__ == "__main__":
    main()

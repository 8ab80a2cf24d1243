"""Stage 3: the named, ordered graph-pass pipeline over the converted Relax module."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from . import artifacts, passes
from .artifacts import Artifact
from .config import MIXED_PRECISION
from .convert import convert, load_module, save_module
from .errors import InputError
from .job import Job


def _passes(dtype: str) -> dict[str, Callable[[], list]]:
    from tvm import relax

    t = relax.transform
    return {
        # Weight-only computations (transposed weights, the position-embedding slice) move into
        # main_transform_params, which the build runs once: folded like bound constants, while
        # the weights stay in a separate file instead of inside the library.
        "bind-params": lambda: [t.LiftTransformParams()],
        "fold-constants": lambda: [t.FoldConstant()],
        # Q, K and V projections (same input) become one matmul + split; biases too.
        "combine-qkv": lambda: [passes.combine_parallel_matmuls()],
        "cse": lambda: [t.EliminateCommonSubexpr()],
        "dce": lambda: [t.DeadCodeElimination()],
        # Added for --dtype float16/bfloat16: matmuls in reduced precision accumulating in fp32;
        # bind-params then stores those weights in it (half the bytes to stream per inference).
        "mixed-precision": lambda: [t.ToMixedPrecision(out_dtype="float32") if dtype == "float16"
                                    else passes.reduced_precision_matmuls(dtype)],
        # Off by default (--fast-math): GELU as tanh, fast exp/erf/tanh/softmax.
        "fast-math": passes.fast_math,
        "legalize": lambda: [t.LegalizeOps(passes.vectorized_erf()), t.AnnotateTIROpPattern(), t.FoldConstant()],
        "fuse": lambda: [t.FuseOps(), t.FuseTIR()],
    }


def pass_list(names, dtype: str = "float32") -> list:
    """The passes behind ``names``, in order, for pipelines built outside ``optimize`` (training)."""
    registry = _passes(dtype)
    return [p for name in names for p in registry[name]()]


PASS_NAMES = ("fold-constants", "cse", "combine-qkv", "mixed-precision", "bind-params", "dce", "fast-math", "legalize", "fuse")
OPT_IN = ("mixed-precision", "fast-math")  # added by --dtype float16/bfloat16 and --fast-math
DEFAULT_PASSES = tuple(name for name in PASS_NAMES if name not in OPT_IN)


def check_pass_names(names, where: str = "options") -> None:
    unknown = [name for name in names if name not in PASS_NAMES]
    if unknown:
        raise InputError(f"{where}: unknown pass {', '.join(repr(n) for n in unknown)} (known: {', '.join(PASS_NAMES)})")


def pipeline(job: Job, disable: tuple[str, ...] = ()) -> tuple[str, ...]:
    check_pass_names(disable, "--disable")
    passes = job.config.passes if job.config.passes is not None else DEFAULT_PASSES
    wanted = {"fast-math": job.config.fast_math, "mixed-precision": job.config.dtype in MIXED_PRECISION}
    for name, on in wanted.items():
        if on and name not in passes:
            # In its canonical place: before the first pass that comes after it in PASS_NAMES.
            rank = PASS_NAMES.index(name)
            at = next((i for i, other in enumerate(passes) if PASS_NAMES.index(other) > rank), len(passes))
            passes = (*passes[:at], name, *passes[at:])
    return tuple(name for name in passes if name not in disable)


def count_ops(module) -> dict[str, int]:
    """Operator counts of main: Relax ops by name, fused kernels as tir:<kernel>."""
    import tvm
    from tvm import relax

    counts: Counter = Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            name = expr.op.name
            if name == "relax.call_tir":
                name = "tir:" + re.sub(r"\d+$", "", expr.args[0].name_hint)
            counts[name.removeprefix("relax.")] += 1

    relax.analysis.post_order_visit(module["main"].body, visit)
    return dict(sorted(counts.items()))


def optimize(job: Job, force: bool = False, disable: tuple[str, ...] = ()) -> Artifact:
    converted = job.upstream("convert", convert)
    names = pipeline(job, disable)
    fp = artifacts.fingerprint(stage="optimize", convert=converted.fingerprint, passes=names)
    path = job.stage_dir("optimize")
    if not force and (hit := artifacts.cached("optimize", path, fp)):
        job.say(f"optimize: cached ({path})")
        return hit
    job.say(f"optimize: {' -> '.join(names) or 'no passes'}")
    import tvm

    module = load_module(converted.path)
    registry = _passes(job.config.dtype)
    ops_before = count_ops(module)
    if job.config.dtype not in ("float32", "float16"):
        # TVM legalizes layer_norm in float32/float16 only (FoldConstant legalizes too, to try):
        # in other dtypes it becomes mean/variance/sqrt before any pass sees it.
        from tvm import relax

        module = relax.transform.DecomposeOpsForTraining()(module)
    per_pass = []
    for name in names:
        module = tvm.transform.Sequential(registry[name]())(module)
        per_pass.append({"pass": name, "ops": count_ops(module)})
    meta = {"outputs": converted.meta.get("outputs", []), "passes": list(names), "ops_before": ops_before, "ops_after": count_ops(module), "per_pass": per_pass}
    with artifacts.writing("optimize", path, fp, meta) as tmp:
        save_module(module, tmp)
    return Artifact("optimize", path, fp, {"fingerprint": fp, **meta}, cached=False)


def pictures(job: Job, optimized: Artifact) -> list[str]:
    """Layer 0 before (as converted) and after the pipeline, as SVG (or DOT without Graphviz)."""
    from . import viz

    folder = optimized.path / "viz"
    before = viz.render(load_module(job.stage_dir("convert")), f"{job.source.name}: BertLayer 0 as converted", folder / "layer0-before")
    after = viz.render(load_module(optimized.path), f"{job.source.name}: BertLayer 0 after {' -> '.join(optimized.meta['passes'])}",
                       folder / "layer0-after")
    return [str(before), str(after)]

"""Stage 3: the named, ordered graph-pass pipeline over the converted Relax module."""

from __future__ import annotations

import re
from collections import Counter

from tvmbert.core.artifacts import Artifact
from tvmbert.ir.files import load_module, save_module
from tvmbert.passes.pipeline import pass_list, per_target, selected
from tvmbert.stages.cached import CachedStage
from tvmbert.stages.convert import convert
from tvmbert.stages.job import Job


def pipeline(job: Job) -> tuple[str, ...]:
    return selected(job.config.passes, job.pass_context, job.config.disable)


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


def optimize(job: Job, force: bool = False) -> Artifact:
    converted = job.upstream("convert", convert)
    names = pipeline(job)
    stage = CachedStage(job, "optimize", convert=converted.fingerprint, passes=names,
                        **({"target": job.target.key} if per_target(names) else {}),
                        # which kernels a pass calls follows the target's features, -mattr's too (-amx-int8, -avx512vnni)
                        **({"mattr": job.target.config["mattr"]} if per_target(names) and job.target.config.get("mattr") else {}))
    if hit := stage.reused(force):
        return hit
    job.say(f"optimize: {' -> '.join(names) or 'no passes'}")
    import tvm

    module = load_module(converted.path)
    ops_before = count_ops(module)
    if job.config.dtype == "float64":
        # TVM legalizes layer_norm in float32/float16 only (FoldConstant legalizes too, to try):
        # in other dtypes it becomes mean/variance/sqrt before any pass sees it.
        from tvm import relax

        module = relax.transform.DecomposeOpsForTraining()(module)
    per_pass = []
    for name in names:
        module = tvm.transform.Sequential(pass_list((name,), job.pass_context))(module)
        per_pass.append({"pass": name, "ops": count_ops(module)})
    meta = {"outputs": converted.meta.get("outputs", []), "packing": converted.meta.get("packing"),
            "random_weights": converted.meta.get("random_weights", []), "passes": list(names), "ops_before": ops_before, "ops_after": count_ops(module), "per_pass": per_pass}
    with stage.writing(meta) as tmp:
        save_module(module, tmp)
    return stage.written(meta)


def pictures(job: Job, optimized: Artifact) -> list[str]:
    """Layer 0 before (as converted) and after the pipeline, as SVG (or DOT without Graphviz)."""
    from tvmbert.ir import viz

    folder = optimized.path / "viz"
    before = viz.render(load_module(job.stage_dir("convert")), f"{job.source.name}: BertLayer 0 as converted", folder / "layer0-before")
    after = viz.render(load_module(optimized.path), f"{job.source.name}: BertLayer 0 after {' -> '.join(optimized.meta['passes'])}",
                       folder / "layer0-after")
    return [str(before), str(after)]

"""`run CONFIG`: the stages a config lists, in order, each reusing what is unchanged."""

from __future__ import annotations

from .artifacts import Artifact
from .bench import bench
from .build import build
from .convert import convert
from .export import export
from .job import Job
from .optimize import optimize
from .trace import trace
from .tune import tune
from .verify import verify


def artifact_summary(artifact: Artifact) -> dict:
    meta = {k: v for k, v in artifact.meta.items() if k not in ("fingerprint", "stage")}
    return {"artifact": meta.pop("artifact", str(artifact.path)), "cached": artifact.cached, **meta}


def run_stage(job: Job, stage: str, force: bool = False) -> dict:
    """One stage by name, as a JSON-ready dict."""
    if stage == "verify":
        return verify(job).to_json()
    if stage == "bench":
        return bench(job)
    if stage == "tune":
        return tune(job).to_json()
    if stage == "export":
        return export(job)
    produce = {"trace": trace, "convert": convert, "optimize": optimize, "build": build}[stage]
    return artifact_summary(produce(job, force=force))


def run(job: Job, force: bool = False) -> dict:
    results = {}
    for stage in job.config.stages:
        results[stage] = run_stage(job, stage, force)
        if stage == "verify":
            job.say(f"verify: max abs diff {results[stage]['max_abs_diff']:.3g} (tolerance {results[stage]['tolerance']:.3g})")
    return results


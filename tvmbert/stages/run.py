"""`run CONFIG`: the stages a config lists, in order, each reusing what is unchanged."""

from __future__ import annotations

from tvmbert.core.registry import STAGES
from tvmbert.stages.job import Job


def run(job: Job, force: bool = False) -> dict:
    results = {}
    for stage in job.config.stages:
        results[stage] = STAGES[stage].run(job, force)
        if stage == "verify":
            job.say(f"verify: max abs diff {results[stage]['max_abs_diff']:.3g} (tolerance {results[stage]['tolerance']:.3g})")
    return results

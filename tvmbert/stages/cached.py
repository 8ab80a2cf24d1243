"""The cache protocol of the stages that write an artifact (trace, convert, optimize, build):
a fingerprint of everything the artifact depends on, the artifact reused while it matches, and
a new one written atomically under the stage's folder."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tvmbert.core import artifacts
from tvmbert.core.artifacts import Artifact
from tvmbert.stages.job import Job


class CachedStage:
    def __init__(self, job: Job, stage: str, **inputs):
        """``inputs``: what the artifact depends on (upstream fingerprints, options, versions)."""
        self.job, self.stage = job, stage
        self.fingerprint = artifacts.fingerprint(stage=stage, **inputs)
        self.path = job.stage_dir(stage)

    def reused(self, force: bool) -> Artifact | None:
        """The artifact already written for these inputs, unless ``force``; said when reused."""
        if force or (hit := artifacts.cached(self.stage, self.path, self.fingerprint)) is None:
            return None
        self.job.say(f"{self.stage}: cached ({self.path})")
        return hit

    @contextmanager
    def writing(self, meta: dict) -> Iterator[Path]:
        """A temporary folder for the artifact's files, which replaces the stage's folder whole
        once the block succeeds, with ``meta`` (as it is then) in its stage file."""
        with artifacts.writing(self.stage, self.path, self.fingerprint, meta) as tmp:
            yield tmp

    def written(self, meta: dict) -> Artifact:
        return Artifact(self.stage, self.path, self.fingerprint, {"fingerprint": self.fingerprint, **meta}, cached=False)

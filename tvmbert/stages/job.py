"""A job: a validated config with its model, target and artifact folders resolved once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tvmbert.core import artifacts, memory, targets
from tvmbert.core.artifacts import Artifact
from tvmbert.core.config import JobConfig, user_log_dir
from tvmbert.core.console import to_stderr
from tvmbert.core.errors import InputError
from tvmbert.core.families import FAMILIES, TASKS
from tvmbert.core.registry import STAGES
from tvmbert.frontend import models
from tvmbert.kernels import fma
from tvmbert.passes.pipeline import PassContext, check_pass_names


@dataclass
class Job:
    config: JobConfig
    no_deps: bool = False  # never run an earlier stage; its artifact must exist
    say: Callable[[str], None] = field(default=to_stderr)  # human progress lines, never stdout

    def __post_init__(self):
        models.stay_offline()
        targets.use_every_core()
        self.config.validate()
        self.source = models.resolve(self.config.model, self.config.seed, self.config.task, self.config.allow_random_weights)
        self.target = targets.resolve(self.config.target)
        if self.config.passes is not None:
            check_pass_names(self.config.passes, "passes")
        check_pass_names(self.config.disable, "--disable")
        if self.config.dtype == "bfloat16" and self.target.kind == "llvm" and not self.target.has_amx_bf16:
            raise InputError(self.target.no_amx_message())
        if self.config.dtype == "int8" and (self.target.kind != "llvm" or not self.target.int8_lanes):
            raise InputError(f"--dtype int8 runs on our x86 kernels, which need AVX2 (or AVX-512); target {self.target.key} "
                             "has neither: use --dtype float32 there")
        if self.config.seq_len is not None:
            models.check_seq_len(self.source, self.config.seq_len)
        if self.config.tokens is not None:
            self._check_packed()
        artifacts.check_writable_folder(Path(self.config.workdir), "--workdir")
        artifacts.check_writable_folder(self.log_root, "--log-dir")
        if self.config.text is not None:
            _ = self.inputs  # tokenized now: a text that does not fit fails before any work

    @cached_property
    def inputs(self) -> models.ExampleInputs:
        return models.example_inputs(self.source, self.config.batch, self.config.seq_len, self.config.text)

    @property
    def shape_key(self) -> str:
        batch, seq_len = self.shape
        tokens = f"-t{self.config.tokens}" if self.config.tokens is not None else ""
        return f"b{batch}-s{seq_len}{tokens}-{self.numerics_key}"

    @property
    def numerics_key(self) -> str:
        """What decides the numbers a build computes, as folder names carry it."""
        return self.config.dtype + ("-fastmath" if self.config.fast_math else "")

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, seq_len) of the example inputs, tokenizing only where the text decides it."""
        return models.input_shape(self.source, self.config.batch, self.config.seq_len, self.config.text) or self.inputs.shape

    def check_memory(self, shapes: list[tuple[int, int]] | None = None) -> memory.Estimate:
        """Before work that could exhaust the machine's memory: exit 2 now rather than the OOM
        killer later. ``shapes``: (batch, seq_len) pairs, default the job's."""
        shapes = shapes or [self.shape]
        return memory.check(models.sizes(self.source), shapes, self.config.dtype, f"{self.source.name} ({self.config.dtype})")

    @property
    def pass_context(self) -> PassContext:
        return PassContext(self.config.dtype, self.target, self.config.fast_math, fma.min_rows(self.target.key))

    @property
    def packed(self) -> bool:
        """A packed build: the batch's real tokens as one stream (packing.py)."""
        return self.config.tokens is not None

    def _check_packed(self) -> None:
        if why := FAMILIES[self.source.family].not_packable:
            raise InputError(f"--tokens: packed builds of {self.source.family} models are not supported yet ({why}); "
                             "build it without --tokens")
        if not TASKS[self.source.task].packable:
            packable = ", ".join(name for name, task in TASKS.items() if task.packable)
            raise InputError(f"--tokens: a packed build of {self.source.task} is not supported (its head reads each sequence's "
                             f"first token inside the model); packed builds serve {packable}")
        known = models.input_shape(self.source, self.config.batch, self.config.seq_len, self.config.text)
        batch, seq_len = known or self.inputs.shape
        if self.config.tokens > batch * seq_len:
            raise InputError(f"--tokens {self.config.tokens} is above batch x seq-len ({batch} x {seq_len} = {batch * seq_len})")

    def stage_dir(self, stage: str) -> Path:
        base = Path(self.config.workdir) / self.source.key / self.shape_key
        if not STAGES[stage].per_target:
            return base / stage
        # A graph-less CUDA build beside the captured one: each is rebuilt only when its inputs change.
        without_graph = "_no-cuda-graph" if self.target.kind == "cuda" and not self.config.cuda_graph else ""
        return base / (self.target.key + without_graph) / stage

    @property
    def weights_pool(self) -> Path:
        """Where the work directory keeps one copy of each distinct weights file its artifacts link."""
        return Path(self.config.workdir) / ".weights"

    @property
    def log_root(self) -> Path:
        """This user's tuning logs: --log-dir (or the config's log_dir), else user_log_dir()."""
        return Path(self.config.log_dir).expanduser() if self.config.log_dir else user_log_dir()

    def log_dir(self) -> Path:
        """This user's tuning database folder for the job's target: where tune writes, and what
        every lookup reads before the shipped records (tuning.database.shipped_folders)."""
        return self.log_root / self.target.key

    def upstream(self, stage: str, produce: Callable[[Job], Artifact]) -> Artifact:
        """The artifact of an earlier stage: reused or produced, unless --no-deps forbids producing."""
        if self.no_deps:
            path = self.stage_dir(stage)
            return artifacts.require(stage, path, f"tvmbert {stage} {self.config.model}")
        return produce(self)

"""Stage 6: numerics of the build against PyTorch, on the example input and padded random ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from . import models
from .build import build
from .config import torch_dtype
from .errors import CheckFailed, ToolchainError
from .job import Job
from .runtime import CompiledModel

# The seed reached ~1e-5 on BERT-base in fp32; float64 must be exact to rounding.
# float16/bfloat16: matmul inputs in reduced precision, accumulation in fp32, against PyTorch in
# fp32 (bert-tiny: ~2e-4 in float16, ~1.4e-3 in bfloat16, whose mantissa has 8 bits).
DEFAULT_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 2e-2, "bfloat16": 5e-2}
# --fast-math trades exactness for speed (tanh GELU, fast exp): verify reports the error it
# measures (~2e-5 on bert-tiny); this bound only catches a broken approximation.
FAST_MATH_TOLERANCE = 1e-2


@dataclass
class OutputDiff:
    name: str
    shape: list
    max_abs_diff: float
    max_rel_diff: float


@dataclass
class VerifyResult:
    passed: bool
    max_abs_diff: float
    max_rel_diff: float
    tolerance: float
    dtype: str
    fast_math: bool
    samples: int
    target: str
    outputs: list[OutputDiff]

    def to_json(self) -> dict:
        return asdict(self)


def sample_inputs(job: Job, count: int) -> list[tuple]:
    """The example input first, then seeded random ids with random real lengths (padding)."""
    import torch

    first = job.inputs
    samples = [first.as_tuple()]
    batch, seq_len = first.shape
    generator = torch.Generator().manual_seed(job.config.seed + 7)
    high = int(first.input_ids.max()) + 1
    for _ in range(count - 1):
        ids = torch.randint(5, max(high, 6), (batch, seq_len), generator=generator)
        lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch,), generator=generator)
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        samples.append((ids * mask, mask, first.token_type_ids * mask))
    return samples


def verify(job: Job) -> VerifyResult:
    import torch

    built = job.upstream("build", build)
    if not job.target.device_present():
        raise ToolchainError(f"verify runs the model: this machine has no {job.target.kind} device (the build itself is at {built.path})")
    options = job.config.verify
    tolerance = options.tolerance or (FAST_MATH_TOLERANCE if job.config.fast_math else DEFAULT_TOLERANCE[job.config.dtype])
    reference = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed)
    compiled = CompiledModel(built, job.target.device())
    names = [o["name"] for o in built.meta.get("outputs", [])] or ["last_hidden_state", "pooler_output"]
    worst: dict[int, OutputDiff] = {}
    for sample in sample_inputs(job, options.samples):
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*sample)]
        actual = compiled([t.numpy() for t in sample])
        for index, (want, got) in enumerate(zip(expected, actual)):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            rel = diff / np.maximum(np.abs(want.astype(np.float64)), 1e-3)
            previous = worst.get(index)
            worst[index] = OutputDiff(
                names[index] if index < len(names) else f"output{index}",
                list(want.shape),
                max(float(diff.max()), previous.max_abs_diff if previous else 0.0),
                max(float(rel.max()), previous.max_rel_diff if previous else 0.0),
            )
    outputs = [worst[i] for i in sorted(worst)]
    max_abs = max(o.max_abs_diff for o in outputs)
    result = VerifyResult(
        passed=bool(max_abs <= tolerance),
        max_abs_diff=max_abs,
        max_rel_diff=max(o.max_rel_diff for o in outputs),
        tolerance=tolerance,
        dtype=job.config.dtype,
        fast_math=job.config.fast_math,
        samples=options.samples,
        target=job.target.key,
        outputs=outputs,
    )
    return result


def check(result: VerifyResult) -> None:
    if not result.passed:
        raise CheckFailed(f"verify failed: max abs diff {result.max_abs_diff:.3g} > tolerance {result.tolerance:.3g}")

"""Stage 6: numerics of the build against PyTorch, on the example input and padded random ones."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tvmbert.core import accuracy
from tvmbert.core.config import torch_dtype
from tvmbert.core.errors import CheckFailed, InputError, ToolchainError
from tvmbert.core.families import TASKS
from tvmbert.deploy import packing
from tvmbert.deploy.compiled import CompiledModel
from tvmbert.frontend import models, texts
from tvmbert.stages.build import build
from tvmbert.stages.job import Job

# The seed reached ~1e-5 on BERT-base in fp32; float64 must be exact to rounding.
# float16/bfloat16: matmul inputs in reduced precision, accumulation in fp32, against PyTorch in
# fp32 (bert-tiny: ~2e-4 in float16, ~1.4e-3 in bfloat16, whose mantissa has 8 bits).
DEFAULT_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 2e-2, "bfloat16": 5e-2, "int8": 1.0}
# --fast-math trades exactness for speed (tanh GELU, fast exp): verify reports the error it
# measures (~2e-5 on bert-tiny); this bound only catches a broken approximation.
FAST_MATH_TOLERANCE = 1e-2
# What each head's users compare with fp32 (core/accuracy.py), the least value that passes, by
# dtype. fp32 and fp64 are held to the max abs diff already; their bars only catch a metric gone
# wrong. Spearman's is 0.99 there too: a random-weight model's sentence embeddings are all nearly
# alike (every pairwise similarity within ~1e-4), and fp32's rounding (max abs diff 4.8e-7) then
# reorders them: 0.9989 over 500 sentences. The reduced precisions' bars are those int8 is held
# to by the issue that asks for it (cosine and Spearman >= 0.99 on all-MiniLM-L6-v2).
ACCURACY_BARS = {
    "float32": {"cosine_min": 0.9999, "cosine_mean": 0.9999, "spearman": 0.99, "agreement": 1.0},
    "float64": {"cosine_min": 0.9999, "cosine_mean": 0.9999, "spearman": 0.99, "agreement": 1.0},
    "float16": {"cosine_min": 0.99, "cosine_mean": 0.995, "spearman": 0.99, "agreement": 0.98},
    "bfloat16": {"cosine_min": 0.99, "cosine_mean": 0.995, "spearman": 0.99, "agreement": 0.98},
    "int8": {"cosine_min": 0.99, "cosine_mean": 0.995, "spearman": 0.99, "agreement": 0.98},
}
# A model with a tokenizer is also measured on this many real sentences (frontend/texts.py).
DEFAULT_TEXTS = 500
# verify --train: (forward, gradients and the parameters after one optimizer step).
TRAIN_TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-10)}


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
    texts: int  # real sentences among the inputs (a model with a tokenizer)
    accuracy: list[dict]  # what the head's users compare: name, value, bar, passed, what (core/accuracy.py)
    random_weights: list[str]  # --allow-random-weights: the weights drawn at random, not the model's

    def to_json(self) -> dict:
        return asdict(self)


def sample_inputs(job: Job, count: int) -> list[tuple]:
    """The example input first, then seeded random ids with random real lengths (padding). A
    packed build's samples fit its tokens: random lengths, a full row and a row of one token."""
    import torch

    first = job.inputs
    batch, seq_len = first.shape
    samples = [] if job.packed else [first.as_tuple()]
    generator = torch.Generator().manual_seed(job.config.seed + 7)
    rng = np.random.default_rng(job.config.seed + 7)
    high = int(first.input_ids.max()) + 1
    while len(samples) < count:
        ids = torch.randint(5, max(high, 6), (batch, seq_len), generator=generator)
        lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch,), generator=generator)
        if job.packed:
            lengths = torch.tensor(packing.fitting_lengths(batch, seq_len, job.config.tokens, rng))
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        samples.append(models.make_inputs(job.source, ids * mask, mask, first.tensors.get("token_type_ids", mask) * mask).as_tuple())
    return samples


def agreement_tie(dtype: str, tolerance: float) -> float:
    """How far each logit may move, within which fp32's own choice of a label, tag or span is a
    tie (accuracy.py): an fp32 or fp64 build's max-abs tolerance, since it holds each logit that
    close; for reduced precisions at most fp32's own (1e-4), since their tolerance bounds a broken
    build only: int8's 1.0 would excuse nearly every flip int8 makes."""
    return tolerance if dtype in ("float32", "float64") else min(tolerance, DEFAULT_TOLERANCE["float32"])


def verify(job: Job) -> VerifyResult:
    import torch

    built = job.upstream("build", build)
    if not job.target.device_present():
        raise ToolchainError(f"verify runs the model: this machine has no {job.target.kind} device (the build itself is at {built.path})")
    options = job.config.verify
    tolerance = options.tolerance or (FAST_MATH_TOLERANCE if job.config.fast_math else DEFAULT_TOLERANCE[job.config.dtype])
    tie = agreement_tie(job.config.dtype, tolerance)
    reference = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed)
    compiled = CompiledModel(built, job)
    names = reference.output_names
    worst: dict[int, OutputDiff] = {}
    text_count = _text_count(job)
    samples = sample_inputs(job, options.samples)
    # The real sentences count towards the accuracy metrics only: the max abs diff (and its
    # tolerance) is the samples', as it always was (all-MiniLM-L6-v2 fp32 over 500 sentences: 1.07e-4).
    sentences = [t.as_tuple() for t in models.tokenized_texts(job.source, texts.reference_sentences(text_count), *job.inputs.shape)] \
        if text_count else []
    batch = job.inputs.shape[0]
    # Rows of each input that are its own: the last batch of sentences is filled up with repeats.
    own_rows = [batch] * len(samples) + [min(batch, text_count - i * batch) for i in range(len(sentences))]
    head = accuracy.HEAD_KINDS[TASKS[job.source.task].accuracy]
    compared: tuple[list, list] = ([], [])  # the head's rows of each input: the build's, fp32's
    for number, sample in enumerate(samples + sentences):
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*sample)]
        actual = compiled([t.numpy() for t in sample])
        # Per-token outputs are compared on each row's real tokens, as tvmbert.load returns them (a
        # packed build computes no others): what a padding position holds is read by no head, and
        # it amplifies a reduced precision's error (all-MiniLM-L6-v2 in int8 at 1 x 128: 2.4 at
        # [PAD] rows, 0.14-0.27 on the real tokens).
        mask = sample[job.inputs.names.index("attention_mask")].numpy()
        rows = own_rows[number]
        for into, outputs in zip(compared, (actual, expected)):
            into.append(head.rows([o[:rows] for o in outputs], mask[:rows]))
        if number >= len(samples):
            continue
        lengths = packing.lengths(mask, mask.shape)
        real = np.arange(mask.shape[1])[None, :] < lengths[:, None]
        for index, (want, got) in enumerate(zip(expected, actual)):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            rel = diff / np.maximum(np.abs(want.astype(np.float64)), 1e-3)
            if compiled.per_token[index]:
                diff, rel = diff[real], rel[real]
            previous = worst.get(index)
            worst[index] = OutputDiff(
                names[index],
                list(want.shape),
                max(float(diff.max()), previous.max_abs_diff if previous else 0.0),
                max(float(rel.max()), previous.max_rel_diff if previous else 0.0),
            )
    outputs = [worst[i] for i in sorted(worst)]
    max_abs = max(o.max_abs_diff for o in outputs)
    metrics = head.metrics(np.concatenate(compared[0]), np.concatenate(compared[1]), ACCURACY_BARS[job.config.dtype], tie)
    result = VerifyResult(
        passed=bool(max_abs <= tolerance) and all(m.passed for m in metrics),
        max_abs_diff=max_abs,
        max_rel_diff=max(o.max_rel_diff for o in outputs),
        tolerance=tolerance,
        dtype=job.config.dtype,
        fast_math=job.config.fast_math,
        samples=options.samples,
        target=job.target.key,
        outputs=outputs,
        texts=text_count,
        accuracy=[m.to_json() for m in metrics],
        random_weights=list(reference.random_weights),
    )
    return result


def _text_count(job: Job) -> int:
    count = job.config.verify.texts
    if count is None:
        return DEFAULT_TEXTS if models.has_tokenizer(job.source) and not job.packed else 0
    if count and not models.has_tokenizer(job.source):
        raise InputError(f"--texts measures real sentences through the model's tokenizer, and '{job.source.name}' has none "
                         "(presets never do): leave --texts out")
    if count and job.packed:
        raise InputError("--texts: a packed build takes only the rows that fit its --tokens, and the sentences are "
                         "padded rows of their own lengths: measure them on the padded build (without --tokens)")
    return count


def failure(result: dict) -> str | None:
    """The line a failed verify (its JSON) ends with, or None when it passed."""
    if result["max_abs_diff"] > result["tolerance"]:
        return f"verify failed: max abs diff {result['max_abs_diff']:.3g} > tolerance {result['tolerance']:.3g}"
    for metric in result.get("accuracy", []):
        if not metric["passed"]:
            return (f"verify failed: {metric['name']} {metric['value']:.4f} < {metric['bar']} ({metric['what']}; "
                    f"short by {metric['bar'] - metric['value']:.4f})")
    return None


def check(result: VerifyResult) -> None:
    line = failure(result.to_json())
    if line:
        raise CheckFailed(line)


@dataclass
class TrainVerifyResult:
    passed: bool
    layer: str
    shape: list
    dtype: str
    target: str
    forward_max_abs_diff: float
    grad_max_abs_diff: float  # over every parameter and the input
    step_max_abs_diff: float  # parameters after one SGD step from the same state
    forward_tolerance: float
    grad_tolerance: float
    grads: dict[str, float]  # per gradient
    fallback: dict  # a call with another batch size: did it run in PyTorch, and match it?
    saved_bytes: dict[str, int]  # activations held for the backward: tvm, torch
    tasks_tuned: int
    tasks_total: int

    def to_json(self) -> dict:
        return asdict(self)


def verify_training(job: Job) -> TrainVerifyResult:
    """Layer 0 of the model through add_tvm_dispatch against PyTorch, dropout on, same seeds:
    forward, every gradient, and one optimizer step."""
    import copy

    import torch

    from tvmbert.training import dispatch

    layer, (hidden, mask) = dispatch.job_layer(job)
    reference, compiled = copy.deepcopy(layer), copy.deepcopy(layer)
    dispatch.add_tvm_dispatch(compiled, (hidden, mask), target=job.config.target, log_dir=job.log_root)
    generator = torch.Generator().manual_seed(job.config.seed + 11)
    grad_output = torch.randn(hidden.shape, generator=generator, dtype=hidden.dtype)

    def step(module):
        x = hidden.clone().requires_grad_()
        torch.manual_seed(job.config.seed + 13)  # the dropout masks
        output = module(x, mask)
        output.backward(grad_output)
        grads = {"input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        return output.detach(), grads

    want_out, want_grads = step(reference)
    got_out, got_grads = step(compiled)
    grads = {name: _max_diff(got_grads[name], want) for name, want in want_grads.items()}
    step_diff = max(_max_diff(p, q) for p, q in zip(compiled.parameters(), reference.parameters()))
    forward_tol, grad_tol = TRAIN_TOLERANCE[job.config.dtype]
    fallback = _fallback_check(compiled, hidden, mask)
    layer_dispatch = dispatch.dispatch_of(compiled)
    current = layer_dispatch.compiled_for(layer_dispatch.mode())
    saved = {"tvm": dispatch.saved_activation_bytes(compiled, (hidden, mask)),
             "torch": dispatch.saved_activation_bytes(reference, (hidden, mask))}
    forward_diff = _max_diff(got_out, want_out)
    grad_diff = max(grads.values())
    return TrainVerifyResult(
        passed=bool(forward_diff <= forward_tol and grad_diff <= grad_tol and step_diff <= grad_tol and fallback["passed"]),
        layer=f"{type(layer).__name__} 0 of {job.source.name}",
        shape=list(hidden.shape),
        dtype=job.config.dtype,
        target=job.target.key,
        forward_max_abs_diff=forward_diff,
        grad_max_abs_diff=grad_diff,
        step_max_abs_diff=step_diff,
        forward_tolerance=forward_tol,
        grad_tolerance=grad_tol,
        grads=grads,
        fallback=fallback,
        saved_bytes=saved,
        tasks_tuned=current.tasks_tuned,
        tasks_total=current.tasks_total,
    )


def _max_diff(got, want) -> float:
    return float((got.detach().double() - want.detach().double()).abs().max())


def _fallback_check(compiled, hidden, mask) -> dict:
    """Another batch size must run the module's own forward, silently."""
    import torch

    from tvmbert.training import dispatch

    layer_dispatch = dispatch.dispatch_of(compiled)
    before = dict(layer_dispatch.calls)
    other_hidden, other_mask = torch.cat([hidden, hidden]), torch.cat([mask, mask])
    with torch.no_grad():
        torch.manual_seed(0)
        got = compiled(other_hidden, other_mask)
        torch.manual_seed(0)
        want = layer_dispatch.original_forward(other_hidden, other_mask)
    calls = layer_dispatch.calls
    ran_in_pytorch = calls["fallback"] == before["fallback"] + 1 and calls["tvm"] == before["tvm"]
    diff = _max_diff(got, want)
    return {"shape": list(other_hidden.shape), "ran_in_pytorch": ran_in_pytorch, "max_abs_diff": diff,
            "passed": bool(ran_in_pytorch and diff == 0.0)}


def check_training(result: TrainVerifyResult) -> None:
    if not result.passed:
        raise CheckFailed(f"verify --train failed: forward {result.forward_max_abs_diff:.3g} (tolerance {result.forward_tolerance:.3g}), "
                          f"gradients {result.grad_max_abs_diff:.3g} and step {result.step_max_abs_diff:.3g} "
                          f"(tolerance {result.grad_tolerance:.3g}), fallback {'ok' if result.fallback['passed'] else 'wrong'}")

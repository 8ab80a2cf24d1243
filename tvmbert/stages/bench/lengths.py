"""`tvmbert bench --lengths`: a variable-length workload, as an application sends it.

Requests of real lengths (drawn from a range, or the texts of a file), the exported package
(``tvmbert.load``: buckets, padding, planning) against engines that take any shape: PyTorch
eager and SDPA, and ONNX Runtime exported with dynamic batch and sequence axes. Every engine gets
the same requests, each padded to its longest sequence (as a tokenizer with padding=True does);
outputs are compared with PyTorch eager on the real tokens first; then rounds of a few requests
per engine, the engines in turn (rotating who goes first), after a warm-up.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from tvmbert.core.config import torch_dtype
from tvmbert.core.errors import InputError
from tvmbert.core.families import TASKS
from tvmbert.core.targets import cpu_count
from tvmbert.deploy.package import load
from tvmbert.frontend import models
from tvmbert.stages.bench.engines import CHECK_TOLERANCE, failure_line, onnx_session, why_unavailable
from tvmbert.stages.bench.timing import environment, set_threads
from tvmbert.stages.export import DEFAULT_SEQ_LENS, export
from tvmbert.stages.job import Job

ENGINES = ("tvm", "torch-eager", "torch-sdpa", "onnxruntime")
DEFAULT_REQUESTS = 100
CHECKED_REQUESTS = 3  # compared with PyTorch eager before timing
# Consecutive requests per engine in a round: another engine's thread pool, still spinning after
# its turn, would otherwise take the cores from every single request.
ROUND_REQUESTS = 10


def workload(job: Job, lengths: str, requests: int, batch: int) -> list[tuple[np.ndarray, ...]]:
    """The model's inputs per request (ids, mask and, where the family takes them, segments),
    each [batch, its longest]. ``lengths``: 'A-B' (uniform
    lengths, seeded random ids) or a file with one text per line (tokenized, in order)."""
    rng = np.random.default_rng(job.config.seed)
    if Path(lengths).is_file():
        rows = _texts(job, Path(lengths))
        requests = requests or max(1, len(rows) // batch)
        rows = [rows[i % len(rows)] for i in range(requests * batch)]
    else:
        low, high = _range(lengths)
        models.check_seq_len(job.source, high)
        requests = requests or DEFAULT_REQUESTS
        first_id = 1000 if job.source.vocab_size > 2000 else 5
        rows = [(rng.integers(first_id, job.source.vocab_size, n), np.zeros(n, np.int64))
                for n in rng.integers(low, high + 1, requests * batch)]
    out = []
    for start in range(0, len(rows), batch):
        group = rows[start : start + batch]
        width = max(len(ids) for ids, _ in group)
        ids, mask, segments = (np.zeros((len(group), width), np.int64) for _ in range(3))
        for row, (tokens, types) in enumerate(group):
            ids[row, : len(tokens)], mask[row, : len(tokens)], segments[row, : len(tokens)] = tokens, 1, types
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}
        out.append(tuple(given[name] for name in job.source.inputs))
    return out


def _range(lengths: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in lengths.split("-"))
    except ValueError:
        raise InputError(f"--lengths takes A-B (a range of token counts, e.g. 8-256) or a file of texts, got '{lengths}'") from None
    if not 1 <= low <= high:
        raise InputError(f"--lengths {lengths}: need 1 <= A <= B")
    return low, high


def _texts(job: Job, path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    if not models.has_tokenizer(job.source):
        raise InputError(f"--lengths {path}: texts need a tokenizer, and '{job.source.name}' has none (use A-B)")
    tokenizer = models.tokenizer_of(job.source)
    texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise InputError(f"--lengths {path} holds no text")
    rows = []
    for text in texts:
        encoded = tokenizer(text)
        if len(encoded["input_ids"]) > job.source.max_positions:
            raise InputError(f"--lengths {path}: a text has {len(encoded['input_ids'])} tokens, above the model's "
                             f"max_position_embeddings ({job.source.max_positions})")
        rows.append((np.array(encoded["input_ids"]), np.array(encoded.get("token_type_ids") or [0] * len(encoded["input_ids"]))))
    return rows


def _package(job: Job, longest: int, batch: int, seq_lens: tuple[int, ...]):
    """The model exported with buckets up to the workload's longest sequence (builds cached)."""
    chosen = [s for s in (seq_lens or DEFAULT_SEQ_LENS) if s < longest]
    chosen.append(next((s for s in sorted(seq_lens or DEFAULT_SEQ_LENS) if s >= longest), longest))
    batches = (batch,)  # every request has `batch` rows (the last one may have fewer)
    folder = (Path(job.config.workdir) / job.source.key /
              f"package-{job.numerics_key}-{job.target.key}-b{'_'.join(map(str, batches))}-s{'_'.join(map(str, chosen))}")
    export(job, folder, batches, tuple(chosen))
    return load(folder, warn=job.say)


def _onnx_dynamic(job: Job, sample, threads: int):
    """ONNX Runtime on the model exported once with dynamic batch and sequence axes."""
    import torch

    path = Path(job.config.workdir) / job.source.key / f"onnx-dynamic-{torch_dtype(job.config.dtype)}" / "model.onnx"
    axes = {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("seq", min=1, max=job.source.max_positions)}
    session = onnx_session(job, path, [torch.from_numpy(a) for a in sample], threads,
                           dynamic_shapes=tuple(axes for _ in job.source.inputs))
    return lambda arrays: session.run(None, dict(zip(job.source.inputs, arrays)))


def _engines(job: Job, names, requests, batch: int, seq_lens, threads: int) -> tuple[dict, dict, dict]:
    """name -> run(arrays) -> [outputs]; setup seconds; skipped engines with the reason."""
    import torch

    runs, setup, skipped = {}, {}, {}
    for name in names:
        if name != "tvm" and (reason := why_unavailable(name, job)):
            skipped[name] = reason
            job.say(f"bench: {name} skipped: {reason}")
            continue
        started = time.perf_counter()
        try:
            if name == "tvm":
                package = _package(job, max(r[0].shape[1] for r in requests), batch, seq_lens)
                runs[name] = lambda arrays, package=package: list(package(*arrays).values())
            elif name == "onnxruntime":
                runs[name] = _onnx_dynamic(job, requests[0], threads)
            else:
                model = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed,
                                    attn_implementation=name.removeprefix("torch-"))

                def run(arrays, model=model):
                    with torch.inference_mode():
                        return [t.numpy() for t in model(*(torch.from_numpy(a) for a in arrays))]

                runs[name] = run
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is skipped, with the reason
            if name == "tvm":
                raise
            skipped[name] = f"failed to set up: {failure_line(exc)}"
            job.say(f"bench: {name} skipped: {skipped[name]}")
            continue
        runs[name](requests[0])
        setup[name] = time.perf_counter() - started
    return runs, setup, skipped


def _wrong(outputs, expected, mask: np.ndarray, per_token: list[bool], tolerance: float) -> str | None:
    """Per-token outputs are compared on real tokens only (the package zeroes the padding's rows)."""
    worst = 0.0
    for have, want, token_rows in zip(outputs, expected, per_token):
        diff = np.abs(np.asarray(have, np.float64) - np.asarray(want, np.float64))
        worst = max(worst, float((diff[mask.astype(bool)] if token_rows else diff).max()))
    return f"wrong results: max abs diff {worst:.3g} > {tolerance:.3g}" if worst > tolerance else None


def bench_lengths(job: Job, lengths: str, requests: int = 0, seq_lens: tuple[int, ...] = ()) -> dict:
    """Throughput and per-request latency of each engine on the same variable-length requests."""
    if job.target.kind != "llvm":
        raise InputError("bench --lengths runs on the CPU (llvm) target")
    threads = job.config.bench.threads or cpu_count()
    set_threads(threads)
    batch = job.config.batch
    work = workload(job, lengths, requests, batch)
    wanted = [name for name in (job.config.bench.engines or ENGINES) if name in ENGINES] or list(ENGINES)
    if "tvm" not in wanted:
        wanted.insert(0, "tvm")
    if "torch-eager" not in wanted:
        wanted.append("torch-eager")  # the reference the others are checked against
    runs, setup, skipped = _engines(job, wanted, work, batch, seq_lens, threads)
    mask_index = job.source.inputs.index("attention_mask")
    per_token = [name in TASKS[job.source.task].per_token for name in models.load(job.source).output_names]
    tolerances = {name: CHECK_TOLERANCE[job.config.dtype] for name in runs}
    for request in work[:CHECKED_REQUESTS]:
        expected = runs["torch-eager"](request)
        for name in list(runs):
            problem = _wrong(runs[name](request), expected, request[mask_index], per_token, tolerances[name])
            if problem:
                if name == "tvm":
                    raise InputError(f"bench: the tvm package gives {problem}; run tvmbert verify")
                skipped[name] = problem
                del runs[name]
    options = job.config.bench
    for request in work[: options.warmup]:
        for run in runs.values():
            run(request)
    job.say(f"bench: {len(work)} requests of {batch} ({lengths}), {', '.join(runs)} in turn, {threads} threads")
    timings: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_index, start in enumerate(range(0, len(work), ROUND_REQUESTS)):
        turn = round_index % len(names)
        for name in names[turn:] + names[:turn]:
            for request in work[start : start + ROUND_REQUESTS]:
                started = time.perf_counter()
                runs[name](request)
                timings[name].append((time.perf_counter() - started) * 1000.0)
    sequences = sum(r[0].shape[0] for r in work)
    engines = {}
    for name in wanted:
        if name in timings:
            values = np.array(timings[name])
            engines[name] = {"throughput": round(sequences * 1000.0 / values.sum(), 2), "p50_ms": round(float(np.median(values)), 4),
                             "p99_ms": round(float(np.percentile(values, 99)), 4), "mean_ms": round(float(values.mean()), 4),
                             "setup_s": round(setup[name], 2)}
        elif name in skipped:
            engines[name] = {"skipped": skipped[name]}
    real = np.concatenate([r[mask_index].sum(axis=1) for r in work])
    others = {n: s["throughput"] for n, s in engines.items() if n != "tvm" and "throughput" in s}
    best = max(others, key=others.get) if others else None
    return {
        "model": job.source.name,
        "dtype": job.config.dtype,
        "workload": {"lengths": lengths, "requests": len(work), "batch": batch, "mean_length": round(float(real.mean()), 1),
                     "p50_length": int(np.median(real)), "max_length": int(real.max()),
                     "padded_fraction": round(1 - float(real.sum()) / sum(r[0].size for r in work), 3)},
        "environment": environment(job, threads),
        "engines": engines,
        "best_other": best,
        # tvm's throughput over the best other's: above 1, tvm serves more sequences per second
        "throughput_ratio": round(engines["tvm"]["throughput"] / others[best], 3) if best else None,
    }


"""Stage 8: one self-contained folder that serves any batch and length, loaded by ``tvmbert.load``.

TVM tunes static shapes only (a dynamic-shape BERT builds with untuned kernels, apache/tvm#11008),
so a package is a set of static builds, the buckets: one per (batch, sequence length), each a
normal ``build`` (tuned where the logs cover it). The loader pads a call to the cheapest buckets
that fit. Weights are stored once per distinct array: buckets share most of them, but the arrays
``build`` transforms (a position-embedding slice, weights laid out in a kernel's tiles)
can differ by shape. With ``packed``, every batch > 1 also gets packed buckets (packing.py) of
PACKED_FILLS of its tokens: a batch of mixed lengths runs its real tokens only.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tvmbert.core import artifacts, targets
from tvmbert.core.config import JobConfig
from tvmbert.core.errors import InputError
from tvmbert.core.families import FAMILIES, TASKS
from tvmbert.deploy import packing
from tvmbert.deploy.inputs import MASK_INPUT
from tvmbert.deploy.loader import LIBRARY_FILE
from tvmbert.deploy.package import (
    FORMAT,
    MANIFEST_FILE,
    PACKED_FORMAT,
    VARIANTS_FORMAT,
    load,
    missing_for,
    sha256,
    variants_of,
    write_manifest,
)
from tvmbert.deploy.weights import PARAMS_FILE, load_params
from tvmbert.frontend import models
from tvmbert.stages.build import build
from tvmbert.stages.job import Job

DEFAULT_BATCHES = (1, 8)
DEFAULT_SEQ_LENS = (16, 32, 64, 128, 256, 512)  # up to the model's max positions
WEIGHTS_FILE = "weights.npz"
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")  # sentence-transformers' names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "added_tokens.json", *models.SENTENCEPIECE_FILES)
SHORT_TEXT = "Hello"  # the example text of buckets shorter than the default one (trace needs some tokens)
TIMED_RUNS = 5  # per bucket, after one warm-up: the cost the loader's planner weighs buckets by
# A packed bucket per fraction of batch x seq_len tokens; the padded bucket serves full batches
# (and rows masked whole). bert-base 8 x 128 at half fill: docs/benchmarks.md, Padding-free batches.
PACKED_FILLS = (0.25, 0.5)


def export(job_or_config: Job | JobConfig, out_dir: str | Path | None = None, batches: tuple[int, ...] = (),
           seq_lens: tuple[int, ...] = (), packed: bool | None = None, cpus: tuple[str, ...] = ()) -> dict:
    """Builds every bucket (tuning first when the config gives tune.trials) and writes the package
    to ``out_dir`` whole (an existing package there is replaced). ``packed`` (default: the
    config's export.packed) adds packed buckets for batches > 1. ``cpus`` (default: the config's
    export.cpus, else the job's target alone): a build of every bucket per CPU, a fleet package
    whose loader runs the fastest build the machine it is on can run ("native" is the job's
    target, the others LLVM CPU names or database keys: x86-64-v3, llvm-haswell, ...). Returns the
    manifest, plus a ``report`` of sizes and times."""
    job = job_or_config if isinstance(job_or_config, Job) else Job(job_or_config)
    options = job.config.export
    out = Path(out_dir or options.out_dir or "")
    if not str(out_dir or options.out_dir or ""):
        raise InputError("export needs an output folder (-o DIR, or export.out_dir in the config)")
    _check_out(out)
    batches = tuple(sorted(set(batches or options.batches or DEFAULT_BATCHES)))
    seq_lens = tuple(sorted(set(seq_lens or options.seq_lens or
                                [s for s in DEFAULT_SEQ_LENS if s <= job.source.max_positions] or [job.source.max_positions])))
    if min(batches) < 1:
        raise InputError(f"--batch must be >= 1, got {min(batches)}")
    packed = options.packed if packed is None else packed
    if packed and (why := FAMILIES[job.source.family].not_packable):
        raise InputError(f"--packed: packed builds of {job.source.family} models are not supported yet ({why}); export it "
                         "without --packed")
    if packed and not TASKS[job.source.task].packable:
        raise InputError(f"--packed: {job.source.task} has no packed builds (its head reads each sequence's first token inside "
                         "the model); export it without --packed")
    for seq_len in seq_lens:
        models.check_seq_len(job.source, seq_len)
    job.check_memory([(batch, seq_len) for batch in batches for seq_len in seq_lens])
    variants = _variant_jobs(job, cpus or options.cpus or ("native",))
    if not job.target.device_present():
        job.say(f"export: no {job.target.kind} device here: buckets are built, but not timed (the loader weighs them by size)")

    started = time.perf_counter()
    built = []
    for variant in variants:
        for batch in batches:
            for seq_len in seq_lens:
                fills = sorted({max(batch, int(batch * seq_len * fill)) for fill in PACKED_FILLS}) if packed and batch > 1 else []
                for tokens in (None, *fills):
                    bucket_job = _bucket_job(variant, batch, seq_len, tokens)
                    job.say(f"export: bucket {batch}x{seq_len}" + (f", packed: {tokens} tokens" if tokens else "")
                            + (f" for {variant.target.key}" if len(variants) > 1 else ""))
                    bucket_started = time.perf_counter()
                    if job.config.tune.trials and variant is job:  # measured here: only this machine's own target
                        from tvmbert.stages.tune import tune

                        tune(bucket_job)
                    artifact = build(bucket_job)
                    built.append((bucket_job, artifact, time.perf_counter() - bucket_started))

    first_job, first_build, _ = built[0]
    trace_meta = artifacts.read("trace", first_job.stage_dir("trace")).meta
    convert_meta = artifacts.read("convert", first_job.stage_dir("convert")).meta
    fp = artifacts.fingerprint(stage="export", builds=[artifact.fingerprint for _, artifact, _ in built])
    with artifacts.writing("export", out, fp, {"manifest": MANIFEST_FILE}) as tmp:
        manifest = _write_package(tmp, job, built, trace_meta, convert_meta)
        if job.target.device_present():
            _time_buckets(tmp, manifest)
        for path in (tmp, *tmp.rglob("*")):  # deployed: readable by all, as an installed package is
            path.chmod(0o755 if path.is_dir() else 0o644)
    (out / artifacts.STAGE_FILE).chmod(0o644)  # written last, by artifacts.writing
    manifest["report"] = {
        "package_bytes": sum((out / name).stat().st_size for name in manifest["files"]) + (out / MANIFEST_FILE).stat().st_size,
        "weight_bytes": convert_meta["weight_bytes"],
        "stored_weight_bytes": (out / WEIGHTS_FILE).stat().st_size,
        "library_bytes": sum((out / b["library"]).stat().st_size for v in variants_of(manifest) for b in v["buckets"]),
        "seconds": round(time.perf_counter() - started, 1),
        "path": str(out),
    }
    job.say(f"export: {len(built)} buckets -> {out} ({manifest['report']['package_bytes'] / 1e6:.1f} MB, "
            f"weights {convert_meta['weight_bytes'] / 1e6:.1f} MB)")
    return manifest


def _variant_jobs(job: Job, cpus: tuple[str, ...]) -> list[Job]:
    """A job per CPU of a fleet package, the job's own target first (``native``), each key once."""
    if job.target.kind != "llvm" and tuple(cpus) != ("native",):
        raise InputError(f"--cpus: a package for several CPUs is built for llvm targets, and this job's target is "
                         f"{job.target.kind}")
    found: dict[str, Job] = {}
    for cpu in cpus:
        name = cpu.strip()
        if not name:
            continue
        if name == "native":
            variant = job
        else:
            # An LLVM CPU name, or a target key, which names what a host less some instruction sets runs
            cpu = targets.cpu_of_key("llvm-" + name.removeprefix("llvm-"))
            variant = Job(replace(job.config, target=json.dumps(cpu)), no_deps=job.no_deps, say=job.say)
        taken = found.setdefault(variant.target.key, variant)
        if taken.target.config != variant.target.config:  # this CPU's AMX withheld, and the same CPU named with it
            raise InputError(f"--cpus: '{name}' and an earlier entry both build for {variant.target.key}, one as "
                             f"'{targets.describe_config(taken.target.config)}', the other as "
                             f"'{targets.describe_config(variant.target.config)}': a package holds one build per CPU; name one")
    if not found:
        raise InputError("--cpus names no CPU: give native and/or LLVM CPU names, e.g. native,x86-64-v3")
    return list(found.values())


def _check_out(out: Path) -> None:
    """Replaced whole, so it must be a package already, an empty folder, or not exist yet:
    never a folder of other files (-o ~ would otherwise move a home directory away)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"-o {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise InputError(f"-o {out} holds other files: give a new or empty folder, or a package to replace")
    artifacts.check_writable_folder(out.parent, "-o")


def _bucket_job(job: Job, batch: int, seq_len: int, tokens: int | None = None) -> Job:
    """The job of one bucket: the same model, dtype and target at (batch, seq_len), packed to
    ``tokens``. Models with a tokenizer trace a text; a bucket shorter than the default text
    traces a short one."""
    config = replace(job.config, batch=batch, seq_len=seq_len, tokens=tokens)
    if not models.has_tokenizer(job.source):
        return Job(config, no_deps=job.no_deps, say=job.say)
    try:
        return Job(replace(config, text=job.config.text or models.DEFAULT_TEXT), no_deps=job.no_deps, say=job.say)
    except InputError:
        if job.config.text is not None:
            raise
        return Job(replace(config, text=SHORT_TEXT), no_deps=job.no_deps, say=job.say)


def _array_key(array: np.ndarray) -> str:
    digest = hashlib.sha256(f"{array.dtype.name}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).view(np.uint8).data)
    return digest.hexdigest()[:24]


def _write_package(folder: Path, job: Job, built: list, trace_meta: dict, convert_meta: dict) -> dict:
    weights: dict[str, np.ndarray] = {}
    variants: dict[str, dict] = {}
    (folder / "lib").mkdir()
    packing_meta = None
    fleet = len({bucket_job.target.key for bucket_job, _, _ in built}) > 1
    for bucket_job, artifact, seconds in built:
        batch, seq_len = bucket_job.inputs.shape
        tokens = bucket_job.config.tokens
        keys = []
        for array in load_params(artifact.file(PARAMS_FILE)).values():
            key = _array_key(array)
            weights.setdefault(key, array)
            keys.append(key)
        key = bucket_job.target.key
        library = "lib/" + (f"{key}/" if fleet else "") + f"b{batch}-s{seq_len}" + (f"-t{tokens}" if tokens else "") + ".so"
        (folder / library).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifact.file(LIBRARY_FILE), folder / library)
        if tokens:
            packing_meta = {"inputs": list(packing.input_names(bucket_job.source.inputs)),
                            "positions": artifact.meta["packing"]["positions"]}
        variant = variants.setdefault(key, {"target": bucket_job.target.config, "target_key": key, "buckets": [], "amx_kernels": 0})
        # The loader asks the OS for AMX's tile state before loading such libraries (bf16, or int8 on AMX-INT8).
        variant["amx_kernels"] += len(artifact.meta.get("amx_kernels") or ())
        variant["buckets"].append({"batch": batch, "seq_len": seq_len, **({"tokens": tokens} if tokens else {}), "library": library,
                                   "weights": keys, "tasks_total": artifact.meta["tasks_total"],
                                   "tasks_tuned": artifact.meta["tasks_tuned"], "build_seconds": artifact.meta["build_seconds"],
                                   "export_seconds": round(seconds, 1), "cached": artifact.cached})
    with open(folder / WEIGHTS_FILE, "wb") as handle:  # bfloat16 as its bits: npz has no bfloat16
        np.savez(handle, **{key: a.view(np.uint16) if a.dtype.name == "bfloat16" else a for key, a in weights.items()})
    tokenizer = _copy_tokenizer(job, folder / "tokenizer")
    builds = {"variants": list(variants.values())} if fleet else next(iter(variants.values()))
    manifest = {
        "format": VARIANTS_FORMAT if fleet else PACKED_FORMAT if packing_meta else FORMAT,
        "model": {"name": job.source.name, "key": job.source.key, "fingerprint": job.source.fingerprint, "task": job.source.task,
                  "vocab_size": job.source.vocab_size, "type_vocab_size": job.source.type_vocab_size,
                  "max_positions": job.source.max_positions, "weight_bytes": convert_meta["weight_bytes"]},
        "dtype": job.config.dtype,
        "fast_math": job.config.fast_math,
        "random_weights": trace_meta.get("random_weights", []),  # --allow-random-weights: drawn, not the model's
        **builds,
        "inputs": _inputs(built[0][0]),
        "outputs": _outputs(job, trace_meta),
        **({"packing": packing_meta} if packing_meta else {}),
        "weights_file": WEIGHTS_FILE,
        "weights": {key: {"dtype": a.dtype.name, "shape": list(a.shape)} for key, a in weights.items()},
        "tokenizer": tokenizer,
        "pooling": _pooling(job),
        "prompts": _prompts(job),
        "labels": _labels(job),
        "versions": {**trace_meta.get("versions", {}), "numpy": np.__version__, "tvmbert": _version(),
                     "python": platform.python_version()},
    }
    manifest["files"] = {str(path.relative_to(folder)): sha256(path) for path in sorted(folder.rglob("*")) if path.is_file()}
    write_manifest(folder, manifest)
    return manifest


def _inputs(job: Job) -> list[dict]:
    """The build's inputs in order, each with the range the loader checks and its pad value."""
    limits = job.source.input_limits
    return [{"name": name, "limit": limit, "pad": _pad_id(job) if name == "input_ids" else 0} for name, limit in limits.items()]


def _pad_id(job: Job) -> int:
    if job.source.path is None:
        return 0  # BertConfig's default
    value = json.loads((job.source.path / "config.json").read_text()).get("pad_token_id")
    return value if isinstance(value, int) and 0 <= value < job.source.vocab_size else 0


def _outputs(job: Job, trace_meta: dict) -> list[dict]:
    """The task's outputs in order, and which have a row per token (trimmed to each sequence's length)."""
    per_token = TASKS[job.source.task].per_token
    return [{"name": spec["name"], "dtype": spec["dtype"], "per_token": spec["name"] in per_token} for spec in trace_meta["outputs"]]


def _labels(job: Job) -> list[str] | None:
    """A classifier's label names by index, from its config's id2label (a server answers with
    them); None for other heads, or where the config names none."""
    if job.source.task not in ("text-classification", "token-classification") or job.source.path is None:
        return None
    try:
        names = json.loads((job.source.path / "config.json").read_text()).get("id2label") or {}
        return [str(names[key]) for key in sorted(names, key=int)]
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _pooling(job: Job) -> dict | None:
    """How sentence-transformers pools this model's embeddings, from its folder's modules.json
    (a Pooling module's config, a Normalize module after it), so that a server of the package
    returns the vectors the user got before; None where the folder says nothing."""
    if job.source.path is None or not (job.source.path / "modules.json").is_file():
        return None
    try:
        modules = json.loads((job.source.path / "modules.json").read_text())
        pooling = next(m for m in modules if m.get("type", "").endswith(".Pooling"))
        config = json.loads((job.source.path / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return None
    mode = next((mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")), None)
    if mode is None:
        return None
    return {"mode": mode, "normalize": any(m.get("type", "").endswith(".Normalize") for m in modules)}


def _prompts(job: Job) -> dict | None:
    """config_sentence_transformers.json's named prompts (an instruction model's "query: ") and
    the one it applies by default: {"prompts": {name: text}, "default": name or None}; None
    where the folder names none."""
    if job.source.path is None or not (job.source.path / "config_sentence_transformers.json").is_file():
        return None
    try:
        config = json.loads((job.source.path / "config_sentence_transformers.json").read_text())
        prompts = {str(name): str(text) for name, text in (config.get("prompts") or {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    default = config.get("default_prompt_name")
    if not prompts:
        return None
    return {"prompts": prompts, "default": default if default in prompts else None}


def _copy_tokenizer(job: Job, folder: Path) -> str | None:
    """The model's tokenizer files, and a tokenizer.json (what the ``tokenizers`` package reads)
    made with transformers when the model ships only the slow tokenizer's files."""
    if not models.has_tokenizer(job.source):
        return None
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (job.source.path / name).is_file():
            shutil.copyfile(job.source.path / name, folder / name)
    if not (folder / "tokenizer.json").is_file():
        tokenizer = models.tokenizer_of(job.source)
        if not getattr(tokenizer, "is_fast", False):
            job.say(f"export: {job.source.name}'s tokenizer has no fast form: the package takes token ids, not text")
            return None
        tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    return "tokenizer/tokenizer.json"


def _time_buckets(folder: Path, manifest: dict) -> None:
    """Each bucket's median latency, loaded as a user loads it: the cost the planner weighs. A
    fleet package's builds this CPU cannot run take the costs of one it ran (the planner compares
    buckets within a build: their ratios carry)."""
    timed: dict[tuple, float] = {}
    for variant in variants_of(manifest):
        if missing_for(variant):
            continue
        model = load(folder, warn=lambda message: None, variant=variant["target_key"])
        for index, bucket in enumerate(variant["buckets"]):
            feeds = {spec["name"]: np.full((bucket["batch"], bucket["seq_len"]), 1 if spec["name"] == MASK_INPUT else 0, np.int64)
                     for spec in manifest["inputs"]}
            lengths = packing.fitting_lengths(bucket["batch"], bucket["seq_len"],
                                              bucket.get("tokens") or bucket["batch"] * bucket["seq_len"])
            model._run_bucket(index, feeds, lengths)
            timings = []
            for _ in range(TIMED_RUNS):
                started = time.perf_counter()
                model._run_bucket(index, feeds, lengths)
                timings.append(time.perf_counter() - started)
            bucket["cost_ms"] = round(float(np.median(timings)) * 1000, 4)
            timed.setdefault((bucket["batch"], bucket["seq_len"], bucket.get("tokens")), bucket["cost_ms"])
    for variant in variants_of(manifest):
        for bucket in variant["buckets"]:
            shape = (bucket["batch"], bucket["seq_len"], bucket.get("tokens"))
            if "cost_ms" not in bucket and shape in timed:
                bucket["cost_ms"] = timed[shape]
    write_manifest(folder, manifest)


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("tvmbert")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

"""The commands: each parses its options, calls its stage's Python API, and hands the result to
``render``. No logic of their own."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import warnings
from pathlib import Path

import click

from tvmbert.cli import render
from tvmbert.cli.render import err
from tvmbert.core import config as config_module
from tvmbert.core.config import JobConfig
from tvmbert.core.errors import CheckFailed, InputError
from tvmbert.core.families import TASKS
from tvmbert.core.registry import ENGINES as ENGINE_NAMES
from tvmbert.deploy.sentences import MODES as POOLING_MODES
from tvmbert.deploy.sentences import PRECISIONS

INVOCATION: list[str] = []  # the command line, as the user typed it, for reports


def _common(func):
    """Options every stage shares: what model, which shape and dtype, for which target, where."""
    options = [
        click.argument("model", required=False),
        click.option("--task", help=f"The head to compile: {', '.join(TASKS)} (default: the one config.json's "
                     "architectures names)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML job config; flags override it."),
        click.option("--batch", help="Batch size of the example inputs (bench, export: a list, e.g. 1,8)."),
        click.option("--seq-len", help="Sequence length (default: the text's length, or 14; bench, export: a list)."),
        click.option("--tokens", type=int, help="A packed build of this many tokens: the batch's real tokens run as one "
                     "stream, attention per sequence (no work on padding)."),
        click.option("--text", help="Example text, for models with a tokenizer."),
        click.option("--dtype", help="float32 (default), float64, float16, bfloat16 or int8 (docs/precision.md)."),
        click.option("--seed", type=int, help="Seed of a preset's random weights."),
        click.option("--allow-random-weights", is_flag=True, default=None, help="Compile a directory that lacks some weights "
                     "(a head saved without its classifier) with those drawn from --seed, for experiments; every report says so."),
        click.option("--fast-math", is_flag=True, default=None, help="Allow approximations (tanh GELU, fast exp/erf)."),
        click.option("--no-cuda-graph", is_flag=True, default=None, help="A CUDA build launches each kernel on each call "
                     "instead of replaying them in a CUDA graph captured at the first."),
        click.option("--disable", multiple=True, help="Leave a pass out of the pipeline, one the dtype or target adds "
                     "included (repeatable; names: tvmbert optimize --json)."),
        click.option("--target", help="llvm, cuda, rocm, 'cuda -arch=sm_90', or a TVM JSON target."),
        click.option("--workdir", help="Where artifacts go (default: build)."),
        click.option("--log-dir", help="Your tuning databases: tune writes here, lookups read here before the shipped "
                     "records (default: $TVMBERT_LOG_DIR, else ~/.local/share/tvmbert/tuning_logs or the platform's like)."),
        click.option("--no-deps", is_flag=True, help="Never run an earlier stage; its artifact must exist."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _numbers(text: str | None, option: str, kind=int, many: bool = False) -> tuple:
    """'1,8' -> (1, 8); one value unless ``many``."""
    if text is None:
        return ()
    try:
        values = tuple(kind(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise InputError(f"{option} must be {'a list of numbers' if many else 'a number'}, got '{text}'") from None
    if not values or (len(values) > 1 and not many):
        raise InputError(f"{option} takes {'one or more numbers' if many else 'one number'}, got '{text}'")
    return values


def _job(params: dict, overrides: dict | None = None, sweep: bool = False):
    """A Job from the config file (if any), overridden by the flags given."""
    from tvmbert.stages.job import Job

    batches = _numbers(params["batch"], "--batch", many=sweep)
    seq_lens = _numbers(params["seq_len"], "--seq-len", many=sweep)
    params["batch"] = batches[0] if batches else None
    params["seq_len"] = seq_lens[0] if seq_lens else None

    base = config_module.load(params.pop("config_path")) if params.get("config_path") else JobConfig()
    params.pop("config_path", None)
    model = params.pop("model")
    flags = {
        "model": model,
        **{k: params.pop(k) for k in ("task", "batch", "seq_len", "tokens", "text", "dtype", "fast_math", "seed", "allow_random_weights", "target", "workdir",
                                      "log_dir")},
        "disable": tuple(params.pop("disable")) or None,
        "cuda_graph": False if params.pop("no_cuda_graph") else None,
        **(overrides or {}),
    }
    job = Job(base.with_overrides(**flags), no_deps=params.pop("no_deps"))
    return job


def _emit(as_json: bool, result: dict, human) -> None:
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        human(result)


def _quiet_warnings(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return func(*args, **kwargs)

    return wrapper


@click.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def trace(as_json, force, **params):
    """torch.export the model with its example inputs."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.trace import trace as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), render.artifact("trace"))


@click.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def convert(as_json, force, **params):
    """Import the exported program into TVM Relax (IR saved as TVMScript)."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.convert import convert as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), render.artifact("convert"))


@click.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@click.option("--passes", help="Comma-separated pass pipeline (default: the config's, or all).")
@click.option("--viz", is_flag=True, help="Draw encoder layer 0 before and after the passes (SVG; DOT without Graphviz).")
@_quiet_warnings
def optimize(as_json, force, passes, viz, **params):
    """Run the graph-pass pipeline; report op counts before and after."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.optimize import optimize as run
    from tvmbert.stages.optimize import pictures

    overrides = {"passes": tuple(p.strip() for p in passes.split(",") if p.strip())} if passes else None
    job = _job(params, overrides)
    artifact = run(job, force=force)
    result = artifact_summary(artifact)
    if viz:
        result["pictures"] = pictures(job, artifact)
        if result["pictures"][0].endswith(".dot"):
            err.print("viz: Graphviz's `dot` is not installed (Debian: apt install graphviz), so these are DOT files; "
                      "render one with: dot -Tsvg FILE.dot -o FILE.svg")
        err.print(f"viz: {', '.join(result['pictures'])}")
    _emit(as_json, result, render.ops)


@click.command()
@_common
@click.option("--trials", type=int, help="Total measurement trials for this run.")
@click.option("--trials-per-task", type=int, help="At most this many trials per task.")
@click.option("--rpc-tracker", help="HOST:PORT of a TVM RPC tracker to measure on.")
@click.option("--rpc-key", help="Device key registered with the tracker.")
@click.option("--retune", is_flag=True, help="Spend trials on tasks that are already tuned too, searching on from their records.")
@click.option("--fresh", is_flag=True, help="With --retune: start those tasks' search over; their old records stop counting.")
@click.option("--train", is_flag=True, help="Tune the forward and backward kernels of encoder layer 0 (add_tvm_dispatch).")
@click.option("--kernel", "only", multiple=True, help="Only the kernels (tuning tasks) whose names match this regular expression (repeatable).")
@click.option("--adapt", is_flag=True, help="Measure other CPUs' records on this CPU and keep them as its own, then search "
              "where the time is (--trials, default 320): minutes, on a CPU without logs of its own.")
@_quiet_warnings
def tune(as_json, trials, trials_per_task, rpc_tracker, rpc_key, retune, fresh, train, only, adapt, **params):
    """Tune the model's kernels with MetaSchedule into the target's database."""
    from tvmbert.stages.tune import adapt as run_adapt
    from tvmbert.stages.tune import tune as run

    if adapt and (retune or fresh or train or only or trials_per_task):
        raise InputError("--adapt takes none of --retune, --fresh, --train, --kernel, --trials-per-task")
    overrides = {"tune.trials": trials, "tune.trials_per_task": trials_per_task, "tune.rpc_tracker": rpc_tracker, "tune.rpc_key": rpc_key}
    job = _job(params, overrides)
    result = (run_adapt(job) if adapt else run(job, retune=retune, train=train, only=only, fresh=fresh)).to_json()
    _emit(as_json, result, render.tune)


@click.command()
@click.option("--log-dir", help="The tuning databases to compact (default: yours, as tune's; the shipped ones: tvmbert/tuning_logs).")
@click.option("--top-k", type=click.IntRange(1, 1000), default=8, show_default=True, help="Records kept per workload.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def compact(log_dir, top_k, as_json):
    """Write each database's shipped file (records.jsonl.gz): the best records per workload."""
    from tvmbert.tuning import database

    root = Path(log_dir) if log_dir else config_module.user_log_dir()
    if not root.is_dir():
        raise InputError(f"--log-dir {root} is not a folder")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    results = []
    for folder in folders:
        with database.locked(folder, say=lambda message: err.print(message)):
            results.append(database.compact(folder, top_k, warn=lambda message: err.print(f"warning: {message}", markup=False)))
    _emit(as_json, {"databases": results}, render.compact)


@click.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def build(as_json, force, **params):
    """Compile for the target with the tuning database applied."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.build import build as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), render.build)


@click.command()
@_common
@click.option("--samples", type=int, help="Inputs compared (the example, then padded random ones).")
@click.option("--tolerance", type=float, help="Max abs diff allowed (default 1e-4 fp32, 1e-10 fp64).")
@click.option("--texts", type=int, help="Real English sentences compared too, through the model's tokenizer "
              "(default 500 for a model with one, 0 skips); their accuracy metrics are gated.")
@click.option("--train", is_flag=True, help="Check encoder layer 0 in training through add_tvm_dispatch: "
              "forward, every gradient and one optimizer step, dropout on.")
@_quiet_warnings
def verify(as_json, samples, tolerance, texts, train, **params):
    """Compare every output with PyTorch, and what each head's users compare (embeddings' cosine
    and similarity ranking, labels, tags, answer spans); exit 1 when over a bar."""
    from tvmbert.stages.verify import check, check_training, verify_training
    from tvmbert.stages.verify import verify as run

    if train:
        result = verify_training(_job(params))
        _emit(as_json, result.to_json(), render.verify_training)
        check_training(result)
        return
    result = run(_job(params, {"verify.samples": samples, "verify.tolerance": tolerance, "verify.texts": texts}))
    _emit(as_json, result.to_json(), render.verify)
    check(result)


@click.command()
@_common
@click.option("--padding", help="Fraction of each sequence that is padding (a list sweeps), e.g. 0,0.5.")
@click.option("--engines", help=f"Comma-separated engines (default: all of {', '.join(ENGINE_NAMES)}; on a GPU target the "
              f"GPU peers: {', '.join(n for n, e in ENGINE_NAMES.items() if e.on_gpu and not n.startswith('tvm'))}).")
@click.option("--warmup", type=int, help="Untimed runs per engine first.")
@click.option("--repeat", type=int, help="At least this many timed runs per engine.")
@click.option("--min-time", type=float, help="And at least this many seconds per engine.")
@click.option("--threads", type=int, help="Threads for every engine (default: all cores).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Also write the results as CSV.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Also plot latency vs sequence length (PNG).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Also write a Markdown table (docs).")
@click.option("--train", is_flag=True, help="Time encoder layer 0 forward + backward (add_tvm_dispatch) against PyTorch.")
@click.option("--lengths", help="A variable-length workload: A-B (uniform token counts) or a file of texts; the exported "
              "package (buckets: --seq-len) against engines of any shape.")
@click.option("--requests", type=int, help="With --lengths: requests of --batch sequences (default 100, or the file's texts).")
@click.option("--packed", is_flag=True, help="Also time tvm-packed: the packed build of the same rows (their real tokens only).")
@_quiet_warnings
def bench(as_json, padding, engines, warmup, repeat, min_time, threads, csv_path, plot_path, markdown_path, train, lengths,
          requests, packed, **params):
    """Time TVM against PyTorch and ONNX Runtime on the same inputs, interleaved; sweeps shapes."""
    if lengths is not None:
        from tvmbert.stages.bench.lengths import bench_lengths

        if train or padding or csv_path or plot_path or markdown_path or packed:
            raise InputError("--lengths takes none of --train, --padding, --csv, --plot, --markdown, --packed")
        if requests is not None and requests < 1:
            raise InputError(f"--requests must be >= 1, got {requests}")
        seq_lens = _numbers(params["seq_len"], "--seq-len", many=True)
        _numbers(params["batch"], "--batch")
        names = tuple(e.strip() for e in engines.split(",") if e.strip()) if engines else None
        overrides = {"bench.engines": names, "bench.warmup": warmup, "bench.threads": threads}
        _emit(as_json, bench_lengths(_job(params, overrides, sweep=True), lengths, requests or 0, seq_lens), render.bench_lengths)
        return
    from tvmbert.core.artifacts import check_output_file, write_bytes, write_text
    from tvmbert.stages.bench import bench as run
    from tvmbert.stages.bench import bench_training, plot, to_csv, to_markdown

    for path, option in ((csv_path, "--csv"), (plot_path, "--plot"), (markdown_path, "--markdown")):
        if path:
            check_output_file(Path(path), option)
    if train:
        overrides = {"bench.warmup": warmup, "bench.repeat": repeat, "bench.min_time_s": min_time, "bench.threads": threads}
        _emit(as_json, bench_training(_job(params, overrides)), render.bench_training)
        return
    batches = _numbers(params["batch"], "--batch", many=True)
    seq_lens = _numbers(params["seq_len"], "--seq-len", many=True)
    paddings = _numbers(padding, "--padding", kind=float, many=True) or (0.0,)
    names = tuple(e.strip() for e in engines.split(",") if e.strip()) if engines else None
    overrides = {"bench.engines": names, "bench.warmup": warmup, "bench.repeat": repeat, "bench.min_time_s": min_time, "bench.threads": threads}
    report = run(_job(params, overrides, sweep=True), batches, seq_lens, paddings, packed)
    if csv_path:
        write_text(Path(csv_path), to_csv(report))
    if plot_path:
        write_bytes(Path(plot_path), plot(report))
    if markdown_path:
        write_text(Path(markdown_path), to_markdown(report, "tvmbert " + " ".join(INVOCATION)))
    _emit(as_json, report, render.bench)


@click.command()
@_common
@click.option("-o", "--output", "out_dir", type=click.Path(), help="The package folder (replaced whole if it is one).")
@click.option("--packed", is_flag=True, default=None, help="Also packed buckets for batches > 1: a batch of mixed lengths runs "
              "its real tokens only.")
@click.option("--cpus", help="A build per CPU in one package, the loader running the fastest one its machine can: "
              "native (the target) and LLVM CPU names or keys, e.g. native,x86-64-v3.")
@_quiet_warnings
def export(as_json, out_dir, packed, cpus, **params):
    """Build every (batch, seq-len) bucket and write one package that tvmbert.load serves."""
    from tvmbert.stages.export import export as run

    batches = _numbers(params["batch"], "--batch", many=True)
    seq_lens = _numbers(params["seq_len"], "--seq-len", many=True)
    cpu_list = tuple(c.strip() for c in cpus.split(",") if c.strip()) if cpus is not None else None
    job = _job(params, {"export.out_dir": out_dir, "export.packed": packed, "export.cpus": cpu_list}, sweep=True)
    manifest = run(job, out_dir, batches, seq_lens)
    _emit(as_json, manifest, render.export)


@click.command("run")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.option("--model", help="Override the config's model.")
@click.option("--target", help="Override the config's target.")
@click.option("--workdir", help="Where artifacts go.")
@click.option("--log-dir", help="Your tuning databases (as the stages' --log-dir).")
@click.option("--force", is_flag=True, help="Redo every listed stage even when cached.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@_quiet_warnings
def run_config(config_path, model, target, workdir, log_dir, force, as_json):
    """Run the stages a YAML config lists, in order."""
    from tvmbert.stages.job import Job
    from tvmbert.stages.run import run

    config = config_module.load(config_path).with_overrides(model=model, target=target, workdir=workdir, log_dir=log_dir)
    results = run(Job(config), force=force)
    _emit(as_json, results, render.run)
    if results.get("verify", {}).get("passed") is False:
        from tvmbert.stages.verify import failure

        raise CheckFailed(failure(results["verify"]))


@click.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: one the OS picks (printed).")
@click.option("--max-batch-tokens", type=click.IntRange(1), default=16384, show_default=True,
              help="Concurrent requests merged into one run up to this many tokens, counted as rows x the longest (TEI's rule).")
@click.option("--max-wait-ms", type=click.FloatRange(0), default=0.0, show_default=True,
              help="How long a request may wait for others to join its batch (0: never delayed).")
@click.option("--max-concurrent-requests", type=click.IntRange(1), default=512, show_default=True,
              help="Requests in flight at once; beyond, 429.")
@click.option("--max-inputs-per-request", type=click.IntRange(1), default=256, show_default=True,
              help="Texts in one request; beyond, 413.")
@click.option("--pooling", type=click.Choice(POOLING_MODES), help="How token vectors become one (default: the model's "
              "sentence-transformers config, recorded at export, else mean_tokens).")
@click.option("--served-model-name", help="The model name /v1/embeddings answers with (default: the package folder's name).")
@click.option("--ray", "on_ray", is_flag=True, help="Serve from Ray Serve replicas behind Ray's proxy (the ray extra).")
@click.option("--replicas", type=click.IntRange(1), default=2, show_default=True, help="With --ray: how many.")
@click.option("--replica-cpus", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="With --ray: Ray CPUs each replica takes, and as many TVM threads.")
@click.option("--ray-address", help="With --ray: a running cluster's address (default: RAY_ADDRESS, else a local one).")
@click.option("--max-body-bytes", type=click.IntRange(1), default=2 * 2**20, show_default=True,
              help="A request's body; beyond, 413 before it is parsed.")
@click.option("--api-key", envvar="TVMBERT_API_KEY", show_envvar=True,
              help="Every route but /health wants 'Authorization: Bearer KEY' (401 otherwise). Prefer the variable or "
                   "--api-key-file: a command line is visible to the machine's other users.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="The key, read from this file (its first line).")
def serve(package, host, port, max_batch_tokens, max_wait_ms, max_concurrent_requests, max_inputs_per_request, pooling,
          served_model_name, on_ray, replicas, replica_cpus, ray_address, max_body_bytes, api_key, api_key_file):
    """Serve an exported package over HTTP: OpenAI's /v1/embeddings, TEI's /embed, /predict and
    /rerank, /classify_tokens, /answer, /health, /info, /metrics, /docs (docs/serving.md). SIGTERM
    answers what is in flight, then exits 0."""
    from tvmbert.serve.run import exposure_warning
    from tvmbert.serve.service import Limits

    api_key = _api_key(api_key, api_key_file)
    limits = Limits(max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms, max_concurrent_requests=max_concurrent_requests,
                    max_inputs_per_request=max_inputs_per_request, max_body_bytes=max_body_bytes)
    warning = exposure_warning(host, api_key)
    if warning:
        err.print(warning, markup=False)
    if on_ray:
        try:
            from tvmbert.serve.replicas import serve_on_ray
        except ImportError as exc:
            raise InputError(f"--ray needs Ray Serve ({exc}): pip install 'tvmbert[ray]'") from None
        serve_on_ray(package, host, port, limits, pooling, served_model_name, replicas, replica_cpus, ray_address,
                     ready=lambda bound_host, bound_port: err.print(
                         f"serve: {package} on http://{bound_host}:{bound_port} ({replicas} Ray Serve replicas)", markup=False),
                     api_key=api_key)
        return
    from tvmbert.serve.run import serve as run

    run(package, host, port, limits, pooling, served_model_name,
        ready=lambda bound_host, bound_port: err.print(f"serve: {package} on http://{bound_host}:{bound_port}"
                                                      + (" (API key required)" if api_key else ""), markup=False),
        api_key=api_key)


def _api_key(given: str | None, file: str | None) -> str | None:
    """The server's key, from --api-key (or TVMBERT_API_KEY) or a file; never printed."""
    if given is not None and file is not None:
        raise InputError("--api-key (or TVMBERT_API_KEY) and --api-key-file are one or the other")
    if file is not None:
        try:
            lines = Path(file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--api-key-file {file}: cannot be read ({exc.__class__.__name__})") from None
        given = lines[0] if lines else ""
    if given is None and os.environ.get("TVMBERT_API_KEY") == "":  # click reads an empty variable as unset
        raise InputError("TVMBERT_API_KEY is set but empty: set the key, or unset the variable to serve without one")
    if given is None:
        return None
    key = given.strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise InputError("the API key must be printable, without spaces, and not empty")
    return key


@click.command()
@click.argument("package", type=click.Path(file_okay=False))
@click.argument("source", metavar="INPUT", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(),
              help="OUT.parquet: one file (the shards merged at the end); any other name: a folder of Parquet shards.")
@click.option("--text-field", default="text", show_default=True, help="The text's key in JSONL, column in CSV/TSV and Parquet.")
@click.option("--id-field", help="Each row's id, kept beside its vector (default: none; the row's number is always kept as 'row').")
@click.option("--precision", type=click.Choice(PRECISIONS), default="float32", show_default=True,
              help="As sentence-transformers' quantize_embeddings: int8/uint8 calibrated on the first shard, binary packed 8 a byte.")
@click.option("--dimensions", type=click.IntRange(1), help="The first N dimensions (a Matryoshka model), unit length again "
              "where the model normalizes.")
@click.option("--prompt", help="Put before every text (sentence-transformers' encode(prompt=...)).")
@click.option("--prompt-name", help="One of the package's config_sentence_transformers.json prompts (default: its default_prompt_name).")
@click.option("--pooling", type=click.Choice(POOLING_MODES), help="Default: the package's sentence-transformers config, else mean_tokens.")
@click.option("--normalize/--no-normalize", default=None, help="Unit-length vectors (default: as the package's config says).")
@click.option("--shard-rows", type=click.IntRange(1), default=4096, show_default=True,
              help="Rows a shard: the most a resumed run redoes, and the window texts are sorted by length in.")
@click.option("--max-batch-tokens", type=click.IntRange(1), default=16384, show_default=True,
              help="Rows x the longest in one call of the package.")
@click.option("--no-truncate", is_flag=True, help="A text over the package's longest input is a bad row (default: cut to it, "
              "as sentence-transformers cuts, and counted).")
@click.option("--skip-bad", is_flag=True, help="Count bad rows (missing field, not UTF-8, empty) and list them in OUT.bad.jsonl "
              "instead of stopping at the first.")
@click.option("--overwrite", is_flag=True, help="Start again where OUT holds a finished or another job's output.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run the shards on Ray Data actors: a cluster's address, or alone for a local cluster (the ray extra).")
@click.option("--actors", type=click.IntRange(1), default=2, show_default=True, help="With --ray: actors, each loading the package once.")
@click.option("--actor-cpus", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="With --ray: Ray CPUs each actor takes, and as many TVM threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout.")
@_quiet_warnings
def embed(package, source, output, text_field, id_field, precision, dimensions, prompt, prompt_name, pooling, normalize, shard_rows,
          max_batch_tokens, no_truncate, skip_bad, overwrite, ray_address, actors, actor_cpus, as_json):
    """Embed a corpus (JSONL, CSV/TSV, Parquet, text lines, or a folder of them) into Parquet with
    an exported package: resumable after Ctrl-C, SIGTERM or kill -9, the same on a Ray cluster
    (docs/embed.md)."""
    from tvmbert.embed.corpus import Fields
    from tvmbert.embed.pipeline import Options

    options = Options(Fields(text_field, id_field), precision, dimensions, prompt, prompt_name, pooling, normalize, shard_rows,
                      max_batch_tokens, not no_truncate, skip_bad, overwrite)
    with render.EmbedProgress(source) as progress, _terminated_as_interrupt():
        if ray_address is not None:
            try:
                from tvmbert.embed.on_ray import embed_on_ray
            except ImportError as exc:
                raise InputError(f"--ray needs Ray Data ({exc}): pip install 'tvmbert[ray]'") from None
            summary = embed_on_ray(package, source, output, options, None if ray_address == "local" else ray_address, actors,
                                   actor_cpus, progress)
        else:
            from tvmbert.embed.pipeline import embed_corpus

            summary = embed_corpus(package, source, output, options, progress)
    _emit(as_json, summary, render.embed)


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM stops the command as Ctrl-C does (what it finished is kept, exit 130), instead of
    killing it mid-write."""
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# In the order `tvmbert --help` lists them.
COMMANDS = (trace, convert, optimize, tune, compact, build, verify, bench, export, run_config, serve, embed)

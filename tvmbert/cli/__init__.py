"""The `tvmbert` command: parses options, calls the stage functions, prints. No logic of its own."""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from tvmbert.core import config as config_module
from tvmbert.core.config import JobConfig
from tvmbert.core.errors import CheckFailed, InputError, TvmbertError
from tvmbert.core.registry import ENGINES as ENGINE_NAMES

err = Console(stderr=True, highlight=False, soft_wrap=True)


def _common(func):
    """Options every stage shares: what model, which shape and dtype, for which target, where."""
    options = [
        click.argument("model", required=False),
        click.option("--task", help="The head to compile: feature-extraction, text-classification, token-classification, "
                     "question-answering, fill-mask (default: the one config.json's architectures names)."),
        click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML job config; flags override it."),
        click.option("--batch", help="Batch size of the example inputs (bench, export: a list, e.g. 1,8)."),
        click.option("--seq-len", help="Sequence length (default: the text's length, or 14; bench, export: a list)."),
        click.option("--tokens", type=int, help="A packed build of this many tokens: the batch's real tokens run as one "
                     "stream, attention per sequence (no work on padding)."),
        click.option("--text", help="Example text, for models with a tokenizer."),
        click.option("--dtype", help="float32 (default), float64, float16 or bfloat16 (README: Precision)."),
        click.option("--seed", type=int, help="Seed of a preset's random weights."),
        click.option("--fast-math", is_flag=True, default=None, help="Allow approximations (tanh GELU, fast exp/erf)."),
        click.option("--target", help="llvm, cuda, rocm, 'cuda -arch=sm_90', or a TVM JSON target."),
        click.option("--workdir", help="Where artifacts go (default: build)."),
        click.option("--log-dir", help="Where tuning databases live (default: tuning_logs)."),
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
        **{k: params.pop(k) for k in ("task", "batch", "seq_len", "tokens", "text", "dtype", "fast_math", "seed", "target", "workdir",
                                      "log_dir")},
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tvmbert")
def cli():
    """Compile and tune HuggingFace BERT encoders with Apache TVM."""


@cli.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def trace(as_json, force, **params):
    """torch.export the model with its example inputs."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.trace import trace as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), _print_artifact("trace"))


@cli.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def convert(as_json, force, **params):
    """Import the exported program into TVM Relax (IR saved as TVMScript)."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.convert import convert as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), _print_artifact("convert"))


@cli.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@click.option("--passes", help="Comma-separated pass pipeline (default: the config's, or all).")
@click.option("--disable", multiple=True, help="Leave out a pass by name (repeatable).")
@click.option("--viz", is_flag=True, help="Draw encoder layer 0 before and after the passes (SVG; DOT without Graphviz).")
@_quiet_warnings
def optimize(as_json, force, passes, disable, viz, **params):
    """Run the graph-pass pipeline; report op counts before and after."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.optimize import optimize as run
    from tvmbert.stages.optimize import pictures

    overrides = {"passes": tuple(p.strip() for p in passes.split(",") if p.strip())} if passes else None
    job = _job(params, overrides)
    artifact = run(job, force=force, disable=tuple(disable))
    result = artifact_summary(artifact)
    if viz:
        result["pictures"] = pictures(job, artifact)
        if result["pictures"][0].endswith(".dot"):
            err.print("viz: Graphviz's `dot` is not installed (Debian: apt install graphviz), so these are DOT files; "
                      "render one with: dot -Tsvg FILE.dot -o FILE.svg")
        err.print(f"viz: {', '.join(result['pictures'])}")
    _emit(as_json, result, _print_ops)


@cli.command()
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
    _emit(as_json, result, _print_tune)


@cli.command()
@click.option("--log-dir", default="tuning_logs", show_default=True, help="Where tuning databases live.")
@click.option("--top-k", type=click.IntRange(1, 1000), default=8, show_default=True, help="Records kept per workload.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def compact(log_dir, top_k, as_json):
    """Write each database's shipped file (records.jsonl.gz): the best records per workload."""
    from tvmbert.tuning import database

    root = Path(log_dir)
    if not root.is_dir():
        raise InputError(f"--log-dir {root} is not a folder")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    results = []
    for folder in folders:
        with database.locked(folder, say=lambda message: err.print(message)):
            results.append(database.compact(folder, top_k, warn=lambda message: err.print(f"warning: {message}", markup=False)))
    _emit(as_json, {"databases": results}, _print_compact)


@cli.command()
@_common
@click.option("--force", is_flag=True, help="Redo the stage even when its inputs are unchanged.")
@_quiet_warnings
def build(as_json, force, **params):
    """Compile for the target with the tuning database applied."""
    from tvmbert.core.artifacts import artifact_summary
    from tvmbert.stages.build import build as run

    _emit(as_json, artifact_summary(run(_job(params), force=force)), _print_build)


@cli.command()
@_common
@click.option("--samples", type=int, help="Inputs compared (the example, then padded random ones).")
@click.option("--tolerance", type=float, help="Max abs diff allowed (default 1e-4 fp32, 1e-10 fp64).")
@click.option("--train", is_flag=True, help="Check encoder layer 0 in training through add_tvm_dispatch: "
              "forward, every gradient and one optimizer step, dropout on.")
@_quiet_warnings
def verify(as_json, samples, tolerance, train, **params):
    """Compare every output with PyTorch; exit 1 when over tolerance."""
    from tvmbert.stages.verify import check, check_training, verify_training
    from tvmbert.stages.verify import verify as run

    if train:
        result = verify_training(_job(params))
        _emit(as_json, result.to_json(), _print_verify_training)
        check_training(result)
        return
    result = run(_job(params, {"verify.samples": samples, "verify.tolerance": tolerance}))
    _emit(as_json, result.to_json(), _print_verify)
    check(result)


@cli.command()
@_common
@click.option("--padding", help="Fraction of each sequence that is padding (a list sweeps), e.g. 0,0.5.")
@click.option("--engines", help=f"Comma-separated engines (default: all of {', '.join(ENGINE_NAMES)}).")
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
        _emit(as_json, bench_lengths(_job(params, overrides, sweep=True), lengths, requests or 0, seq_lens), _print_bench_lengths)
        return
    from tvmbert.core.artifacts import check_output_file, write_bytes, write_text
    from tvmbert.stages.bench import bench as run
    from tvmbert.stages.bench import bench_training, plot, to_csv, to_markdown

    for path, option in ((csv_path, "--csv"), (plot_path, "--plot"), (markdown_path, "--markdown")):
        if path:
            check_output_file(Path(path), option)
    if train:
        overrides = {"bench.warmup": warmup, "bench.repeat": repeat, "bench.min_time_s": min_time, "bench.threads": threads}
        _emit(as_json, bench_training(_job(params, overrides)), _print_bench_training)
        return
    batches = _numbers(params["batch"], "--batch", many=True)
    seq_lens = _numbers(params["seq_len"], "--seq-len", many=True)
    paddings = _numbers(padding, "--padding", kind=float, many=True) or (0.0,)
    names = tuple(e.strip() for e in engines.split(",") if e.strip()) if engines else None
    if packed:
        from tvmbert.stages.bench.engines import DEFAULT_ENGINES

        names = (*(names or DEFAULT_ENGINES), *(() if names and "tvm-packed" in names else ("tvm-packed",)))
    overrides = {"bench.engines": names, "bench.warmup": warmup, "bench.repeat": repeat, "bench.min_time_s": min_time, "bench.threads": threads}
    report = run(_job(params, overrides, sweep=True), batches, seq_lens, paddings)
    if csv_path:
        write_text(Path(csv_path), to_csv(report))
    if plot_path:
        write_bytes(Path(plot_path), plot(report))
    if markdown_path:
        write_text(Path(markdown_path), to_markdown(report, "tvmbert " + " ".join(_invocation)))
    _emit(as_json, report, _print_bench)


@cli.command()
@_common
@click.option("-o", "--output", "out_dir", type=click.Path(), help="The package folder (replaced whole if it is one).")
@click.option("--packed", is_flag=True, default=None, help="Also packed buckets for batches > 1: a batch of mixed lengths runs "
              "its real tokens only.")
@_quiet_warnings
def export(as_json, out_dir, packed, **params):
    """Build every (batch, seq-len) bucket and write one package that tvmbert.load serves."""
    from tvmbert.stages.export import export as run

    batches = _numbers(params["batch"], "--batch", many=True)
    seq_lens = _numbers(params["seq_len"], "--seq-len", many=True)
    manifest = run(_job(params, {"export.out_dir": out_dir, "export.packed": packed}, sweep=True), out_dir, batches, seq_lens)
    _emit(as_json, manifest, _print_export)


@cli.command("run")
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.option("--model", help="Override the config's model.")
@click.option("--target", help="Override the config's target.")
@click.option("--workdir", help="Where artifacts go.")
@click.option("--log-dir", help="Where tuning databases live.")
@click.option("--force", is_flag=True, help="Redo every listed stage even when cached.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@_quiet_warnings
def run_config(config_path, model, target, workdir, log_dir, force, as_json):
    """Run the stages a YAML config lists, in order."""
    from tvmbert.stages.job import Job
    from tvmbert.stages.run import run

    config = config_module.load(config_path).with_overrides(model=model, target=target, workdir=workdir, log_dir=log_dir)
    results = run(Job(config), force=force)
    _emit(as_json, results, _print_run)
    if results.get("verify", {}).get("passed") is False:
        raise CheckFailed(f"verify failed: max abs diff {results['verify']['max_abs_diff']:.3g} > {results['verify']['tolerance']:.3g}")


# ---- human output -------------------------------------------------------------------------

out = Console(highlight=False)


def _print_artifact(stage):
    def show(result):
        out.print(f"{stage}: {'cached' if result['cached'] else 'done'} -> {result['artifact']}")

    return show


def _print_tune(result):
    out.print(f"tune: {result['new_trials']} new trials in {result['seconds']} s"
              + (f" ({result['trials_per_minute']} trials/min)" if result["trials_per_minute"] else "")
              + f" into {result['database']}")
    tuned = [t for t in result["tasks"] if t["best_us"] is not None]
    out.print(f"tuned tasks: {len(tuned)}/{len(result['tasks'])}, {len(result['skipped_trivial'])} trivial tasks skipped"
              + (f", est. end-to-end {result['estimated_e2e_ms']} ms" if result["estimated_e2e_ms"] else ""))


def _print_compact(result):
    for db in result["databases"]:
        out.print(f"compact: {db['database']}: {db['records']} of {db['records_before']} records kept "
                  f"({db['workloads']} workloads), {db['bytes'] / 1e6:.2f} MB")


def _print_ops(result):
    table = Table(title=f"op counts ({' -> '.join(result['passes'])})")
    table.add_column("op")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for op in sorted(set(result["ops_before"]) | set(result["ops_after"])):
        table.add_row(op, str(result["ops_before"].get(op, "")), str(result["ops_after"].get(op, "")))
    out.print(table)


def _print_build(result):
    from tvmbert.tuning.compile import summary

    out.print(f"build: {'cached' if result['cached'] else 'done'} -> {result['artifact']}")
    out.print(f"{summary(result['schedules'])}, looked up in {', '.join(result['databases_read'])}")
    if result["untuned"]:
        out.print(f"untuned (default schedules): {', '.join(result['untuned'])}")


def _print_verify(result):
    table = Table(title=f"verify against PyTorch ({result['dtype']}, {result['samples']} inputs, {result['target']})")
    for column in ("output", "shape", "max abs diff", "max rel diff"):
        table.add_column(column)
    for o in result["outputs"]:
        table.add_row(o["name"], "x".join(map(str, o["shape"])), f"{o['max_abs_diff']:.3g}", f"{o['max_rel_diff']:.3g}")
    out.print(table)
    verdict = "[green]PASSED[/green]" if result["passed"] else "[red]FAILED[/red]"
    out.print(f"verify: {verdict} max abs diff {result['max_abs_diff']:.3g} (tolerance {result['tolerance']:.3g})")


def _print_verify_training(result):
    table = Table(title=f"verify --train: {result['layer']} {'x'.join(map(str, result['shape']))}, {result['dtype']}, "
                        f"dropout on, against PyTorch ({result['target']}, {result['tasks_tuned']}/{result['tasks_total']} tasks tuned)")
    table.add_column("tensor")
    table.add_column("max abs diff", justify="right")
    table.add_column("tolerance", justify="right")
    table.add_row("forward output", f"{result['forward_max_abs_diff']:.3g}", f"{result['forward_tolerance']:.3g}")
    for name, diff in result["grads"].items():
        table.add_row(f"grad {name}", f"{diff:.3g}", f"{result['grad_tolerance']:.3g}")
    table.add_row("parameters after one SGD step", f"{result['step_max_abs_diff']:.3g}", f"{result['grad_tolerance']:.3g}")
    out.print(table)
    fallback = result["fallback"]
    out.print(f"fallback: a {'x'.join(map(str, fallback['shape']))} call ran in "
              f"{'PyTorch' if fallback['ran_in_pytorch'] else 'TVM'} (max abs diff {fallback['max_abs_diff']:.3g})")
    saved = result["saved_bytes"]
    out.print(f"saved for backward: tvm {saved['tvm'] / 1024:,.1f} KiB, torch {saved['torch'] / 1024:,.1f} KiB")
    verdict = "[green]PASSED[/green]" if result["passed"] else "[red]FAILED[/red]"
    out.print(f"verify --train: {verdict}")


def _print_bench_training(report):
    env = report["environment"]
    table = Table(title=f"{report['model']} {report['layer']} {'x'.join(map(str, report['shape']))} forward + backward, "
                        f"{report['dtype']}, {env['threads']} threads, {env['target']}")
    for column in ("engine", "median ms", "p90 ms", "runs", "setup s"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for name, stats in report["engines"].items():
        table.add_row(name, f"{stats['median_ms']:.3f}", f"{stats['p90_ms']:.3f}", str(stats["runs"]), f"{stats['setup_s']:.1f}")
    out.print(table)
    saved = report["saved_bytes"]
    out.print(f"saved for backward: tvm {saved['tvm'] / 1024:,.1f} KiB, torch {saved['torch'] / 1024:,.1f} KiB; "
              f"{report['tasks_tuned']}/{report['tasks_total']} tasks tuned")
    verdict = "tvm faster" if report["ratio"] < 1 else "tvm slower"
    out.print(f"tvm median / torch-eager's: {report['ratio']:.2f} ({verdict})")


def _print_bench(report):
    env = report["environment"]
    for result in report["results"]:
        table = Table(title=f"{report['model']} {result['batch']}x{result['seq_len']}"
                            + (f" ({result['padding']:.0%} padding)" if result["padding"] else "")
                            + f", {report['dtype']}, {env['threads']} threads, {env['target']}")
        for column in ("engine", "median ms", "p90 ms", "p99 ms", "seq/s", "runs", "setup s", "memory MB"):
            table.add_column(column, justify="left" if column == "engine" else "right", no_wrap=column == "engine")
        for name, stats in result["engines"].items():
            if "skipped" in stats:
                table.add_row(name, f"[dim]skipped: {stats['skipped']}[/dim]")
            else:
                table.add_row(name, f"{stats['median_ms']:.3f}", f"{stats['p90_ms']:.3f}", f"{stats['p99_ms']:.3f}",
                              f"{stats['throughput']:.1f}", str(stats["runs"]), f"{stats['setup_s']:.1f}",
                              f"{stats['memory_mb']:.0f}")
        out.print(table)
        if result["ratio"]:
            verdict = "tvm faster" if result["ratio"] < 1 else "tvm slower"
            out.print(f"tvm median / best other's ({result['best_other']}): {result['ratio']:.2f} ({verdict})")
        if result.get("packed_speedup"):
            out.print(f"tvm (padded) median / tvm-packed's: {result['packed_speedup']:.2f}")


def _print_export(manifest):
    table = Table(title=f"{manifest['model']['name']} package, {manifest['dtype']}, {manifest['target_key']}")
    for column in ("bucket", "tasks tuned", "build s", "median ms"):
        table.add_column(column, justify="left" if column == "bucket" else "right")
    for b in manifest["buckets"]:
        table.add_row(f"{b['batch']}x{b['seq_len']}" + (f", {b['tokens']} tokens" if b.get("tokens") else ""),
                      f"{b['tasks_tuned']}/{b['tasks_total']}",
                      f"{b['build_seconds']:.1f}" + (" (cached)" if b["cached"] else ""),
                      f"{b['cost_ms']:.3f}" if "cost_ms" in b else "-")
    out.print(table)
    report = manifest["report"]
    out.print(f"export: {report['path']}: {report['package_bytes'] / 1e6:.1f} MB (weights stored "
              f"{report['stored_weight_bytes'] / 1e6:.1f} MB for {report['weight_bytes'] / 1e6:.1f} MB of model weights, "
              f"libraries {report['library_bytes'] / 1e6:.1f} MB) in {report['seconds']} s")


def _print_bench_lengths(report):
    env, work = report["environment"], report["workload"]
    table = Table(title=f"{report['model']}, {work['requests']} requests of {work['batch']}, lengths {work['lengths']} (mean "
                        f"{work['mean_length']}, max {work['max_length']}), {report['dtype']}, {env['threads']} threads, {env['target']}")
    for column in ("engine", "seq/s", "p50 ms", "p99 ms", "mean ms", "setup s"):
        table.add_column(column, justify="left" if column == "engine" else "right", no_wrap=column == "engine")
    for name, stats in report["engines"].items():
        if "skipped" in stats:
            table.add_row(name, f"[dim]skipped: {stats['skipped']}[/dim]")
        else:
            table.add_row(name, f"{stats['throughput']:.1f}", f"{stats['p50_ms']:.3f}", f"{stats['p99_ms']:.3f}",
                          f"{stats['mean_ms']:.3f}", f"{stats['setup_s']:.1f}")
    out.print(table)
    if report["throughput_ratio"]:
        verdict = "tvm serves more" if report["throughput_ratio"] >= 1 else "tvm serves fewer"
        out.print(f"tvm throughput / best other's ({report['best_other']}): {report['throughput_ratio']:.2f} ({verdict})")


def _print_run(results):
    printers = {"export": _print_export, "verify": _print_verify, "bench": _print_bench, "build": _print_build, "optimize": _print_ops,
                "tune": _print_tune}
    for stage, result in results.items():
        printers.get(stage, _print_artifact(stage))(result)


_invocation: list[str] = []  # the command line, as the user typed it, for reports


def _one_line(message: str) -> str:
    """Control characters (a user's text or path may hold any) escaped: the error stays one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in message)


def main(argv=None) -> int:
    _invocation[:] = sys.argv[1:] if argv is None else list(argv)
    try:
        cli.main(args=argv, prog_name="tvmbert", standalone_mode=False)
    except click.exceptions.Exit as stop:
        return stop.exit_code
    except click.ClickException as exc:
        err.print(f"error: {_one_line(exc.format_message())}", markup=False)
        return 2
    except click.Abort:
        err.print("interrupted")
        return 130
    except TvmbertError as exc:
        err.print(f"error: {_one_line(str(exc))}", markup=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:  # a bug or a TVM failure we did not anticipate: one line, details on request
        if os.environ.get("TVMBERT_TRACEBACK"):
            raise
        first = (str(exc).strip().splitlines() or [""])[-1]
        err.print(f"error: internal failure ({type(exc).__name__}: {_one_line(first)}); set TVMBERT_TRACEBACK=1 for the traceback",
                  markup=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Human output of the commands: tables and lines on the terminal (--json prints the result instead)."""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False)

# What a rich table adds to its columns' widths: one space either side of each cell, and a border
# line left of each column and right of the last.
_CELL_PADDING = 2
_BORDER = 1


def results_table(title: str, columns: dict[str, list[str]], drop_first: tuple[str, ...]) -> Table:
    """A table of numbers that never cuts one at the terminal's width (a CI log, a plain terminal):
    each column is as wide as its widest cell or header word, headers wrap at their words, and the
    columns in ``drop_first`` are left out, in that order, until the rest fits; a line under the
    table names them. The first column is the row's name."""
    shown = dict(columns)
    for name in (None, *drop_first):
        shown.pop(name, None)
        widths = {header: max([cell_len(cell) for cell in cells] + [cell_len(word) for word in header.split()])
                  for header, cells in shown.items()}
        if sum(widths.values()) + (_CELL_PADDING + _BORDER) * len(widths) + _BORDER <= out.width:
            break
    table = Table(title=title)
    for index, (header, width) in enumerate(widths.items()):
        table.add_column(header, width=width, justify="left" if index == 0 else "right")
    for row in zip(*shown.values()):
        table.add_row(*row)
    left_out = [header for header in columns if header not in shown]
    if left_out:
        table.caption = f"left out at {out.width} columns: {', '.join(left_out)} (--json has every column)"
    return table


def random_weights(result):
    """Said beside every result of a model compiled with weights drawn at random."""
    if drawn := result.get("random_weights"):
        out.print(f"[yellow]random weights[/yellow] (--allow-random-weights): {', '.join(drawn)}: not the model's, "
                  "its answers mean nothing")


def artifact(stage):
    def show(result):
        out.print(f"{stage}: {'cached' if result['cached'] else 'done'} -> {result['artifact']}")

    return show


def tune(result):
    out.print(f"tune: {result['new_trials']} new trials in {result['seconds']} s"
              + (f" ({result['trials_per_minute']} trials/min)" if result["trials_per_minute"] else "")
              + f" into {result['database']}")
    tuned = [t for t in result["tasks"] if t["best_us"] is not None]
    out.print(f"tuned tasks: {len(tuned)}/{len(result['tasks'])}, {len(result['skipped_trivial'])} trivial tasks skipped"
              + (f", est. end-to-end {result['estimated_e2e_ms']} ms" if result["estimated_e2e_ms"] else ""))


def compact(result):
    for db in result["databases"]:
        out.print(f"compact: {db['database']}: {db['records']} of {db['records_before']} records kept "
                  f"({db['workloads']} workloads), {db['bytes'] / 1e6:.2f} MB"
                  + (f"; {db['unread_lines_kept']} lines this TVM could not read kept as they were" if db["unread_lines_kept"] else ""))


def ops(result):
    table = Table(title=f"op counts ({' -> '.join(result['passes'])})")
    table.add_column("op")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for op in sorted(set(result["ops_before"]) | set(result["ops_after"])):
        table.add_row(op, str(result["ops_before"].get(op, "")), str(result["ops_after"].get(op, "")))
    out.print(table)


def build(result):
    from tvmbert.tuning.compile import summary

    out.print(f"build: {'cached' if result['cached'] else 'done'} -> {result['artifact']}")
    out.print(f"{summary(result['schedules'])}, looked up in {', '.join(result['databases_read']) or 'no folder'}"
              + (f"; no such folder: {', '.join(result['databases_missing'])}" if result["databases_missing"] else ""))
    if result["untuned"]:
        out.print(f"untuned (default schedules): {', '.join(result['untuned'])}")
    random_weights(result)


def verify(result):
    table = Table(title=f"verify against PyTorch ({result['dtype']}, {result['samples']} inputs, {result['target']})")
    for column in ("output", "shape", "max abs diff", "max rel diff"):
        table.add_column(column)
    for o in result["outputs"]:
        table.add_row(o["name"], "x".join(map(str, o["shape"])), f"{o['max_abs_diff']:.3g}", f"{o['max_rel_diff']:.3g}")
    out.print(table)
    on = f"{result['texts']} real sentences and {result['samples']} inputs" if result["texts"] else f"{result['samples']} inputs"
    for metric in result["accuracy"]:
        value = "n/a (too few rows)" if metric["value"] is None else f"{metric['value']:.5f}"
        mark = "" if metric["passed"] else " [red]under the bar[/red]"
        out.print(f"  {metric['name']}: {value} (bar {metric['bar']}, {on}){mark}")
    verdict = "[green]PASSED[/green]" if result["passed"] else "[red]FAILED[/red]"
    out.print(f"verify: {verdict} max abs diff {result['max_abs_diff']:.3g} (tolerance {result['tolerance']:.3g})")
    random_weights(result)


def verify_training(result):
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


def bench_training(report):
    env = report["environment"]
    engines = report["engines"].values()
    out.print(results_table(
        f"{report['model']} {report['layer']} {'x'.join(map(str, report['shape']))} forward + backward, "
        f"{report['dtype']}, {env['threads']} threads, {env['target']}",
        {"engine": list(report["engines"]),
         "median ms": [f"{stats['median_ms']:.3f}" for stats in engines],
         "p90 ms": [f"{stats['p90_ms']:.3f}" for stats in engines],
         "runs": [str(stats["runs"]) for stats in engines],
         "setup s": [f"{stats['setup_s']:.1f}" for stats in engines]},
        drop_first=("setup s", "runs", "p90 ms")))
    saved = report["saved_bytes"]
    out.print(f"saved for backward: tvm {saved['tvm'] / 1024:,.1f} KiB, torch {saved['torch'] / 1024:,.1f} KiB; "
              f"{report['tasks_tuned']}/{report['tasks_total']} tasks tuned")
    verdict = "tvm faster" if report["ratio"] < 1 else "tvm slower"
    out.print(f"tvm median / torch-eager's: {report['ratio']:.2f} ({verdict})")
    machine_jitter(report["machine_jitter"])


def bench(report):
    from tvmbert.stages.bench.report import BEYOND_BOUND_MARK
    from tvmbert.stages.bench.timing import beyond_bound, left_out_of_ratio

    env = report["environment"]
    for result in report["results"]:
        timed = {name: stats for name, stats in result["engines"].items() if "skipped" not in stats}
        engines = timed.values()
        out.print(results_table(
            f"{report['model']} {result['batch']}x{result['seq_len']}"
            + (f" ({result['padding']:.0%} padding)" if result["padding"] else "")
            + f", {report['dtype']}, {env['threads']} threads, {env['target']}",
            {"engine": [name + (BEYOND_BOUND_MARK if beyond_bound(stats) else "") for name, stats in timed.items()],
             "median ms": [f"{stats['median_ms']:.3f}" for stats in engines],
             "p90 ms": [f"{stats['p90_ms']:.3f}" for stats in engines],
             "p99 ms": [f"{stats['p99_ms']:.3f}" for stats in engines],
             "after idle ms": [f"{stats['after_idle_ms']:.3f}" for stats in engines],
             "seq/s": [f"{stats['throughput']:.1f}" for stats in engines],
             "runs": [str(stats["runs"]) for stats in engines],
             "setup s": [f"{stats['setup_s']:.1f}" for stats in engines],
             "memory MB": [f"{stats['memory_mb']:.0f}" for stats in engines],
             **({"of floor": [f"{stats['of_floor']:.0%}" if "of_floor" in stats else "-" for stats in engines]}
                if "floor_ms" in result else {})},
            drop_first=("memory MB", "setup s", "runs", "p90 ms", "seq/s", "after idle ms")))
        for name, stats in result["engines"].items():
            if "skipped" in stats:
                out.print(f"[dim]{name}: skipped: {stats['skipped']}[/dim]")
            elif beyond_bound(stats):
                out.print(f"[yellow]{BEYOND_BOUND_MARK} {left_out_of_ratio(name, [(None, stats['accuracy'])])}[/yellow]")
        if result["ratio"]:
            verdict = "tvm faster" if result["ratio"] < 1 else "tvm slower"
            out.print(f"tvm median / best other's ({result['best_other']}): {result['ratio']:.2f} ({verdict})")
        if "floor_ms" in result:
            machine_floor = report["floor"]
            bound = (f"{result['gflop']:.2f} GFLOP at the {machine_floor['dtype']} FMA peak, {result['fma_gflop_per_s']:.1f} GFLOP/s"
                     if result["bound"] == "fma" else f"the weights read once at {machine_floor['memory_gb_per_s']:.1f} GB/s")
            out.print(f"[dim]floor: {result['floor_ms']:.3f} ms ({bound}, measured between the rounds); of floor: floor / median[/dim]")
        if result.get("packed_speedup"):
            out.print(f"tvm (padded) median / tvm-packed's: {result['packed_speedup']:.2f}")
        machine_jitter(result["machine_jitter"])
    random_weights(report)


def machine_jitter(jitter):
    out.print(f"[dim]machine jitter: a fixed single-thread task timed in the same rounds ran p99 "
              f"{jitter['p99_ratio']:.2f}x its median: tails up to that are this machine's[/dim]")


def export(manifest):
    from tvmbert.deploy.package import variants_of

    for variant in variants_of(manifest):
        buckets = variant["buckets"]
        out.print(results_table(
            f"{manifest['model']['name']} package, {manifest['dtype']}, {variant['target_key']}",
            {"bucket": [f"{b['batch']}x{b['seq_len']}" + (f", {b['tokens']} tokens" if b.get("tokens") else "") for b in buckets],
             "tasks tuned": [f"{b['tasks_tuned']}/{b['tasks_total']}" for b in buckets],
             "build s": [f"{b['build_seconds']:.1f}" + (" (cached)" if b["cached"] else "") for b in buckets],
             "median ms": [f"{b['cost_ms']:.3f}" if "cost_ms" in b else "-" for b in buckets]},
            drop_first=("tasks tuned", "build s")))
    report = manifest["report"]
    out.print(f"export: {report['path']}: {report['package_bytes'] / 1e6:.1f} MB (weights stored "
              f"{report['stored_weight_bytes'] / 1e6:.1f} MB for {report['weight_bytes'] / 1e6:.1f} MB of model weights, "
              f"libraries {report['library_bytes'] / 1e6:.1f} MB) in {report['seconds']} s")
    random_weights(manifest)


def bench_lengths(report):
    env, work = report["environment"], report["workload"]
    timed = {name: stats for name, stats in report["engines"].items() if "skipped" not in stats}
    engines = timed.values()
    out.print(results_table(
        f"{report['model']}, {work['requests']} requests of {work['batch']}, lengths {work['lengths']} (mean "
        f"{work['mean_length']}, max {work['max_length']}), {report['dtype']}, {env['threads']} threads, {env['target']}",
        {"engine": list(timed),
         "seq/s": [f"{stats['throughput']:.1f}" for stats in engines],
         "p50 ms": [f"{stats['p50_ms']:.3f}" for stats in engines],
         "p99 ms": [f"{stats['p99_ms']:.3f}" for stats in engines],
         "mean ms": [f"{stats['mean_ms']:.3f}" for stats in engines],
         "setup s": [f"{stats['setup_s']:.1f}" for stats in engines]},
        drop_first=("setup s", "mean ms")))
    for name, stats in report["engines"].items():
        if "skipped" in stats:
            out.print(f"[dim]{name}: skipped: {stats['skipped']}[/dim]")
    if report["throughput_ratio"]:
        verdict = "tvm serves more" if report["throughput_ratio"] >= 1 else "tvm serves fewer"
        out.print(f"tvm throughput / best other's ({report['best_other']}): {report['throughput_ratio']:.2f} ({verdict})")


def run(results):
    printers = {"export": export, "verify": verify, "bench": bench, "build": build, "optimize": ops,
                "tune": tune}
    for stage, result in results.items():
        printers.get(stage, artifact(stage))(result)


class EmbedProgress:
    """`tvmbert embed`'s progress on stderr: a rich bar (texts/s, tokens/s, ETA) on a terminal, a
    plain line at most every ``PLAIN_EVERY_S`` seconds (and at the end) elsewhere: a CI log or a
    file keeps a readable record instead of a bar's redraws."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, what: str):
        self.what, self.bar, self.said_at = what, None, None
        if err.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                                TextColumn("{task.fields[rates]}"), TimeRemainingColumn(), console=err, transient=True)

    def __enter__(self):
        if self.bar:
            self.bar.start()
            self.task = self.bar.add_task(f"embed {self.what}", total=1.0, rates="")
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def __call__(self, tally) -> None:
        rates = f"{tally.rows / tally.seconds:,.0f} texts/s, {tally.tokens / tally.seconds:,.0f} tokens/s" if tally.seconds else ""
        if self.bar:
            self.bar.update(self.task, completed=tally.fraction, rates=rates)
            return
        if self.said_at is not None and tally.seconds - self.said_at < self.PLAIN_EVERY_S and tally.fraction < 1:
            return
        self.said_at = tally.seconds
        eta = tally.eta_s()
        err.print(f"embed: {tally.fraction:6.1%}  {tally.rows:,} texts, {tally.bad:,} bad, {rates}"
                  + (f", {eta:,.0f} s left" if eta is not None and tally.fraction < 1 else ""), markup=False)


def embed(summary):
    resumed = f" ({summary['resumed_shards']} of {summary['shards']} shards from an earlier run)" if summary["resumed_shards"] else ""
    err.print(f"embed: {summary['rows_in']:,} rows in = {summary['rows_out']:,} vectors + {summary['bad']:,} bad rows"
              f"{resumed}", markup=False)
    err.print(f"embed: {summary['texts']:,} texts, {summary['tokens']:,} tokens ({summary['truncated']:,} texts truncated), "
              f"{summary['seconds']:,.1f} s, {summary['texts_per_s'] or 0:,.1f} texts/s, {summary['tokens_per_s'] or 0:,.0f} tokens/s, "
              f"padding {summary['padding']:.1%}", markup=False)
    err.print(f"embed: {summary['precision']} vectors of {summary['dimensions']} -> {summary['output']}"
              + (f"; bad rows listed in {summary['bad_rows_file']}" if summary["bad_rows_file"] else ""), markup=False)

"""The bench report as CSV, as a plot, and as a Markdown table for docs/."""

from __future__ import annotations

import csv
import io

from tvmbert.stages.bench.engines import ENGINES
from tvmbert.stages.bench.timing import beyond_bound, left_out_of_ratio

BEYOND_BOUND_MARK = "†"  # beside the time of an engine beyond the bench's bound; a line under the table says by how much


def to_csv(report: dict) -> str:
    buffer = io.StringIO()
    columns = ["model", "dtype", "batch", "seq_len", "padding", "engine", "median_ms", "p90_ms", "p99_ms", "mean_ms",
               "after_idle_ms", "quiet_after_ms", "runs", "throughput", "gflop_per_s", "of_floor", "setup_s", "memory_mb",
               "max_abs_diff", "accuracy_bound", "within_bound", "skipped"]
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    for result in report["results"]:
        for engine, stats in result["engines"].items():
            accuracy = stats.get("accuracy", {})
            writer.writerow({"model": report["model"], "dtype": report["dtype"], "batch": result["batch"],
                             "seq_len": result["seq_len"], "padding": result["padding"], "engine": engine,
                             **{key: value for key, value in stats.items() if key != "accuracy"},
                             "max_abs_diff": accuracy.get("max_abs_diff"), "accuracy_bound": accuracy.get("bound"),
                             "within_bound": accuracy.get("within")})
    return buffer.getvalue()


def plot(report: dict) -> bytes:
    """Latency against sequence length per engine, one panel per (batch, padding), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["batch"], r["padding"]) for r in report["results"]})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (batch, padding) in zip(axes[0], panels):
        rows = [r for r in report["results"] if r["batch"] == batch and r["padding"] == padding]
        for engine in ENGINES:
            points = sorted((r["seq_len"], r["engines"][engine]["median_ms"]) for r in rows
                            if "median_ms" in r["engines"].get(engine, {}))
            beyond = any(beyond_bound(r["engines"].get(engine, {})) for r in rows)
            if points:
                axis.plot(*zip(*points), marker="o", label=engine + (" (results beyond the bound)" if beyond else ""))
        axis.set_title(f"{report['model']}, batch {batch}" + (f", {padding:.0%} padding" if padding else ""))
        axis.set_xlabel("sequence length")
        axis.set_ylabel("median latency (ms)")
        axis.grid(alpha=0.3)
        axis.legend()
    environment_line = report["environment"]
    figure.suptitle(f"{environment_line['cpu']}, {environment_line['threads']} threads, {report['dtype']}", fontsize=9)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120)
    plt.close(figure)
    return png.getvalue()


WIDEST_SETS = ("avx2", "avx512f", "avx512vnni", "avx512bf16", "avxvnni", "amx-bf16", "amx-int8")  # what tells CPUs apart in a table


def to_markdown(report: dict, command: str) -> str:
    """A results table for docs/, with the command and the environment that produced it."""
    env = report["environment"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {env['cpu']} ({', '.join(s for s in env['instruction_sets'] if s in WIDEST_SETS)}), {env['threads']} threads of {env['cores']} cores, "
        f"target `{env['target']}`; torch {env['torch']}, apache-tvm {env['apache-tvm']}, onnxruntime {env['onnxruntime']}, "
        f"openvino {env['openvino']}, "
        f"transformers {env['transformers']}; {report['model']}, {report['dtype']}, median ms (p99; after 200 ms idle).",
        "",
    ]
    if report.get("random_weights"):
        lines[-1:-1] = ["", f"**Random weights** (`--allow-random-weights`): {', '.join(report['random_weights'])}."]
    names = [name for name in ENGINES if any(name in r["engines"] for r in report["results"])]
    lines.append("| batch x seq | padding | " + " | ".join(names) + " | tvm / best other |")
    lines.append("| --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    for result in report["results"]:
        cells = []
        for name in names:
            stats = result["engines"].get(name, {})
            cells.append(f"{stats['median_ms']:.2f} ({stats['p99_ms']:.2f}; {stats['after_idle_ms']:.2f})"
                         + (BEYOND_BOUND_MARK if beyond_bound(stats) else "") if "median_ms" in stats else "skipped")
        ratio = f"{result['ratio']:.2f} vs {result['best_other']}" if result["ratio"] else "-"
        lines.append(f"| {result['batch']} x {result['seq_len']} | {result['padding']:g} | " + " | ".join(cells) + f" | {ratio} |")
    for name in names:
        measured = [(f"{r['batch']} x {r['seq_len']}" + (f" padding {r['padding']:g}" if r["padding"] else ""), r["engines"][name]["accuracy"])
                    for r in report["results"] if beyond_bound(r["engines"].get(name, {}))]
        if measured:
            lines += ["", f"{BEYOND_BOUND_MARK} {left_out_of_ratio(name, measured)}."]
    if all("gflop" in result for result in report["results"]):
        machine_floor = report.get("floor")
        lines += ["", "GFLOP/s: each shape's encoder FLOPs (a multiply-add is two) over each median."]
        if machine_floor:
            lines[-1] += (f" The floor: the larger of the FLOPs at this machine's {machine_floor['dtype']} FMA peak "
                          f"(register-only, on every thread: {machine_floor['fma_gflop_per_s']:.1f} GFLOP/s at the start, each "
                          "shape's the median of its runs between the engines' rounds) and the weight "
                          f"matmuls' weights read once at its memory bandwidth ({machine_floor['memory_gb_per_s']:.1f} GB/s) where "
                          "they do not fit in its last level cache; in brackets, the share of it each engine that runs that "
                          "arithmetic reaches (floor / median).")
        floor_column = machine_floor and all("floor_ms" in result for result in report["results"])
        lines += ["", "| batch x seq | GFLOP | " + ("floor ms | " if floor_column else "") + " | ".join(names) + " |",
                  "| --- | --- | " + ("--- | " if floor_column else "") + " | ".join("---" for _ in names) + " |"]
        for result in report["results"]:
            rates = []
            for name in names:
                stats = result["engines"].get(name, {})
                rate = f"{stats['gflop_per_s']:.1f}" if "gflop_per_s" in stats else "-"
                rates.append(rate + (f" ({stats['of_floor']:.0%})" if "of_floor" in stats else ""))
            floor_cell = (f"{result['floor_ms']:.4g} ({result['bound']}, {result['fma_gflop_per_s']:.1f} GFLOP/s) | "
                          if floor_column else "")
            lines.append(f"| {result['batch']} x {result['seq_len']} | {result['gflop']:.2f} | {floor_cell}" + " | ".join(rates) + " |")
    return "\n".join(lines) + "\n"

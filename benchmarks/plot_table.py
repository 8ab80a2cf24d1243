"""Draws a results table of docs/benchmarks.md the way `tvmbert bench --plot` draws a run, so that
the plot beside a table shows exactly its medians (the runs themselves are not kept).

    python benchmarks/plot_table.py docs/benchmarks.md "Zen 3 (AVX2)" docs/img/bert-base-fp32-zen3.png
    python benchmarks/plot_table.py --json a.json b.json ... out.png


The table is the first one under the heading named; its rows are shapes ("1 x 14") and its columns
engines (a header's first word, as in `tvm int8` or `onnxruntime fp32`). The plot is titled with
the heading (the CPU), 2 threads (every table's), and the dtype its `## ` section names. With
``--json``, the shapes of several `tvmbert bench --json` reports of one model (runs one length
at a time, as long contexts take) in one plot.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tvmbert.stages.bench.engines import ENGINES
from tvmbert.stages.bench.report import plot

SHAPE = re.compile(r"^(\d+) x (\d+)$")
DTYPES = ("fp32", "int8", "bf16")


def read_table(markdown: str, heading: str) -> tuple[str, list[list[str]]]:
    """The dtype of the section and the rows of the first table under ``heading``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip() == heading and line.startswith("#"))
    dtype = next(word for line in reversed(lines[:start + 1]) if line.startswith("## ")
                 for word in DTYPES if word in line)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| "))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*").strip() for cell in line.strip("|").split("|")])
    return dtype, [rows[0]] + rows[2:]


def report_of(cpu: str, dtype: str, table: list[list[str]]) -> dict:
    """A bench report holding the table's medians, as `plot` reads one."""
    header, *rows = table
    engines = {index: name.split()[0] for index, name in enumerate(header)
               if name.split() and name.split()[0] in ENGINES and "/" not in name}
    results = []
    for row in rows:
        shape = SHAPE.match(row[0])
        if shape:
            results.append({"batch": int(shape[1]), "seq_len": int(shape[2]), "padding": 0.0,
                            "engines": {name: {"median_ms": float(row[index])} for index, name in engines.items()}})
    return {"model": "bert-base", "dtype": dtype, "environment": {"cpu": cpu, "threads": 2}, "results": results}


def merged(paths: list[str]) -> dict:
    """The first report with every report's shapes, in order of sequence length."""
    reports = [json.loads(Path(path).read_text()) for path in paths]
    results = sorted((result for report in reports for result in report["results"]), key=lambda r: (r["batch"], r["seq_len"]))
    return {**reports[0], "results": results}


def main(arguments: list[str]) -> None:
    if arguments[0] == "--json":
        *paths, out = arguments[1:]
        Path(out).write_bytes(plot(merged(paths)))
        return
    document, heading, out = arguments
    dtype, table = read_table(Path(document).read_text(), heading)
    Path(out).write_bytes(plot(report_of(heading, dtype, table)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The commands' tables on narrow terminals: a number is shown whole or its column is left out, never cut."""

import io

import pytest
from rich.console import Console

from tvmbert.cli import render


def _engine(median_ms, throughput):
    return {"median_ms": median_ms, "p90_ms": median_ms * 1.4, "p99_ms": median_ms * 2.1, "after_idle_ms": median_ms * 3.3,
            "throughput": throughput, "runs": 10923, "setup_s": 123.4, "memory_mb": 1530.2}


def _report(bound=None):
    """What `make demo`'s bench reports, with numbers as wide as bert-base's at 8 x 128 beside the demo's;
    with ``bound``, the machine's floor and each engine's share of it (none for a quantized peer)."""
    engines = {"tvm": _engine(0.19665, 5085.3), "torch-compile": _engine(1136.5432, 0.9), "onnxruntime": _engine(11.2345, 89.0),
               "ort-int8": _engine(9.8765, 101.2), "openvino-int8": {"skipped": "openvino is not installed"}}
    result = {"batch": 1, "seq_len": 14, "padding": 0.0, "gflop": 0.01, "ratio": 0.61, "best_other": "onnxruntime",
              "machine_jitter": {"p99_ratio": 1.52}, "engines": engines}
    report = {"model": "bert-tiny", "dtype": "float32", "random_weights": [], "environment": {"threads": 2, "target": "llvm-znver4"},
              "floor": None, "results": [result]}
    engines["torch-compile"]["accuracy"] = {"max_abs_diff": 2.3, "bound": 0.2, "within": False}  # timed, flagged, in no ratio
    if bound:
        report["floor"] = {"fma_gflop_per_s": 190.1, "memory_gb_per_s": 23.4, "cache_bytes": 2**25, "dtype": "float32"}
        result.update(fma_gflop_per_s=187.3, floor_ms=0.1234, bound=bound)
        for name in ("tvm", "torch-compile", "onnxruntime"):
            engines[name]["of_floor"] = round(0.1234 / engines[name]["median_ms"], 3)
    return report


@pytest.mark.parametrize("bound", [None, "fma", "memory"])
@pytest.mark.parametrize("width", [80, 60])
def test_a_bench_table_never_cuts_a_number(monkeypatch, width, bound):
    screen = io.StringIO()
    monkeypatch.setattr(render, "out", Console(file=screen, width=width, highlight=False, color_system=None))
    render.bench(_report(bound))
    text = screen.getvalue()

    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for name, stats in _report(bound)["results"][0]["engines"].items():
        assert name in text
        if "skipped" in stats:
            continue
        row = next(line for line in text.splitlines() if line.startswith(f"│ {name}"))
        shown = row.split("│")[2:-1]
        assert f"{stats['median_ms']:.3f}" in shown[0]
        assert all(cell.strip() and " " not in cell.strip() for cell in shown), row
    assert "openvino is not installed" in text
    assert "│ torch-compile† " in text and ("† torch-compile's results are beyond the bench's bound (0.2): max abs diff 2.3; "
                                          "timed, left out of tvm / best other") in " ".join(text.split())
    if width == 60:
        assert "left out at 60 columns" in text
    if bound:
        assert "63%" in text  # tvm's share of the floor, kept at every width
        assert "floor: 0.123 ms" in " ".join(text.split())
        assert ("187.3 GFLOP/s" if bound == "fma" else "23.4 GB/s") in " ".join(text.split())
    else:
        assert "floor" not in text

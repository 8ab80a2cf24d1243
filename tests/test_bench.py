"""bench: every engine on the same inputs, checked before timing, sweeps, CSV and plot."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tvmbert.stages.bench import engines as bench_engines
from tvmbert.stages.bench.engines import Engine, Incomparable, _check, _onnx_written, failure_line
from tvmbert.stages.bench.timing import _ratios, measure

FAST = ("--repeat", "3", "--min-time", "0", "--warmup", "1")


@pytest.mark.slow
def test_bench_peers_sweep_padding_csv_and_plot(tvmbert, tmp_path, workdir):
    outcome = tvmbert("bench", "bert-tiny", "--seq-len", "8,16", "--padding", "0,0.5", "--engines",
                      "tvm,torch-eager,torch-sdpa,onnxruntime", *FAST, "--csv", str(tmp_path / "b.csv"),
                      "--plot", str(tmp_path / "b.png"), "--json")
    assert outcome.code == 0, outcome.stderr
    report = outcome.json
    assert [(r["seq_len"], r["padding"]) for r in report["results"]] == [(8, 0.0), (8, 0.5), (16, 0.0), (16, 0.5)]
    for result in report["results"]:
        assert set(result["engines"]) == {"tvm", "torch-eager", "torch-sdpa", "onnxruntime"}
        for stats in result["engines"].values():
            assert stats["runs"] >= 3 and stats["p99_ms"] >= stats["p90_ms"] >= stats["median_ms"] > 0
            assert stats["after_idle_ms"] > 0 and 0 <= stats["quiet_after_ms"] <= 1000
            assert stats["throughput"] > 0 and stats["setup_s"] >= 0 and stats["accuracy"]["within"]
        assert result["ratio"] > 0 and result["best_other"] in result["engines"]
        jitter = result["machine_jitter"]
        assert jitter["median_ms"] > 0 and jitter["p99_ratio"] >= 1 and jitter["runs"] >= 3 * 4
    environment = report["environment"]
    assert environment["threads"] >= 1 and environment["torch"] and environment["onnxruntime"]
    rows = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert len(rows) == 16 and {row["engine"] for row in rows} == {"tvm", "torch-eager", "torch-sdpa", "onnxruntime"}
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    exported = {file.name for file in workdir.glob("bert-tiny/b1-s8-float32/*/onnx/*")}
    assert "model.onnx" in exported and exported <= {"model.onnx", "model.onnx.data"}  # its weights' file named for it, no scratch left


def test_openvino_and_a_wrong_engine_are_checked_and_timed_like_the_others_on_a_named_cpu(tvmbert, tmp_path, monkeypatch):
    """An engine beyond the bench's bound is timed beside its error, flagged, and left out of the
    ratio with the reason said (OpenVINO's bf16 was dropped from the bf16 table: issue 57). Here
    torch-sdpa, made wrong and the fastest: the ratio would be against it were it counted. (In this
    bench run, not one of its own: a run costs CI seconds.)"""
    honest_sdpa = bench_engines.torch_sdpa

    def wrong_and_fastest(job, inputs, threads):
        honest = honest_sdpa(job, inputs, threads)
        return Engine("torch-sdpa", lambda: None, lambda: [output + 1.0 for output in honest.outputs()])

    monkeypatch.setattr(bench_engines, "torch_sdpa", wrong_and_fastest)
    outcome = tvmbert("bench", "bert-tiny", "--padding", "0.25", "--engines", "openvino,onnxruntime,torch-sdpa", *FAST,
                      "--markdown", str(tmp_path / "b.md"), "--csv", str(tmp_path / "b.csv"), "--json")
    assert outcome.code == 0, outcome.stderr
    report = outcome.json
    assert report["engines"]["openvino"]["median_ms"] > 0 and report["engine_dtypes"]["openvino"] == "float32"
    assert report["best_other"] in ("openvino", "onnxruntime")  # the ratio is against the best of every peer within the bound
    assert report["ratio"] == pytest.approx(report["engines"]["tvm"]["median_ms"] / report["engines"][report["best_other"]]["median_ms"],
                                            abs=1e-3)
    wrong = report["engines"]["torch-sdpa"]
    assert wrong["runs"] >= 3 and 0 < wrong["median_ms"] < min(report["engines"][name]["median_ms"] for name in ("openvino", "onnxruntime"))
    assert wrong["accuracy"]["within"] is False and wrong["accuracy"]["max_abs_diff"] == pytest.approx(1.0, abs=0.01)
    assert wrong["accuracy"]["bound"] == 1e-3
    assert all(report["engines"][name]["accuracy"]["within"] for name in ("tvm", "openvino", "onnxruntime"))
    assert ("torch-sdpa's results are beyond the bench's bound (0.001): max abs diff 1; timed, left out of tvm / best other"
            in outcome.stderr)
    rows = {row["engine"]: row for row in csv.DictReader((tmp_path / "b.csv").open())}
    assert rows["torch-sdpa"]["within_bound"] == "False" and rows["openvino"]["within_bound"] == "True"
    environment = report["environment"]
    assert environment["openvino"] and "family" in environment["cpu"] and "sse4.2" in environment["instruction_sets"]
    # This machine's floor, measured first and between the engines' rounds, and each engine's share of the shape's.
    machine_floor, result = report["floor"], report["results"][0]
    assert machine_floor["dtype"] == "float32" and machine_floor["fma_gflop_per_s"] > 0 and machine_floor["memory_gb_per_s"] > 0
    assert result["floor_ms"] > 0 and result["bound"] in ("fma", "memory") and result["fma_gflop_per_s"] > 0
    for stats in report["engines"].values():  # of_floor is rounded to 3 places, as floor_ms is in ms
        assert stats["of_floor"] == pytest.approx(result["floor_ms"] / stats["median_ms"], abs=6e-4 + 6e-4 / stats["median_ms"])
    markdown = (tmp_path / "b.md").read_text()
    assert "openvino" in markdown and "| floor ms |" in markdown
    assert f"{wrong['median_ms']:.2f} (" in markdown and ")† |" in markdown
    assert ("† torch-sdpa's results are beyond the bench's bound (0.001): max abs diff 1 at 1 x 14 padding 0.25; timed, "
            "left out of tvm / best other." in markdown)
    assert f"{machine_floor['fma_gflop_per_s']:.1f} GFLOP/s at the start" in markdown and f"{result['fma_gflop_per_s']:.1f} GFLOP/s)" in markdown
    # float64 is not something its CPU plugin computes: said, not timed. The floor is fp64's.
    wide = tvmbert("bench", "bert-tiny", "--dtype", "float64", "--engines", "openvino", *FAST, "--json")
    assert wide.code == 0 and "f32 or bf16" in wide.json["engines"]["openvino"]["skipped"]
    assert wide.json["floor"]["dtype"] == "float64" and "of_floor" in wide.json["engines"]["tvm"]


def test_openvino_bf16_outputs_are_read_as_bf16_not_as_the_float16_its_data_hands():
    import ml_dtypes
    import openvino

    values = np.array([1.0, -2.5, 3.140625, 1e-3], dtype=np.float32)
    tensor = openvino.Tensor(openvino.Type.bf16, openvino.Shape([4]))
    tensor.data.view(np.uint16)[:] = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert tensor.data.dtype == np.float16  # the same bits, which as float16 are other numbers
    read = bench_engines._openvino_array(openvino, tensor)
    assert read.dtype == np.float32
    np.testing.assert_array_equal(read, values.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.slow
def test_bench_torch_compile(tvmbert):
    outcome = tvmbert("bench", "bert-tiny", "--engines", "torch-compile", *FAST, "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["engines"]["torch-compile"]["median_ms"] > 0
    assert outcome.json["engines"]["torch-compile"]["setup_s"] > 0  # the compilation is a one-time cost


def test_an_engines_error_is_measured_on_real_tokens_and_outputs_that_cannot_be_compared_are_refused():
    expected = [np.zeros((1, 4, 2)), np.zeros((1, 2))]
    mask = np.array([[1, 1, 0, 0]])
    garbage_on_padding = np.zeros((1, 4, 2))
    garbage_on_padding[0, 3] = 7.0
    fine = Engine("fine", lambda: None, lambda: [garbage_on_padding, np.zeros((1, 2))])
    wrong = Engine("wrong", lambda: None, lambda: [np.full((1, 4, 2), 0.5), np.zeros((1, 2))])
    # padded positions are nobody's answer
    assert _check(fine, expected, mask, [True, False], 1e-3) == {"max_abs_diff": 0.0, "bound": 1e-3, "within": True}
    assert _check(wrong, expected, mask, [True, False], 1e-3) == {"max_abs_diff": 0.5, "bound": 1e-3, "within": False}
    nan = np.zeros((1, 4, 2))
    nan[0, 0, 0] = np.nan  # a NaN compares as no difference: refused, not passed
    for outputs, reason in (([np.zeros((1, 4, 2))], "returned 1 outputs, expected 2"),
                            ([np.zeros((1, 1, 2)), np.zeros((1, 2))], "shape (1, 1, 2), expected (1, 4, 2)"),
                            ([nan, np.zeros((1, 2))], "NaN or inf")):
        with pytest.raises(Incomparable, match=re.escape(reason)):
            _check(Engine("broken", lambda: None, lambda outputs=outputs: outputs), expected, mask, [True, False], 1e-3)


def test_a_peers_failure_is_its_type_and_first_line_and_a_bare_assert_its_type_alone():
    assert failure_line(RuntimeError("  out of memory\nat frame 3")) == "RuntimeError: out of memory"
    assert failure_line(AssertionError()) == "AssertionError"
    assert failure_line(ValueError("x" * 400)) == "ValueError: " + "x" * 160


def test_ratio_is_tvm_over_the_best_other():
    engines = {"tvm": {"median_ms": 9.0}, "torch-eager": {"median_ms": 30.0}, "onnxruntime": {"median_ms": 10.0},
               "torch-compile": {"skipped": "not installed"}}
    assert _ratios(engines) == {"ratio": 0.9, "best_other": "onnxruntime", "speedup": 3.333, "packed_speedup": None}
    # The packed build is tvm's own other build, never the best other engine.
    engines["tvm-packed"] = {"median_ms": 4.5}
    assert _ratios(engines) == {"ratio": 0.9, "best_other": "onnxruntime", "speedup": 3.333, "packed_speedup": 2.0}
    # An engine beyond the bench's bound is in no ratio, tvm itself included.
    engines["onnxruntime"]["accuracy"] = {"max_abs_diff": 2.3, "bound": 0.2, "within": False}
    assert _ratios(engines)["best_other"] == "torch-eager"
    engines["tvm"]["accuracy"] = {"max_abs_diff": 2.3, "bound": 0.2, "within": False}
    assert _ratios(engines) == {"ratio": None, "best_other": None, "speedup": None, "packed_speedup": None}


def test_bad_bench_options(tvmbert):
    assert tvmbert("bench", "bert-tiny", "--engines", "tensorrt").code == 2
    assert tvmbert("bench", "bert-tiny", "--padding", "1.5").code == 2
    assert tvmbert("bench", "bert-tiny", "--seq-len", "8,x").code == 2
    assert tvmbert("trace", "bert-tiny", "--seq-len", "8,16").code == 2


@pytest.mark.parametrize("option", ["--csv", "--plot", "--markdown"])
def test_an_output_path_that_cannot_be_written_fails_before_the_benchmark(tvmbert, tmp_path, option):
    """It used to fail after the whole benchmark had run, losing its results."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path, fragment in ((blocker / "out", "a-file is a file, not a folder"), (tmp_path, "is a directory")):
        outcome = tvmbert("bench", "bert-tiny", option, str(path), "--workdir", str(tmp_path / "work"))
        assert outcome.code == 2 and option in outcome.stderr and fragment in outcome.stderr, outcome.stderr
    assert not (tmp_path / "work").exists()  # nothing was built or timed


def test_timed_calls_never_collect_garbage_and_the_machine_jitter_is_reported():
    """No engine's timing holds a collection of the objects every engine's setup left (the
    process holds them all; a process serving one engine would not), and the machine's own
    jitter comes with the figures."""
    import gc

    seen = []

    def run():
        seen.append(gc.isenabled())
        [object() for _ in range(1000)]  # what an engine's call allocates

    engines = [Engine(name, run, lambda: []) for name in ("a", "b")]
    enabled_before = gc.isenabled()
    jitter = measure(engines, warmup=1, repeat=3, min_time_s=0.0)
    timed = sum(len(e.timings_ms) + len(e.after_idle_ms) for e in engines)
    assert seen[:2] == [enabled_before] * 2  # the warm-up as the process had it
    assert len(seen) - 2 >= timed and not any(seen[2:])  # every call after it, timed or waking, without
    assert gc.isenabled() == enabled_before and gc.get_freeze_count() == 0  # the collector as it was, nothing left frozen
    assert jitter["median_ms"] > 0 and jitter["p99_ratio"] >= 1 and jitter["runs"] >= 3 * 2


def test_a_probe_between_rounds_runs_after_every_pass_over_the_engines():
    """bench's floor probe is timed in the engines' rounds, each time after all of them, never inside one."""
    import re

    calls = []

    def slow(name):  # a call as long as a round: a round of ROUND_RUNS calls each, more rounds for --repeat
        calls.append(name)
        time.sleep(0.01)

    engines = [Engine(name, lambda name=name: slow(name), lambda: []) for name in "ab"]
    measure(engines, warmup=0, repeat=9, min_time_s=0.0, between_rounds=lambda: calls.append("p"))
    rounds = "".join(calls)
    assert re.fullmatch(r"(a+b+p){3,}(ab){5}", rounds), rounds  # then the after-idle calls, without it


def test_an_onnx_export_removes_the_scratch_folder_a_killed_bench_left(tmp_path):
    """A bench killed mid-export leaves its scratch folder (bert-base's weights, 440 MB); the next
    export removes it, and leaves alone one whose process is alive (a bench beside it)."""
    import socket

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    host = socket.gethostname()
    killed, beside = tmp_path / f".model.onnx.tmp-{gone}@{host}@a", tmp_path / f".model.onnx.tmp-{os.getpid()}@{host}@b"
    for folder in (killed, beside):
        folder.mkdir()
        (folder / "model.onnx.data").write_bytes(b"weights")
    with _onnx_written(tmp_path / "model.onnx") as written:
        written.with_name("model.onnx.data").write_bytes(b"new weights")
        written.write_bytes(b"model")
    assert sorted(file.name for file in tmp_path.iterdir()) == sorted(["model.onnx", "model.onnx.data", beside.name])
    assert (tmp_path / "model.onnx.data").read_bytes() == b"new weights"


def test_compiled_and_captured_peers_take_eager_attention_where_a_family_has_no_sdpa():
    """DeBERTa-v2 has no SDPA attention in transformers: torch-compile compiles its eager one
    (asking for SDPA failed its setup, and DeBERTa went without a compiled peer)."""
    from types import SimpleNamespace

    from tvmbert.frontend import models
    from tvmbert.stages.bench.engines import fastest_attention

    assert [fastest_attention(SimpleNamespace(source=models.resolve(name)))
            for name in ("deberta-v3-tiny", "modernbert-tiny", "bert-tiny")] == ["eager", "sdpa", "sdpa"]

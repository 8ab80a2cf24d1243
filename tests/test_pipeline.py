"""bert-tiny through every stage, for real: export, import, passes, TVM build, numerics, timing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tvmbert import InputError

from helpers import HOST_AMX, REPO, WITHOUT_KERNELS


def test_run_config_goes_through_every_stage_and_then_reuses_artifacts(tvmbert, tmp_path):
    import yaml

    # The shipped config, its bench cut to two engines and a few runs (bench's own tests time every engine).
    config = yaml.safe_load((REPO / "configs" / "bert-tiny.yaml").read_text())
    config["bench"] = {"engines": ["tvm", "torch-eager"], "warmup": 1, "repeat": 3, "min_time_s": 0}
    (tmp_path / "bert-tiny.yaml").write_text(yaml.safe_dump(config))
    first = tvmbert("run", str(tmp_path / "bert-tiny.yaml"), "--json", "--log-dir", str(tmp_path / "logs"))
    assert first.code == 0, first.stderr
    result = first.json
    assert list(result) == ["trace", "convert", "optimize", "tune", "build", "verify", "bench"]
    assert result["verify"]["passed"] and result["verify"]["max_abs_diff"] <= 1e-5
    assert result["build"]["tasks_total"] > 0
    assert result["bench"]["engines"]["tvm"]["median_ms"] > 0
    assert result["bench"]["engines"]["torch-eager"]["median_ms"] > 0

    again = tvmbert("run", str(tmp_path / "bert-tiny.yaml"), "--json", "--log-dir", str(tmp_path / "logs"))
    assert again.code == 0, again.stderr
    for stage in ("trace", "convert", "optimize", "build"):
        assert again.json[stage]["cached"] is True, (stage, again.stderr[-3000:])
        assert f"{stage}: cached" in again.stderr


def test_force_redoes_a_cached_stage(tvmbert):
    assert tvmbert("convert", "bert-tiny").code == 0
    forced = tvmbert("convert", "bert-tiny", "--force", "--json")
    assert forced.code == 0 and forced.json["cached"] is False


def test_trace_writes_program_and_metadata(tvmbert, workdir):
    outcome = tvmbert("trace", "bert-tiny", "--batch", "2", "--seq-len", "9", "--json")
    assert outcome.code == 0, outcome.stderr
    folder = workdir / "bert-tiny" / "b2-s9-float32" / "trace"
    meta = json.loads((folder / "stage.json").read_text())
    assert meta["inputs"]["input_ids"]["shape"] == [2, 9]
    assert meta["config_hash"] and meta["versions"]["torch"].startswith("2.13")
    assert [o["shape"] for o in meta["outputs"]] == [[2, 9, 128], [2, 128]]
    assert (folder / "program.pt2").stat().st_size > 0


def test_convert_keeps_weights_apart_and_writes_readable_ir(tvmbert, workdir):
    assert tvmbert("convert", "bert-tiny").code == 0
    folder = workdir / "bert-tiny" / "b1-s14-float32" / "convert"
    assert "def main(input_ids" in (folder / "module.py").read_text()
    assert (folder / "params.npz").stat().st_size > 4 * 30522 * 128  # the word embeddings at least


def test_every_shape_of_a_model_links_one_pooled_copy_of_its_weights(tvmbert, tmp_path):
    work = tmp_path / "work"
    for seq_len in ("9", "11"):
        assert tvmbert("convert", "bert-tiny", "--seq-len", seq_len, "--workdir", str(work)).code == 0
    shapes = [work / "bert-tiny" / f"b1-s{n}-float32" / "convert" / "params.npz" for n in (9, 11)]
    (pooled,) = (work / ".weights").glob("*.npz")
    assert shapes[0].stat().st_ino == shapes[1].stat().st_ino == pooled.stat().st_ino and pooled.stat().st_nlink == 3
    assert tvmbert("convert", "bert-tiny", "--seq-len", "9", "--force", "--workdir", str(work)).code == 0
    assert list((work / ".weights").glob("*.npz")) == [pooled] and pooled.stat().st_nlink == 3  # the replaced folder's link gone with it

    shutil.rmtree(work / "bert-tiny")  # no artifact links the pooled copy now: the next write drops it
    assert tvmbert("convert", "bert-tiny", "--seed", "1", "--workdir", str(work)).code == 0
    (other,) = (work / ".weights").glob("*.npz")
    assert other != pooled and other.stat().st_nlink == 2


def test_optimize_reports_op_counts(tvmbert):
    outcome = tvmbert("optimize", "bert-tiny", "--json")
    assert outcome.code == 0, outcome.stderr
    result = outcome.json
    assert result["ops_before"]["matmul"] == 17
    assert not any(op == "matmul" for op in result["ops_after"])  # legalized and fused into kernels
    assert any(op.startswith("tir:fused_matmul") for op in result["ops_after"])
    assert [p["pass"] for p in result["per_pass"]] == result["passes"]


def test_optimize_disable_leaves_a_pass_out(tvmbert):
    outcome = tvmbert("optimize", "bert-tiny", "--disable", "fuse", "--json")
    assert outcome.code == 0, outcome.stderr
    assert "fuse" not in outcome.json["passes"]
    assert not any(op.startswith("tir:fused_") for op in outcome.json["ops_after"])


def test_verify_float32(tvmbert):
    outcome = tvmbert("verify", "bert-tiny", "--json")
    assert outcome.code == 0, outcome.stderr
    result = outcome.json
    assert result["passed"] and result["max_abs_diff"] <= 1e-5
    assert {o["name"] for o in result["outputs"]} == {"last_hidden_state", "pooler_output"}


def test_verify_float64_is_exact_to_rounding(tvmbert):
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "float64", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-10


def test_verify_fails_with_exit_1_when_over_tolerance(tvmbert):
    outcome = tvmbert("verify", "bert-tiny", "--tolerance", "1e-12", "--json")
    assert outcome.code == 1
    assert outcome.json["passed"] is False
    assert "verify failed" in outcome.stderr


def test_bench_reports_both_engines(tvmbert):
    outcome = tvmbert("bench", "bert-tiny", "--repeat", "3", "--min-time", "0", "--warmup", "1", "--json")
    assert outcome.code == 0, outcome.stderr
    engines = outcome.json["engines"]
    for name in ("tvm", "torch-eager"):
        assert engines[name]["runs"] >= 3
        assert engines[name]["p90_ms"] >= engines[name]["median_ms"] > 0
    assert outcome.json["speedup"] > 0


def test_python_api(workdir):
    from tvmbert import Job, JobConfig, optimize

    artifact = optimize(Job(JobConfig(model="bert-tiny", workdir=str(workdir))))
    assert artifact.meta["ops_before"]["matmul"] == 17


def test_an_id_past_the_vocabulary_reads_nan_in_the_library_not_another_tensors_bytes(tmp_path, capfd):
    """TVM's importer looks the embeddings up in "fast" mode, which reads outside the table (and
    warns so at every build); the ids are checked before each call, and the library stays in
    bounds for a caller that skips the checks."""
    import tvm

    from tvmbert import Job, JobConfig, build
    from tvmbert.deploy.compiled import CompiledModel

    job = Job(JobConfig(model="bert-tiny", workdir=str(tmp_path)))
    compiled = CompiledModel(build(job), job)
    assert "segfault" not in capfd.readouterr().err
    ids, mask, segments = (np.ascontiguousarray(t.numpy()) for t in job.inputs.as_tuple())
    ids[0, 3] = 30522  # one past bert-tiny's vocabulary
    with pytest.raises(InputError, match="input_ids"):
        compiled([ids, mask, segments])
    hidden = compiled.run_on_device([tvm.runtime.tensor(a) for a in (ids, mask, segments)])[0].numpy()
    assert np.isnan(hidden[0, 3]).all()


def test_combine_qkv_removes_two_matmuls_per_layer(tvmbert):
    outcome = tvmbert("optimize", "bert-tiny", "--json")
    assert outcome.code == 0, outcome.stderr
    counts = {p["pass"]: p["ops"] for p in outcome.json["per_pass"]}
    layers = 2
    assert counts["cse"]["matmul"] == 17
    assert counts["combine-qkv"]["matmul"] == 17 - 2 * layers
    assert counts["combine-qkv"]["split"] == layers
    assert "concat" not in counts["bind-params"]  # weights concatenated once, at build time
    disabled = tvmbert("optimize", "bert-tiny", "--disable", "combine-qkv", "--json")
    passes = {p["pass"]: p["ops"] for p in disabled.json["per_pass"]}
    assert "combine-qkv" not in passes and passes["unflatten-bmm"]["matmul"] == 17


def test_optimize_viz_draws_one_layer_before_and_after(tvmbert):
    import shutil

    outcome = tvmbert("optimize", "bert-tiny", "--viz", "--json")
    assert outcome.code == 0, outcome.stderr
    before, after = (Path(p) for p in outcome.json["pictures"])
    suffix = ".svg" if shutil.which("dot") else ".dot"
    assert before.suffix == after.suffix == suffix
    before_dot, after_dot = before.with_suffix(".dot").read_text(), after.with_suffix(".dot").read_text()
    # Q/K/V merged, bias epilogues fused (into MetaSchedule's kernels or ours).
    assert before_dot.count("matmul") > after_dot.count("fused_matmul") + after_dot.count("fma_matmul") >= 4
    assert "layer_0" in before_dot and "\\n384 float32" in after_dot  # weights as boxes with shape and dtype: Q/K/V's bias


def test_gelu_is_exact_unless_fast_math_is_asked_for(tvmbert):
    # Our FMA kernel's GELU epilogue is exact whatever the flag (an erf polynomial, 4e-7): the
    # approximation shows where MetaSchedule's kernels compute GELU.
    exact = tvmbert("verify", "bert-tiny", *WITHOUT_KERNELS, "--json")
    fast = tvmbert("verify", "bert-tiny", *WITHOUT_KERNELS, "--fast-math", "--json")
    assert exact.code == 0 and fast.code == 0, fast.stderr
    assert fast.json["fast_math"] is True and exact.json["fast_math"] is False
    # The approximation is visible in the error, and bounded.
    assert exact.json["max_abs_diff"] < fast.json["max_abs_diff"] <= fast.json["tolerance"]
    optimized = tvmbert("optimize", "bert-tiny", "--fast-math", "--json")
    assert "fast-math" in optimized.json["passes"]
    assert "nn.gelu" not in optimized.json["per_pass"][optimized.json["passes"].index("fast-math")]["ops"]


@pytest.mark.parametrize("dtype, measured", [("float16", 2e-3), ("bfloat16", 1e-2)])
def test_mixed_precision(tvmbert, workdir, dtype, measured):
    from tvmbert.deploy.weights import load_params

    if dtype == "bfloat16" and not HOST_AMX:
        pytest.skip("this CPU has no AMX-BF16: --dtype bfloat16 is refused here")

    outcome = tvmbert("verify", "bert-tiny", "--dtype", dtype, "--json")
    assert outcome.code == 0, outcome.stderr
    # Against fp32 PyTorch: measured ~2e-4 (float16) and ~1.4e-3 (bfloat16), well inside the bound.
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= measured
    (params,) = workdir.glob(f"bert-tiny/b1-s14-{dtype}/*/build/params.npz")
    dtypes = {array.dtype.name for array in load_params(params).values()}
    assert dtype in dtypes  # the matmul weights are stored, and streamed, in reduced precision

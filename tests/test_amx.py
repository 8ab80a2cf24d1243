"""bf16 on AMX: the kernel's numerics, bert-tiny through it, and the message on CPUs without it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tvmbert.core import targets
from tvmbert.kernels import amx


@pytest.mark.amx
@pytest.mark.parametrize("lead, n, k, activation, residual, out_dtype, row_chunk_bytes", [
    ((64,), 96, 64, None, False, "float32", 1 << 20),
    ((2, 32), 64, 128, "relax.nn.gelu", False, "float32", 1 << 20),
    ((2, 32), 64, 128, None, True, "float32", 1 << 20),
    ((64,), 96, 64, "relax.nn.gelu", False, "bfloat16", 1 << 20),  # written in bf16 for the next matmul
    # three chunks of one row block: each chunk's last epilogue after its tiles, not overlapped;
    # 32 k steps: one row of the previous block's epilogue a step
    ((96,), 64, 1024, None, True, "float32", 1),
    ((3, 64), 96, 1024, "relax.nn.gelu", False, "bfloat16", 64 * 1024 * 2),  # two chunks of three blocks
])
def test_amx_kernel_matches_float64(lead, n, k, activation, residual, out_dtype, row_chunk_bytes):
    import ml_dtypes
    import tvm

    m = int(np.prod(lead))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*lead, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((k, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(n, dtype=np.float32)
    packed = np.ascontiguousarray(w.reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1))
    r = rng.standard_normal((*lead, n) if residual else (1,), dtype=np.float32)
    library = tvm.compile(tvm.IRModule({"main": amx.bf16_kernel(m, n, k, lead, activation, residual, out_dtype, row_chunk_bytes)}),
                          target=targets.resolve("llvm").tvm_target())
    y = tvm.runtime.tensor(np.zeros((*lead, n), ml_dtypes.bfloat16 if out_dtype == "bfloat16" else "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (x, packed, b, r)), y)
    expected = x.astype(np.float64) @ w.astype(np.float64) + b
    if activation:  # GELU (erf form)
        expected = expected * (1 + np.vectorize(math.erf)(expected / math.sqrt(2))) / 2
    if residual:
        expected = expected + r
    # Products of bf16 values are exact in fp32; only the fp32 accumulation rounds (and the bf16 output).
    tolerance = 2.0 ** -8 if out_dtype == "bfloat16" else 1e-5
    assert np.abs(y.numpy().astype(np.float64) - expected).max() <= tolerance * np.abs(expected).max()


@pytest.mark.amx
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_gated_amx_kernel_writes_gelu_of_the_activated_half_times_its_gates(out_dtype):
    """GeGLU (ModernBERT's MLP): W's columns ordered as the pass orders them, 16 activated then
    their 16 gates a block, and half the columns written."""
    import ml_dtypes
    import tvm
    from tvm import relax

    from tvmbert.passes.kernel_calls import gates_beside_inputs

    lead, n, k = (3, 32), 192, 64  # one chunk of three row blocks: two stored between the next one's tiles, the last after them
    rng = np.random.default_rng(1)
    x = rng.standard_normal((*lead, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((k, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(n, dtype=np.float32)
    # The pass's own reordering (a Relax function of the weight), run as the build runs it.
    reorder = relax.BlockBuilder()
    weight, bias = relax.Var("w", relax.TensorType((k, n), "float32")), relax.Var("b", relax.TensorType((n,), "float32"))
    with reorder.function("main", [weight, bias]):
        reorder.emit_func_output(relax.Tuple([reorder.emit(gates_beside_inputs(weight, 0, amx.TILE // 2)),
                                              reorder.emit(gates_beside_inputs(bias, 0, amx.TILE // 2))]))
    machine = relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(reorder.get()), target="llvm"), tvm.cpu())
    w_ordered, b_ordered = (a.numpy() for a in machine["main"](tvm.runtime.tensor(w.astype(np.float32)), tvm.runtime.tensor(b)))
    packed = np.ascontiguousarray(w_ordered.astype(ml_dtypes.bfloat16).reshape(k // 2, 2, n // 16, 16).transpose(2, 0, 3, 1))
    kernel = amx.bf16_kernel(96, n, k, lead, "relax.nn.gelu", False, out_dtype, 3 * 32 * k * 2, gated=True)
    library = tvm.compile(tvm.IRModule({"main": kernel}), target=targets.resolve("llvm").tvm_target())
    y = tvm.runtime.tensor(np.zeros((*lead, n // 2), ml_dtypes.bfloat16 if out_dtype == "bfloat16" else "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (x, packed, b_ordered, np.zeros(1, "float32"))), y)
    total = x.astype(np.float64) @ w.astype(np.float64) + b
    activated, gate = total[..., :n // 2], total[..., n // 2:]
    expected = activated * (1 + np.vectorize(math.erf)(activated / math.sqrt(2))) / 2 * gate
    tolerance = 2.0 ** -7 if out_dtype == "bfloat16" else 1e-5
    assert np.abs(y.numpy().astype(np.float64) - expected).max() <= tolerance * np.abs(expected).max()


@pytest.mark.amx
def test_bf16_runs_its_matmuls_on_amx(tvmbert, workdir):
    from tvmbert.deploy.weights import load_params

    outcome = tvmbert("verify", "bert-tiny", "--dtype", "bfloat16", "--json")
    assert outcome.code == 0, outcome.stderr
    # Against fp32 PyTorch: measured 1.4e-3 (bf16 keeps 8 mantissa bits).
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-2
    optimized = tvmbert("optimize", "bert-tiny", "--dtype", "bfloat16", "--json")
    assert "amx-bf16" in optimized.json["passes"]
    (stage,) = workdir.glob("bert-tiny/b1-s14-bfloat16/llvm-*/build/stage.json")
    meta = json.loads(stage.read_text())
    meta = meta.get("meta", meta)
    # Every weight matmul of a layer (QKV, attention output, FFN up and down; 1 x 14 padded to
    # 32 rows) and the pooler, and the instructions are in the library.
    assert len(meta["amx_kernels"]) == 4 and meta["amx_instructions"]["tdpbf16ps"] > 0
    assert not any(name.startswith("amx_") for name in meta["schedules"])  # no task: nothing to tune
    shapes = [a.shape for a in load_params(stage.parent / "params.npz").values() if a.dtype.name == "bfloat16"]
    assert (384 // 16, 128 // 2, 16, 2) in shapes  # the QKV weight, packed in AMX's layout at build time


@pytest.mark.amx
def test_bf16_attention_runs_on_bf16_tiles_and_layer_norms_on_the_fp32_kernel(tvmbert, workdir):
    # The weight matmuls and attention's two matmuls run in bf16 on tiles; layer norm stays fp32.
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "bfloat16", "--batch", "2", "--seq-len", "32", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-2
    (stage,) = workdir.glob("bert-tiny/b2-s32-bfloat16/llvm-*/build/stage.json")
    meta = json.loads(stage.read_text())
    meta = meta.get("meta", meta)
    # the AMX kernel's rows, not panel-major; its scores one bf16 product, as PyTorch's bf16 model's;
    # its result in bf16, for the output projection
    assert meta["attention_kernels"] == ["attention_2x2x32x64_masked_amx_bf16_scores_to_bfloat16"]
    assert meta["attention_kernels"][0] in meta["amx_kernels"]
    assert meta["layer_norm_kernels"] == ["layer_norm_2x32x128"]  # the residual adds stay in the AMX kernels


def test_bf16_attention_for_an_amx_cpu_is_built_on_bf16_tiles(tvmbert, workdir):
    """Compiled only, on any host (run for real above, on AMX hosts): a bf16 build for an AMX CPU
    takes attention's AMX kernel where its tiles fit, writing bf16 for the output projection, and
    the fp32 one where they do not (48 tokens), whose result a kernel of its own casts, a layer each."""
    target = "llvm -mcpu=sapphirerapids"
    casts = {}
    for seq_len, expected in (("32", ["attention_1x2x32x64_masked_amx_bf16_scores_to_bfloat"]), ("48", ["attention_1x2x48x64_masked"])):
        outcome = tvmbert("optimize", "bert-tiny", "--dtype", "bfloat16", "--seq-len", seq_len, "--target", target, "--json")
        assert outcome.code == 0, outcome.stderr
        assert sorted(name[len("tir:"):] for name in outcome.json["ops_after"] if name.startswith("tir:attention")) == expected
        casts[seq_len] = sum(count for name, count in outcome.json["ops_after"].items() if "cast" in name)
    assert casts["32"] == casts["48"] - 2  # bert-tiny's two layers


def test_bf16_is_refused_for_a_cpu_without_amx(tvmbert):
    outcome = tvmbert("build", "bert-tiny", "--dtype", "bfloat16", "--target", "llvm -mcpu=skylake-avx512")
    assert outcome.code == 2
    assert "error: --dtype bfloat16 needs a CPU with AMX-BF16" in outcome.stderr
    assert "llvm-skylake-avx512" in outcome.stderr and "--dtype float32" in outcome.stderr
    assert "Traceback" not in outcome.stderr


@pytest.mark.amx
def test_bf16_matmuls_the_kernel_does_not_fit_keep_their_loop_nest(tvmbert, workdir):
    # A 2-label classifier (N = 2, not a multiple of 32) keeps the bf16 loop nest; the rest runs on AMX.
    outcome = tvmbert("verify", "bert-tiny", "--task", "text-classification", "--dtype", "bfloat16", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-2
    (stage,) = workdir.glob("bert-tiny-text-classification/b1-s14-bfloat16/llvm-*/build/stage.json")
    meta = json.loads(stage.read_text())
    assert len(meta.get("meta", meta)["amx_kernels"]) == 4


@pytest.mark.amx
def test_bench_in_bf16_runs_the_pytorch_peers_in_bf16(tvmbert):
    outcome = tvmbert("bench", "bert-tiny", "--dtype", "bfloat16", "--engines", "tvm,torch-eager,onnxruntime",
                      "--repeat", "3", "--min-time", "0", "--warmup", "1", "--json")
    assert outcome.code == 0, outcome.stderr
    report = outcome.json
    # Every engine checked against fp32 PyTorch eager, within the bench's bound, and timed.
    assert all("median_ms" in stats and stats["accuracy"]["within"] for stats in report["engines"].values()), report["engines"]
    assert report["engine_dtypes"]["torch-eager"].startswith("bfloat16")
    assert report["engine_dtypes"]["onnxruntime"] == "float32"
    assert "AMX" in report["engine_dtypes"]["tvm"]


@pytest.mark.amx
@pytest.mark.amx_int8
@pytest.mark.parametrize("dtype, kernel", [("bfloat16", "amx_bf16_matmul_64x192x64_gelu_gated_to_bfloat16"),
                                           ("int8", "int8_matmul_64x192x64_gelu_gated")])
def test_modernberts_geglu_runs_in_its_amx_kernel(tvmbert, workdir, dtype, kernel):
    """Wi's AMX kernel applies GeGLU and writes its half of the columns (bf16 ones where the next
    matmul reads bf16): no split, GELU or multiply kernel over the sum's columns."""
    import re

    args = ("modernbert-tiny", "--dtype", dtype, "--batch", "2", "--seq-len", "32")
    built = tvmbert("build", *args, "--json")
    assert built.code == 0, built.stderr
    assert kernel in built.json["amx_kernels"], built.json["amx_kernels"]
    optimized = next(workdir.glob(f"modernbert-tiny/b2-s32-{dtype}/optimize/module.py")).read_text()
    called = set(re.findall(r"R\.call_tir\(cls\.(\w+)", optimized.split("def main(")[1]))
    assert not any("gelu" in name or "split" in name for name in called if not name.startswith(("amx_", "int8_"))), called
    verified = tvmbert("verify", *args, "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr

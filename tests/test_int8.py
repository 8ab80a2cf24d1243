"""--dtype int8: the kernels against a NumPy model of the same quantization (exact in int32), the
AVX-512 variant compiled, bert-tiny through every stage against fp32 PyTorch, the int8 peers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvmbert import JobConfig, load
from tvmbert.kernels import int8
from tvmbert.stages.bench.engines import check_tolerance, default_engines
from tvmbert.stages.bench.timing import _ratios
from tvmbert.stages.export import export

from helpers import HOST, HOST_LANES, build_meta


def quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy model of the row quantization: symmetric, max |x| -> 127, half to even."""
    top = np.abs(x).max(axis=-1)
    inverse = np.where(top > 0, np.float32(int8.LEVELS) / np.where(top > 0, top, 1), 0).astype(np.float32)
    return np.rint(x * inverse[..., None]).astype(np.int16), (top / np.float32(int8.LEVELS)).astype(np.float32)


def weight_layout(wq: np.ndarray, width: int) -> np.ndarray:
    k, n = wq.shape
    return np.ascontiguousarray(wq.reshape(k // 2, 2, n // width, width).transpose(2, 0, 3, 1).reshape(n // width, k // 2, width * 2))


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("lead, n, k", [
    ((7,), 48, 64),  # AVX2: 3 x 3 tiles, two of them and one of a row; 2 panels
    ((2, 9), 96, 40),  # AVX-512: 6 x 4 tiles (3 of them); AVX2: 4 panels; K in blocks of 4 pairs
    ((300,), 16, 32),  # AVX2: one-vector panels of 100 row tiles: no prefetch
])
@pytest.mark.parametrize("activation, residual", [(None, False), ("relax.nn.gelu", False), (None, True)])
def test_int8_kernel_sums_exactly_what_numpy_sums(lanes, lead, n, k, activation, residual):
    import tvm

    if int8.tile(n, lanes) is None:
        pytest.skip("N is not a multiple of the lanes")
    m = int(np.prod(lead))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((*lead, k), dtype=np.float32) * 4
    x[0] = 0  # a row of zeros: scale 0, no division by it
    w = rng.standard_normal((k, n), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal((*lead, n) if residual else (1,), dtype=np.float32)
    sw = (np.abs(w).max(0) / int8.LEVELS).astype(np.float32)
    wq = np.clip(np.rint(w / sw), -int8.LEVELS, int8.LEVELS).astype(np.int8)
    rows, vectors = int8.tile(n, lanes)

    module = tvm.IRModule({"quantize": int8.quantize_rows_kernel(m, k, lanes, lead).with_attr("global_symbol", "quantize"),
                           "matmul": int8.kernel(m, n, k, lanes, lead, activation, residual).with_attr("global_symbol", "matmul")})
    library = tvm.compile(module, target=HOST)
    xq, sx = tvm.runtime.tensor(np.zeros((*lead, k), "int16")), tvm.runtime.tensor(np.zeros(m, "float32"))
    library["quantize"](tvm.runtime.tensor(x), xq, sx)
    want_xq, want_sx = quantized_rows(x)
    np.testing.assert_array_equal(xq.numpy(), want_xq)
    np.testing.assert_array_equal(sx.numpy(), want_sx.reshape(-1))
    assert np.abs(want_xq).max() == int8.LEVELS

    y = tvm.runtime.tensor(np.zeros((*lead, n), "float32"))
    library["matmul"](xq, sx, *(tvm.runtime.tensor(a) for a in (weight_layout(wq, vectors * lanes), sw, b, r)), y)
    sums = want_xq.reshape(m, k).astype(np.int64) @ wq.astype(np.int64)  # what the int32 lanes must hold, exactly
    expected = (sums.astype(np.float32) * (want_sx.reshape(m, 1) * sw) + b).reshape(*lead, n).astype(np.float64)
    if activation:
        expected = expected * (1 + np.vectorize(math.erf)(expected / math.sqrt(2))) / 2
    if residual:
        expected = expected + r
    # float32 rounding of the dequantization alone: a wrong int32 sum is off by a whole step sx * sw
    assert np.abs(y.numpy() - expected).max() <= 1e-5 * np.abs(expected).max()
    reference = (x.astype(np.float64) @ w + b)  # and near fp32's, as int8 goes
    if not activation and not residual:
        assert np.abs(y.numpy() - reference).max() < 0.05 * np.abs(reference).max()


def test_the_avx512_kernel_compiles_to_512_bit_pair_products():
    """Only compiled: this host may lack AVX-512."""
    import tvm

    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    executable = tvm.tirx.build(tvm.IRModule({"main": int8.kernel(14, 96, 64, 16, activation="relax.nn.gelu")}), target=target)
    assembly = executable.inspect_source("asm")
    assert "vpmaddwd\t%zmm" in assembly and "vpmovsxbw" in assembly


@pytest.mark.simd
def test_bert_tiny_in_int8_builds_verifies_and_keeps_the_rest_fp32(tvmbert, workdir):
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "int8", "--batch", "2", "--seq-len", "10", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["dtype"] == "int8"
    assert 1e-4 < outcome.json["max_abs_diff"] < 0.05  # quantized (not fp32), and close
    metrics = {m["name"]: m["value"] for m in outcome.json["accuracy"]}
    assert metrics["cosine_min"] > 0.999
    meta = build_meta(workdir, "b2-s10-int8")
    # Q/K/V, attention output, FFN in (with its GELU) and out, and the pooler (2 rows): every weight matmul
    assert len(meta["int8_kernels"]) == 5 and meta["int8_quantize_kernels"] and "fma_kernels" not in meta
    assert meta["layer_norm_kernels"]  # fp32, as in a float32 build


def test_the_int8_kernels_width_follows_the_pair_product_the_target_has():
    from tvmbert.core.targets import resolve

    lanes = {cpu: resolve(f"llvm -mcpu={cpu}").int8_lanes for cpu in ("skylake-avx512", "knl", "haswell", "x86-64")}
    assert lanes == {"skylake-avx512": 16, "knl": 8, "haswell": 8, "x86-64": 0}  # knl: AVX512F without BW


def test_int8_needs_our_x86_kernels(tvmbert):
    refused = tvmbert("build", "bert-tiny", "--dtype", "int8", "--target", "cuda -arch=sm_80")
    assert refused.code == 2 and "--dtype int8 runs on our x86 kernels" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_int8_peers_run_for_int8_and_tvm_is_compared_with_them():
    assert {"ort-int8", "openvino-int8"} <= set(default_engines("int8"))
    assert not {"ort-int8", "openvino-int8"} & set(default_engines("float32"))
    assert check_tolerance("ort-int8", "float32") == check_tolerance("tvm", "int8")
    engines = {"tvm": {"median_ms": 5.0}, "onnxruntime": {"median_ms": 4.0}, "ort-int8": {"median_ms": 6.0},
               "openvino-int8": {"median_ms": 10.0}}
    assert _ratios(engines, "int8")["best_other"] == "ort-int8" and _ratios(engines, "int8")["ratio"] == pytest.approx(5 / 6, abs=1e-3)
    assert _ratios(engines, "float32")["best_other"] == "onnxruntime"
    assert _ratios({"tvm": {"median_ms": 5.0}, "onnxruntime": {"median_ms": 4.0}}, "int8")["best_other"] == "onnxruntime"


@pytest.mark.simd
def test_an_int8_package_serves_what_the_int8_build_computes(tmp_path, workdir):
    import torch

    from tvmbert.frontend import models

    out = tmp_path / "int8"
    export(JobConfig(model="bert-tiny", dtype="int8", workdir=str(workdir)), out, batches=(2,), seq_lens=(16,))
    package = load(out)
    rng = np.random.default_rng(2)
    ids = rng.integers(5, 1000, (2, 16))
    mask = np.ones((2, 16), np.int64)
    mask[1, 9:] = 0
    got = package(ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))["last_hidden_state"]
    with torch.no_grad():
        want = models.load(models.resolve("bert-tiny"))(*(torch.from_numpy(a) for a in (ids, mask, np.zeros_like(ids))))[0].numpy()
    real = mask.astype(bool)
    assert 1e-4 < np.abs(got[real] - want[real]).max() < 0.05

"""fp32 layer norm as one kernel: its numerics against float64 (rows far from zero mean, where
E[x^2] - mean^2 would lose digits; every accumulator count), and bert-tiny through it."""

from __future__ import annotations

import numpy as np
import pytest

from tvmbert.kernels import fma, layer_norm

from helpers import HOST, HOST_LANES, HOST_TARGET, heap_buffers


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("lead, n", [((2, 7), 768), ((5,), 48), ((3,), 32), ((1,), 16)])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_kernel_matches_float64(lanes, lead, n, residual):
    import tvm

    if n % lanes:
        pytest.skip("n is not a multiple of the lanes")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((*lead, n)) + 300).astype(np.float32)  # mean far from 0: two passes keep the digits
    gamma, beta = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal(x.shape, dtype=np.float32) if residual else np.zeros(1, "float32")
    library = tvm.compile(tvm.IRModule({"main": layer_norm.kernel(int(np.prod(lead)), n, lanes, 1e-12, lead, residual)}),
                          target=HOST)
    y = tvm.runtime.tensor(np.zeros(x.shape, "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (x, r, gamma, beta)), y)
    wide = (x + r).astype(np.float64) if residual else x.astype(np.float64)  # the sum in fp32, as the graph adds
    mean = wide.mean(-1, keepdims=True)
    expected = (wide - mean) / np.sqrt(((wide - mean) ** 2).mean(-1, keepdims=True) + 1e-12) * gamma + beta
    np.testing.assert_allclose(y.numpy(), expected, atol=1e-4)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
def test_a_quantizing_norm_stores_what_the_norm_then_the_row_quantization_store(lanes):
    """The norm that quantizes its rows for an int8 matmul (ModernBERT's pre-norm layers) gives
    the int8 kernel's rows and scales bit for bit as the two kernels did one after the other: a
    row of zeros (scale 0), rows far from zero mean."""
    import tvm

    from tvmbert.kernels import int8

    lead, n = (2, 7), 768
    m = int(np.prod(lead))
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((*lead, n)) * 3 + 40).astype(np.float32)
    x[1, 3] = 5  # a constant row: every value the mean, normalized to beta
    gamma, beta = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    beta_zero = np.zeros(n, "float32")
    module = tvm.IRModule({
        "norm": layer_norm.kernel(m, n, lanes, 1e-5, lead).with_attr("global_symbol", "norm"),
        "quantize": int8.quantize_rows_kernel(m, n, lanes, lead).with_attr("global_symbol", "quantize"),
        "both": layer_norm.kernel(m, n, lanes, 1e-5, lead, quantized=True).with_attr("global_symbol", "both")})
    library = tvm.compile(module, target=HOST)
    for shift in (beta, beta_zero):  # with beta zero the constant row is zeros
        y = tvm.runtime.tensor(np.zeros(x.shape, "float32"))
        library["norm"](*(tvm.runtime.tensor(a) for a in (x, np.zeros(1, "float32"), gamma, shift)), y)
        outputs = {}
        for name, operands in (("quantize", (y,)), ("both", tuple(tvm.runtime.tensor(a) for a in (x, gamma, shift)))):
            xq, sx = tvm.runtime.tensor(np.zeros(x.shape, int8.ROWS_DTYPE)), tvm.runtime.tensor(np.ones(m, "float32"))
            library[name](*operands, xq, sx)
            outputs[name] = (xq.numpy(), sx.numpy())
        np.testing.assert_array_equal(outputs["both"][0], outputs["quantize"][0])
        np.testing.assert_array_equal(outputs["both"][1], outputs["quantize"][1])
        assert (outputs["both"][1][10] == 0) == (shift is beta_zero) and len(np.unique(outputs["both"][0])) > 200


@pytest.mark.simd
def test_per_row_buffers_stay_off_the_heap():
    """On the heap they were allocated and freed for every row (bert-base 8 x 128's norm with the
    residual add alone: 400 -> 325 µs)."""
    import tvm

    library = tvm.compile(tvm.IRModule({"main": layer_norm.kernel(14, 768, HOST_LANES, 1e-12, residual=True)}),
                          target=HOST)
    assert heap_buffers(library) == []


def test_sizes_off_the_vector_lanes_keep_the_graph():
    assert layer_norm.fits(768, 16) and layer_norm.fits(24, 8)
    assert not layer_norm.fits(24, 16) and not layer_norm.fits(768, 0)


@pytest.mark.simd
def test_bert_tiny_layer_norms_run_on_the_kernel(tvmbert):
    outcome = tvmbert("optimize", "bert-tiny", "--seq-len", "32", "--json")
    assert outcome.code == 0, outcome.stderr
    ours = {name: count for name, count in outcome.json["ops_after"].items() if name.startswith("tir:layer_norm_")}
    assert sum(ours.values()) == 5 and "tir:layer_norm" not in outcome.json["ops_after"]  # the embeddings' and 2 a layer
    # the adds before every norm are the norm kernel's (the layers' residuals, not the matmuls'
    # epilogues; at batch 1 the embeddings' last sum too, the position embeddings of its shape)
    assert sum(count for name, count in ours.items() if name.endswith("_residual")) == 5
    assert not any(name.startswith("tir:fma_") and name.endswith("_residual") for name in outcome.json["ops_after"])
    verified = tvmbert("verify", "bert-tiny", "--seq-len", "32", "--json")
    assert verified.code == 0 and verified.json["passed"], verified.stderr
    outcome = tvmbert("optimize", "bert-tiny", "--seq-len", "32", "--disable", "layer-norm-fp32", "--json")
    assert outcome.json["ops_after"].get("tir:layer_norm") == 5
    few_rows = tvmbert("optimize", "bert-tiny", "--json")  # 1 x 14: our kernel, unless this CPU's own records win there
    on_ours = sum(count for name, count in few_rows.json["ops_after"].items() if name.startswith("tir:layer_norm_"))
    assert (on_ours, few_rows.json["ops_after"].get("tir:layer_norm", 0)) == ((5, 0) if fma.min_rows(HOST_TARGET.key) <= 14 else (0, 5))

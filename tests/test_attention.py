"""fp32 attention as one kernel: its numerics against float64 (masks of every broadcast, a fused
Q/K/V projection's columns and separate operands, a fully masked row), and bert-tiny through it
against PyTorch, where it applies and where it does not; the same for its AMX-BF16 variant (int8
builds on AMX), against float64 with bf16's rounding of what it rounds, and its int8 variant (int8
builds on AVX-512 VNNI) against its quantization done in NumPy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tvmbert.kernels import attention, int8

from helpers import HOST, HOST_LANES, HOST_TARGET, QKV_PANEL, build_meta, emulated_quads, heap_buffers, quantized_rows

MASKED = np.finfo(np.float32).min  # what transformers adds for a masked key


def _reference(q, k, v, mask, scale):
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) * scale
    if mask is not None:
        scores = scores + mask
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    return (scores / scores.sum(-1, keepdims=True)) @ v.astype(np.float64)


def _bf16(values):
    """float32 rounded to bf16, half to even, kept in float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def _heads(columns, batch, seq, heads, dim, offset):  # [B * S, C] columns -> [B, H, S, D]
    return columns[:, offset:offset + heads * dim].reshape(batch, seq, heads, dim).transpose(0, 2, 1, 3)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("batch, heads, seq, dim", [(2, 3, 32, 16), (1, 2, 48, 32), (3, 1, 16, 64), (2, 1, 24, 16), (1, 1, 64, 16)])
@pytest.mark.parametrize("mask_shape", ["keys", "rows", None])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_kernel_matches_float64(lanes, batch, heads, seq, dim, mask_shape, fused):
    """The softmax takes 4, 2 or 1 vectors a step (at 8 lanes: 32 or 64, 16 or 48, and 24 tokens;
    at 16 lanes: 64, 32, and 16 or 48)."""
    import tvm

    if not attention.fits(seq, dim, lanes):
        pytest.skip(f"{seq} tokens are not whole {lanes}-lane vectors")

    rng = np.random.default_rng(0)
    width = heads * dim
    scale = 1 / np.sqrt(dim) if fused else None
    if fused:  # one [tokens, 3 x heads x dim] projection (plus a column more), Q, K and V at offsets
        columns = rng.standard_normal((batch * seq, 3 * width + lanes), dtype=np.float32)
        operands = [columns] * 3
        sources = [(3 * width + lanes, lanes + i * width) for i in range(3)]
    else:
        operands = [rng.standard_normal((batch * seq, width), dtype=np.float32) for _ in range(3)]
        sources = [(width, 0)] * 3
    q, k, v = (_heads(a, batch, seq, heads, dim, offset) for a, (_, offset) in zip(operands, sources))
    mask = None
    if mask_shape:
        shape = (batch, 1, 1, seq) if mask_shape == "keys" else (batch, 1, seq, seq)
        mask = np.where(rng.random(shape) < 0.3, MASKED, 0).astype(np.float32)
        mask[..., 0] = 0  # every row keeps a key (the all-masked row has its own test)
    library = tvm.compile(tvm.IRModule({"main": attention.kernel(batch, heads, seq, dim, lanes, sources,
                                                                  mask.shape if mask is not None else None, scale)}),
                          target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    placeholder = mask if mask is not None else np.zeros(1, "float32")
    library["main"](*(tvm.runtime.tensor(a) for a in (*operands, placeholder, np.zeros(1, "int32"))), y)
    expected = _reference(q, k, v, mask, scale if scale is not None else 1.0).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y.numpy(), expected, atol=2e-6, rtol=1e-5)
    assert "expf" not in library.mod.inspect_source("asm")  # the softmax's exp is the vectorized polynomial


@pytest.mark.simd
@pytest.mark.parametrize("seq, window", [(512, 64), (1024, 64), (256, 20)])
def test_a_windowed_kernel_scores_each_blocks_span_alone_and_matches_float64(seq, window):
    """ModernBERT's local layers: a block of query rows keeps the scores of its span alone (its
    rows and the window either side, on two-vector blocks), so that blocks stay 32 rows at any
    length; keys beyond the window and the key padding masked, as the graph's mask does."""
    import tvm

    batch, heads, dim = 2, 2, 64
    rows, span = attention.window_block(seq, window, 2 * HOST_LANES)
    assert span <= rows + 2 * window + 4 * HOST_LANES and rows * span * 4 <= attention.SCORES_BYTES and rows >= 16
    rng = np.random.default_rng(4)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    padding = np.where(rng.random((batch, 1, 1, seq)) < 0.2, MASKED, 0).astype(np.float32)
    scale = 1 / np.sqrt(dim)
    kernel = attention.kernel(batch, heads, seq, dim, HOST_LANES, sources, padding.shape, scale, window=window)
    library = tvm.compile(tvm.IRModule({"main": kernel}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, padding, np.zeros(1, "int32"))), y)
    q, k, v = (_heads(columns, batch, seq, heads, dim, offset) for _, offset in sources)
    positions = np.arange(seq)
    mask = np.where(np.abs(positions[:, None] - positions[None, :]) <= window, padding, MASKED)  # [batch, 1, seq, seq]
    counted = (mask > MASKED).any(-1)[:, 0]  # queries with a key in their window (the others' outputs are unused)
    expected = _reference(q, k, v, mask, scale).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y.numpy()[counted], expected[counted], atol=2e-6, rtol=1e-5)


@pytest.mark.simd
@pytest.mark.parametrize("seq, mask_shape", [(512, "rows"), (1024, "keys")])
def test_long_sequences_run_a_block_of_query_rows_at_a_time_and_match_float64(seq, mask_shape):
    """Past 128 tokens a head's scores are done a block of query rows at a time (what stays in
    L2); each block reads its own rows of the mask and writes its own rows of the output."""
    import tvm

    batch, heads, dim = 2, 2, 64
    assert attention.query_block(seq) < seq
    rng = np.random.default_rng(1)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    shape = (batch, 1, seq, seq) if mask_shape == "rows" else (batch, 1, 1, seq)
    mask = np.where(rng.random(shape) < 0.3, MASKED, 0).astype(np.float32)
    mask[..., 0] = 0
    scale = 1 / np.sqrt(dim)
    library = tvm.compile(tvm.IRModule({"main": attention.kernel(batch, heads, seq, dim, HOST_LANES, sources, shape, scale)}),
                          target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, np.zeros(1, "int32"))), y)
    q, k, v = (_heads(columns, batch, seq, heads, dim, offset) for _, offset in sources)
    np.testing.assert_allclose(y.numpy(), _reference(q, k, v, mask, scale).transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("seq", [80, 128, 256])
def test_keys_a_block_at_a_time_keep_a_running_softmax(monkeypatch, lanes, seq):
    """Past KEY_BLOCK keys (32 here) each block of keys rescales the row max, sum and output of
    the blocks before it (flash attention's online softmax): rows whose first two blocks are all
    masked, rows whose later blocks all are, a last block shorter than the rest, several blocks of
    query rows (scores within 4 KiB), against float64."""
    import tvm

    monkeypatch.setattr(attention, "KEY_BLOCK", 32)
    monkeypatch.setattr(attention, "SCORES_BYTES", 4096)
    batch, heads, dim = 2, 2, 16
    align = attention.key_alignment(seq, lanes)
    assert attention.key_block(seq, align) < seq and attention.query_block(seq, attention.key_block(seq, align)) < seq
    rng = np.random.default_rng(2)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    mask = np.where(rng.random((batch, 1, seq, seq)) < 0.3, MASKED, 0).astype(np.float32)
    mask[:, :, 64:, :64] = MASKED  # the first two blocks of these rows' keys: the running max starts at the mask
    mask[:, :, :8, 32:] = MASKED  # every block of these rows' keys but the first: the later blocks change nothing
    mask[:, :, np.arange(seq), np.arange(seq)] = 0  # every row keeps a key
    scale = 1 / np.sqrt(dim)
    function = attention.kernel(batch, heads, seq, dim, lanes, sources, mask.shape, scale)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, np.zeros(1, "int32"))), y)
    q, k, v = (_heads(columns, batch, seq, heads, dim, offset) for _, offset in sources)
    np.testing.assert_allclose(y.numpy(), _reference(q, k, v, mask, scale).transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("seq, terms", [(32, "c2p,p2c"), (96, "c2p,p2c"), (32, "c2p"), (32, "p2c")])
@pytest.mark.parametrize("computed", [False, True])
def test_debertas_position_scores_are_gathered_where_the_kernel_scores(monkeypatch, lanes, seq, terms, computed):
    """Query i's score of key j gains c2p[i, query_table[i - j + S - 1]] / c and p2c[j,
    key_table[j - i + S - 1]] / c (the tables of different columns, so that a term read with
    the other's table, or transposed, fails), with either term alone, and at 96 tokens over
    blocks of keys and of query rows (KEY_BLOCK 32, scores within 4 KiB), against float64. The
    products come made, or the kernel makes them from Q, K and each head's position projections
    (c2p = Q Wq, p2c = K Wk), c2p a block of query rows at a time."""
    import tvm

    monkeypatch.setattr(attention, "KEY_BLOCK", 32)
    monkeypatch.setattr(attention, "SCORES_BYTES", 4096)
    batch, heads, dim, width = 2, 2, 16, 32 if computed else 11
    rng = np.random.default_rng(4)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    q, k, v = (_heads(columns, batch, seq, heads, dim, offset) for _, offset in sources)
    mask = np.where(rng.random((batch, 1, seq, seq)) < 0.2, MASKED, 0).astype(np.float32)
    mask[:, :, np.arange(seq), np.arange(seq)] = 0
    if computed:  # each head's position projections, and the products they make
        operands = [rng.standard_normal((heads, dim, width), dtype=np.float32) for _ in range(2)]
        products = [(rows.astype(np.float64) @ weights).reshape(batch * heads, seq, width).astype(np.float32)
                    for rows, weights in zip((q, k), operands)]
    else:
        operands = products = [rng.standard_normal((batch * heads, seq, width), dtype=np.float32) for _ in range(2)]
    tables = [rng.integers(0, width, 2 * seq - 1) for _ in range(2)]
    factor = 1 / np.sqrt(3 * dim)
    c2p, p2c = ("c2p" in terms, "p2c" in terms)
    positions = attention.Positions(factor if c2p else None, factor if p2c else None, width if c2p else 1, width if p2c else 1, computed)
    function = attention.kernel(batch, heads, seq, dim, lanes, sources, mask.shape, factor, positions=positions)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    unread = np.zeros(1, "float32")
    inputs = (columns, columns, columns, mask, np.zeros(1, "int32"), operands[0] if c2p else unread, operands[1] if p2c else unread,
              attention.Positions.index(*tables))
    library["main"](*(tvm.runtime.tensor(a) for a in inputs), y)
    i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    scores = np.zeros((batch * heads, seq, seq))
    if c2p:
        scores += products[0].astype(np.float64)[:, i, tables[0][i - j + seq - 1]] * factor
    if p2c:
        scores += products[1].astype(np.float64)[:, j, tables[1][j - i + seq - 1]] * factor
    bias = mask + scores.reshape(batch, heads, seq, seq)
    np.testing.assert_allclose(y.numpy(), _reference(q, k, v, bias, factor).transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.amx
def test_the_amx_kernel_gathers_debertas_position_scores_as_a_mask_would_add_them():
    """The AMX kernel (int8 builds) with the position scores gathered, against itself with them
    added to the mask in numpy: the same up to fp32 rounding, which the probabilities' bf16 can
    turn into a step of 2^-8 of one of them."""
    import tvm

    batch, heads, seq, dim, width = 2, 2, 64, 32, 13
    rng = np.random.default_rng(6)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    mask = np.where(rng.random((batch, 1, seq, seq)) < 0.2, MASKED, 0).astype(np.float32)
    mask[:, :, np.arange(seq), np.arange(seq)] = 0
    products = [rng.standard_normal((batch * heads, seq, width), dtype=np.float32) for _ in range(2)]
    tables = [rng.integers(0, width, 2 * seq - 1) for _ in range(2)]
    factor = 1 / np.sqrt(3 * dim)
    i, j = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    bias = (products[0][:, i, tables[0][i - j + seq - 1]] * np.float32(factor)
            + products[1][:, j, tables[1][j - i + seq - 1]] * np.float32(factor)).reshape(batch, heads, seq, seq)
    results = []
    for positions, operands in ((attention.Positions(factor, factor, width, width),
                                 (mask, np.zeros(1, "int32"), *products, attention.Positions.index(*tables))),
                                (None, (mask + bias, np.zeros(1, "int32")))):
        shape = operands[0].shape
        function = attention.amx_bf16_kernel(batch, heads, seq, dim, 16, sources, shape, factor, positions=positions)
        library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
        y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
        library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, *operands)), y)
        results.append(y.numpy())
    np.testing.assert_allclose(results[0], results[1], atol=2e-2)
    assert np.mean(np.abs(results[0] - results[1]) > 1e-5) < 0.01


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
def test_only_a_heads_operands_and_scores_take_the_heap(lanes):
    """The register tiles' accumulators and the softmax's partials on the stack, in registers (a
    heap workspace is zeroed and stored at every tile: bert-base 8 x 128 alone 2.20 -> 2.08 ms)."""
    import tvm

    function = attention.kernel(2, 2, 32, 64, lanes, [(128, 0)] * 3, (2, 1, 1, 32), 0.125)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    assert sorted(heap_buffers(library)) == ["block", "kt", "scores", "vh"]


@pytest.mark.amx
@pytest.mark.parametrize("bf16_scores", [False, True])
def test_a_windowed_amx_kernel_matches_float64_within_bf16(bf16_scores):
    """ModernBERT's local layers on tiles: only the key blocks near the window are scored, and a key
    beyond it, or padding, weighs 2^-125 of its row (the exp's floor: float64's exact 0 by any
    measure of fp32), against float64 with P and V in bf16 as the kernel's P V takes them."""
    import tvm

    batch, heads, seq, dim, window = 1, 2, 256, 64, 64
    rng = np.random.default_rng(8)
    columns = rng.standard_normal((seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    padding = np.zeros((batch, 1, 1, seq), np.float32)
    padding[..., -20:] = MASKED
    function = attention.amx_bf16_kernel(batch, heads, seq, dim, 16, sources, padding.shape, 0.125, window=window,
                                         bf16_scores=bf16_scores)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, padding, np.zeros(1, "int32"))), y)
    q, k, v = (_heads(columns, batch, seq, heads, dim, offset) for _, offset in sources)
    if bf16_scores:
        q, k = _bf16(q), _bf16(k)
    positions = np.arange(seq)
    mask = np.where(np.abs(positions[:, None] - positions[None, :]) <= window, padding[0, 0], MASKED)
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) * 0.125 + mask
    weights = _bf16(np.exp(scores - scores.max(-1, keepdims=True))).astype(np.float64)
    expected = weights @ _bf16(v) / weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(y.numpy(), expected.transpose(0, 2, 1, 3), atol=2 ** -8 * np.abs(v).max(), rtol=0)


@pytest.mark.amx
def test_the_amx_kernel_writing_bf16_rounds_what_it_would_write_in_fp32():
    """A bf16 build's attention writes its result in bf16 for the output projection (no cast
    kernel after it): each value its fp32 result rounded half to even, nothing else changed."""
    import ml_dtypes
    import tvm

    batch, heads, seq, dim = 2, 2, 64, 64
    rng = np.random.default_rng(7)
    columns = rng.standard_normal((batch * seq, 3 * heads * dim), dtype=np.float32)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    mask = np.where(rng.random((batch, 1, 1, seq)) < 0.3, MASKED, 0).astype(np.float32)
    results = {}
    for dtype in ("float32", "bfloat16"):
        function = attention.amx_bf16_kernel(batch, heads, seq, dim, 16, sources, mask.shape, 0.125, bf16_scores=True, out_dtype=dtype)
        library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
        y = tvm.runtime.empty((batch, seq, heads, dim), dtype)
        library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, np.zeros(1, "int32"))), y)
        results[dtype] = y.numpy()
    rounded = results["float32"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(results["bfloat16"].view(np.uint16), rounded.view(np.uint16))


@pytest.mark.parametrize("on_amx", [pytest.param(False, marks=pytest.mark.simd), pytest.param(True, marks=pytest.mark.amx)])
def test_a_row_with_every_key_masked_averages_the_values_as_pytorch_does(on_amx):
    """Every weight of the row is then 1: the values' mean (the AMX kernel's values in bf16)."""
    import torch
    import tvm

    batch, heads, seq, dim = (1, 2, 32, 32) if on_amx else (1, 2, 16, 16)
    rng = np.random.default_rng(5 if on_amx else 1)
    columns = rng.standard_normal((seq, 3 * heads * dim), dtype=np.float32)
    mask = np.zeros((batch, 1, seq, seq), np.float32)
    mask[0, 0, 3] = MASKED
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    make, lanes = (attention.amx_bf16_kernel, 16) if on_amx else (attention.kernel, HOST_LANES)
    library = tvm.compile(tvm.IRModule({"main": make(batch, heads, seq, dim, lanes, sources, mask.shape, 0.25)}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, np.zeros(1, "int32"))), y)
    q, k, v = (torch.from_numpy(np.ascontiguousarray(_heads(columns, batch, seq, heads, dim, o))) for _, o in sources)
    if not on_amx:  # (the AMX kernel's whole result: test_amx_attention_matches_float64_within_bf16_probabilities_and_values)
        expected = torch.softmax(q @ k.transpose(2, 3) * 0.25 + torch.from_numpy(mask), -1) @ v
        np.testing.assert_allclose(y.numpy(), expected.numpy().transpose(0, 2, 1, 3), atol=2e-6)
    values = _bf16(v.numpy()) if on_amx else v.numpy()
    np.testing.assert_allclose(y.numpy()[0, 3], values[0].mean(1), atol=1e-6 if on_amx else 2e-6)


def test_shapes_off_the_vector_lanes_keep_the_graph():
    assert attention.fits(128, 64, 16) and attention.fits(16, 32, 16) and attention.fits(24, 64, 8)
    assert not attention.fits(14, 64, 16) and not attention.fits(32, 24, 16) and not attention.fits(32, 64, 0)


@pytest.mark.simd
def test_bert_tiny_attention_runs_on_the_kernel(tvmbert, workdir):
    # 2 x 32: verify compares the example and padded random inputs (masked keys) with PyTorch.
    outcome = tvmbert("verify", "bert-tiny", "--batch", "2", "--seq-len", "32", "--samples", "3", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-4
    meta = build_meta(workdir, "b2-s32-float32")
    # Both layers call it, reading Q, K and V as the fused projection's kernel writes them: panel-major.
    assert meta["attention_kernels"] == [f"attention_2x2x32x64_masked_panels{QKV_PANEL}"]
    assert "fma_matmul_64x384x128_panels" in meta["fma_kernels"] and "fma_matmul_64x384x128" not in meta["fma_kernels"]
    # what is left to schedule: the embeddings' sum, layer norm, the pooler
    assert not any(part in name for name in meta["schedules"] for part in ("softmax", "transpose", "split", "matmul1"))
    optimized = tvmbert("optimize", "bert-tiny", "--batch", "2", "--seq-len", "32", "--json")
    assert optimized.json["ops_after"].get("tir:attention_2x2x32x64_masked_panels") == 2  # (op counts drop trailing digits)
    assert "tir:softmax" not in optimized.json["ops_after"] and "tir:split" not in optimized.json["ops_after"]


@pytest.mark.simd
def test_off_lane_lengths_and_a_disabled_pass_keep_the_graph(tvmbert, workdir):
    outcome = tvmbert("optimize", "bert-tiny", "--seq-len", "14", "--json")
    assert outcome.code == 0, outcome.stderr
    assert not any(name.startswith("tir:attention") for name in outcome.json["ops_after"])
    assert "tir:softmax" in outcome.json["ops_after"]
    outcome = tvmbert("optimize", "bert-tiny", "--seq-len", "32", "--disable", "attention-fp32", "--json")
    assert outcome.code == 0, outcome.stderr
    assert "attention-fp32" not in outcome.json["passes"]
    assert not any(name.startswith("tir:attention") for name in outcome.json["ops_after"])


@pytest.mark.simd
def test_a_packed_builds_attention_reads_its_rows_through_the_index():
    """A packed build's operands hold the real tokens only; ``rows`` places them in the grid."""
    import tvm

    batch, heads, seq, dim, tokens = 2, 2, 16, 16, 20
    rng = np.random.default_rng(2)
    columns = rng.standard_normal((tokens, 3 * heads * dim), dtype=np.float32)
    rows = rng.integers(0, tokens, batch * seq).astype(np.int64)
    sources = [(3 * heads * dim, i * heads * dim) for i in range(3)]
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[1, ..., 10:] = MASKED
    library = tvm.compile(tvm.IRModule({"main": attention.kernel(batch, heads, seq, dim, HOST_LANES, sources, mask.shape, 0.25,
                                                                  tokens)}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, rows)), y)
    grid = columns[rows]  # [batch * seq, C]: what the padded build would read
    q, k, v = (_heads(grid, batch, seq, heads, dim, offset) for _, offset in sources)
    np.testing.assert_allclose(y.numpy(), _reference(q, k, v, mask, 0.25).transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("head_per_panel", [False, True])
def test_panel_major_operands_give_the_row_major_result(lanes, head_per_panel):
    """Q, K and V as an FMA kernel writes them panel-major (``[columns / panel, rows, panel]``),
    a panel holding parts of two heads (AVX-512) or exactly one (P V then reads V in place): bit
    for bit what the row-major operand gives."""
    import tvm

    panel = 4 * lanes
    batch, heads, seq, dim, offset = (2, 3, 32, panel, panel) if head_per_panel else (2, 3, 32, 32, 32)
    width = heads * dim
    columns = 3 * width + offset  # Q, K and V from column ``offset`` on; a multiple of the panel
    rng = np.random.default_rng(3)
    rows_major = rng.standard_normal((batch * seq, columns), dtype=np.float32)
    panels = np.ascontiguousarray(rows_major.reshape(batch * seq, columns // panel, panel).transpose(1, 0, 2))
    sources = [(columns, offset + i * width) for i in range(3)]
    mask = np.where(rng.random((batch, 1, 1, seq)) < 0.3, MASKED, 0).astype(np.float32)
    mask[..., 0] = 0
    results = []
    for operand, layout in ((rows_major, 0), (panels, panel)):
        library = tvm.compile(tvm.IRModule({"main": attention.kernel(batch, heads, seq, dim, lanes, sources, mask.shape, 0.125,
                                                                      panel=layout)}), target=HOST)
        y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
        library["main"](*(tvm.runtime.tensor(a) for a in (operand, operand, operand, mask, np.zeros(1, "int32"))), y)
        results.append(y.numpy())
    np.testing.assert_array_equal(results[1], results[0])
    q, k, v = (_heads(rows_major, batch, seq, heads, dim, at) for _, at in sources)
    np.testing.assert_allclose(results[1], _reference(q, k, v, mask, 0.125).transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)


@pytest.mark.amx
@pytest.mark.parametrize("batch, heads, seq, dim", [(2, 3, 32, 64), (1, 2, 64, 32)])
@pytest.mark.parametrize("mask_shape", ["keys", "rows", None])
@pytest.mark.parametrize("layout", ["fused", "separate", "packed", "panels"])
@pytest.mark.parametrize("spread", [1.0, 4.0])
@pytest.mark.parametrize("bf16_scores", [False, True])
def test_amx_attention_matches_float64_within_bf16_probabilities_and_values(batch, heads, seq, dim, mask_shape, layout, spread,
                                                                            bf16_scores):
    """The AMX kernel against float64 with P and V rounded to bf16, as its P V takes them (and
    divides by their sum). Its scores come from three bf16 products: with operands spread 4x the
    scores reach +-30 and a peaked softmax, where one product misses this bound 3-7-fold. With
    ``bf16_scores`` (bf16 builds) from one, of Q and K rounded to bf16: float64's scores then
    take Q and K so rounded."""
    import tvm

    rng = np.random.default_rng(4)
    width, panel = heads * dim, 64 if layout == "panels" else 0
    tokens = batch * seq - 5 if layout == "packed" else None
    columns = rng.standard_normal((tokens or batch * seq, 3 * width + 64), dtype=np.float32) * spread
    sources = [(3 * width + 64, 64 + i * width) for i in range(3)]
    operands = [columns] * 3
    if layout == "separate":
        operands = [np.ascontiguousarray(columns[:, offset:offset + width]) for _, offset in sources]
        sources = [(width, 0)] * 3
    elif layout == "panels":  # as an FMA kernel writes them: [columns / panel, rows, panel]
        operands = [np.ascontiguousarray(columns.reshape(len(columns), -1, panel).transpose(1, 0, 2))] * 3
    rows = rng.integers(0, tokens, batch * seq).astype(np.int64) if tokens else np.zeros(1, "int32")
    grid = columns[rows] if tokens else columns  # [batch * seq, C]: what the padded build would read
    q, k, v = (_heads(grid, batch, seq, heads, dim, offset) if layout != "separate" else _heads(a, batch, seq, heads, dim, 0)
               for a, (_, offset) in zip(operands, sources))
    mask = None
    if mask_shape:
        shape = (batch, 1, 1, seq) if mask_shape == "keys" else (batch, 1, seq, seq)
        mask = np.where(rng.random(shape) < 0.3, MASKED, 0).astype(np.float32)
        mask[..., 0] = 0  # every row keeps a key (the all-masked row has its own test)
    function = attention.amx_bf16_kernel(batch, heads, seq, dim, 16, sources, mask.shape if mask is not None else None, 0.125,
                                         tokens, panel, bf16_scores=bf16_scores)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (*operands, mask if mask is not None else np.zeros(1, "float32"), rows)), y)
    if bf16_scores:
        q, k = _bf16(q), _bf16(k)
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) * 0.125 + (mask if mask is not None else 0)
    weights = _bf16(np.exp(scores - scores.max(-1, keepdims=True))).astype(np.float64)
    expected = weights @ _bf16(v) / weights.sum(-1, keepdims=True)
    # a probability whose fp32 exp lies 1 ulp from float64's may round to the neighbouring bf16: 2^-8 of it
    np.testing.assert_allclose(y.numpy(), expected.transpose(0, 2, 1, 3), atol=2 ** -8 * np.abs(v).max(), rtol=0)
    assert "tdpbf16ps" in library.mod.inspect_source("asm")


def test_amx_attention_takes_whole_blocks_of_tiles():
    assert attention.amx_bf16_fits(128, 64, 16) and attention.amx_bf16_fits(32, 32, 16)
    assert not attention.amx_bf16_fits(48, 64, 16) and not attention.amx_bf16_fits(32, 16, 16) and not attention.amx_bf16_fits(32, 64, 8)


# The int8 kernel's dot product: vpdpbusd where this CPU has VNNI, else its arithmetic emulated.
VNNI_DOT = (int8.DOT_PRODUCTS["vpdpbusd"] if HOST_TARGET.int8_instruction == "vpdpbusd"
            else dataclasses.replace(int8.DOT_PRODUCTS["vpdpbusd"], accumulate=emulated_quads))


def _int8_attention(q, k, v, mask, scale):
    """float64 attention of Q, K, V [B, H, S, D] as the int8 kernel quantizes them: Q, K and V
    per row (symmetric, 127 levels, float32's quotients rounded half to even), the weights
    ``w = exp(score - row max) x V's row scale`` as round(65535 w / max w), P V rescaled by
    max w / 65535 and divided by the sum of the exps."""
    def levels(x):
        values, scales = quantized_rows(x)
        return values.astype(np.float64), scales.astype(np.float64)[..., None]

    (qq, sq), (kq, sk), (vq, sv) = levels(q), levels(k), levels(v)
    scores = qq @ kq.transpose(0, 1, 3, 2) * sq * scale * sk.transpose(0, 1, 3, 2) + mask
    exps = np.exp(scores - scores.max(-1, keepdims=True))
    weights = exps * sv.transpose(0, 1, 3, 2)
    largest = weights.max(-1, keepdims=True)
    return np.rint(weights * 65535 / largest) @ vq * largest / 65535 / exps.sum(-1, keepdims=True)


@pytest.mark.simd
@pytest.mark.skipif(HOST_LANES != 16, reason="the int8 kernel is AVX-512's (its gathers, 16 lanes)")
@pytest.mark.parametrize("batch, heads, seq, dim, window", [(2, 3, 64, 64, None), (1, 2, 96, 32, 20), (1, 1, 32, 16, None),
                                                             (1, 1, 64, 128, None)])
@pytest.mark.parametrize("mask_shape", ["keys", "rows", None])
@pytest.mark.parametrize("layout", ["fused", "packed", "panels"])
def test_the_int8_kernel_computes_what_its_quantization_says(batch, heads, seq, dim, window, mask_shape, layout):
    """Against its quantization in NumPy (its exp, within 2.4e-6 of float64's, rounds some
    weights to the next of their 65535 levels), and against float64 unquantized within int8's
    error; on ``vpdpbusd`` where this CPU has VNNI, else on its arithmetic emulated. Heads of 128
    take two P V tiles of 64 columns."""
    import tvm

    dot = VNNI_DOT
    rng = np.random.default_rng(5)
    width, panel = heads * dim, 64 if layout == "panels" else 0
    tokens = batch * seq - 5 if layout == "packed" else None
    total = 3 * width + 64 + -3 * width % 64  # whole panels of 64
    columns = rng.standard_normal((tokens or batch * seq, total), dtype=np.float32)
    sources = [(total, 64 + i * width) for i in range(3)]
    operands = [columns] * 3
    if layout == "panels":  # as a projection's kernel writes them: [columns / panel, rows, panel]
        operands = [np.ascontiguousarray(columns.reshape(len(columns), -1, panel).transpose(1, 0, 2))] * 3
    rows = rng.integers(0, tokens, batch * seq).astype(np.int64) if tokens else np.zeros(1, "int32")
    grid = columns[rows] if tokens else columns  # [batch * seq, C]: what the padded build would read
    q, k, v = (_heads(grid, batch, seq, heads, dim, offset) for _, offset in sources)
    mask = np.zeros((batch, 1, seq, seq))
    given = None
    if mask_shape:
        given = np.where(rng.random((batch, 1, 1, seq) if mask_shape == "keys" else (batch, 1, seq, seq)) < 0.3, MASKED, 0)
        given = given.astype(np.float32)
        given[..., 0] = 0  # every row keeps a key
        mask = mask + given
    if window is not None:
        at = np.arange(seq)
        mask = np.where(np.abs(at[:, None] - at[None]) <= window, mask, MASKED)
    function = attention.vnni_int8_kernel(batch, heads, seq, dim, 16, sources, given.shape if given is not None else None, 0.125,
                                          tokens, panel, window, dot=dot)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((batch, seq, heads, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (*operands, given if given is not None else np.zeros(1, "float32"), rows)), y)
    got = y.numpy().transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, _int8_attention(q, k, v, mask, 0.125), atol=np.abs(v).max() / 4096, rtol=0)
    np.testing.assert_allclose(got, _reference(q, k, v, mask, 0.125), atol=0.02 * np.abs(v).max(), rtol=0)
    if dot.instruction == HOST_TARGET.int8_instruction:
        assert "vpdpbusd" in library.mod.inspect_source("asm")


@pytest.mark.simd
@pytest.mark.skipif(HOST_LANES != 16, reason="the int8 kernel is AVX-512's (its gathers, 16 lanes)")
def test_the_int8_kernel_keeps_a_long_rows_small_weights():
    """One key scores ln 600 above 511 others (each then weighs 1/600 of it, under half of 255
    levels: 8-bit weights dropped them all and gave 0.54 for 0.08), its V row +1, theirs -1; and
    a row with every key masked averages V, as PyTorch does. Every operand exact in int8."""
    import tvm

    dot = VNNI_DOT
    seq, dim = 512, 16
    q, k, v = np.zeros((seq, dim), np.float32), np.zeros((seq, dim), np.float32), -np.ones((seq, dim), np.float32)
    q[:, 0] = k[0, 0] = np.sqrt(np.log(600) / 0.125)
    v[0] = 1
    mask = np.zeros((1, 1, seq, seq), np.float32)
    mask[0, 0, 7] = MASKED
    columns = np.concatenate([q, k, v], axis=1)
    function = attention.vnni_int8_kernel(1, 1, seq, dim, 16, [(3 * dim, i * dim) for i in range(3)], mask.shape, 0.125, dot=dot)
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((1, seq, 1, dim), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (columns, columns, columns, mask, np.zeros(1, "int32"))), y)
    expected = (1 - (seq - 1) / 600) / (1 + (seq - 1) / 600)
    got = y.numpy()[0, :, 0]
    # each small weight within half a level of 65535 (all 511 rounded alike here: 9e-4 off)
    np.testing.assert_allclose(np.delete(got, 7, axis=0), expected, atol=(seq - 1) * 0.5 / 65535)
    np.testing.assert_allclose(got[7], v.mean(0), atol=1e-4)


def test_the_int8_kernel_takes_whole_score_tiles_of_keys_on_avx512():
    assert attention.vnni_int8_fits(128, 64, 16) and attention.vnni_int8_fits(32, 16, 16)
    assert not attention.vnni_int8_fits(48, 64, 16) and not attention.vnni_int8_fits(32, 8, 16) and not attention.vnni_int8_fits(32, 64, 8)


def test_a_register_tile_is_a_power_of_two_vectors():
    """A tile of three vectors (48 floats at 16 lanes: 48 and 96 tokens) became one 48-lane
    vector that LLVM widened and split: all-MiniLM-L6-v2's attention at 8 x 48 took 25 ms, 1.75
    with a tile of one vector."""
    assert [attention.vectors_per_tile(count, 16) for count in (1, 2, 3, 4, 6, 8, 9, 12)] == [1, 2, 1, 4, 2, 4, 1, 4]
    assert [attention.vectors_per_tile(count, 8) for count in (1, 2, 3, 6)] == [1, 2, 1, 2]

"""--dtype int8: the kernels against a NumPy model of the same quantization (exact in int32), the
AVX-512 and AMX variants compiled, bert-tiny through every stage against fp32 PyTorch, the int8 peers."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from tvmbert import JobConfig, load
from tvmbert.kernels import amx, int8
from tvmbert.stages.bench.engines import check_tolerance, default_engines
from tvmbert.stages.bench.inference import engine_dtypes
from tvmbert.stages.bench.timing import _ratios
from tvmbert.stages.export import export

from helpers import HOST, HOST_INT8_INSTRUCTION, HOST_LANES, HOST_TARGET, build_meta, emulated_quads, glu_through, quantized_rows

# The kernel with each dot product: VNNI's arithmetic runs on every host emulated; the instruction
# itself where this CPU has it (else compiled below).
DOTS = {"vpmaddubsw": int8.DOT_PRODUCTS["vpmaddubsw"],
        "vpdpbusd-emulated": dataclasses.replace(int8.DOT_PRODUCTS["vpdpbusd"], accumulate=emulated_quads)}
if HOST_TARGET.int8_instruction == "vpdpbusd":
    DOTS["vpdpbusd"] = int8.DOT_PRODUCTS["vpdpbusd"]


def quantized_weight_model(w: np.ndarray, dot) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy model of the weights' quantization (passes/int8_matmuls.quantized_weight):
    per column, max |w| -> 127, and where ``dot`` sums pairs in int16, |w0 + w1| -> at most
    ``dot.pair_levels``."""
    sw = (np.abs(w).max(0) / np.float32(int8.LEVELS)).astype(np.float32)
    if dot.pair_levels:
        pair_sums = w.reshape(w.shape[0] // 2, 2, -1).sum(1)
        sw = np.maximum(sw, (np.abs(pair_sums).max(0) / np.float32(dot.pair_levels)).astype(np.float32))
    divisor = np.where(sw > 0, sw, np.float32(1))  # a zero column: scale 0, zeros
    return np.clip(np.rint(w / divisor), -int8.LEVELS, int8.LEVELS).astype(np.int8), sw


def weight_layout(wq: np.ndarray, width: int) -> np.ndarray:
    k, n = wq.shape
    depth = int8.DEPTH
    steps = wq.reshape(k // depth, depth, n // width, width).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(steps.reshape(n // width, k // depth, width * depth))


def pair_sums(laid_out: np.ndarray) -> np.ndarray:
    """Each lane's adjacent weights summed, as ``vpmaddubsw`` sums their products in int16."""
    return laid_out.astype(np.int32).reshape(-1, 2).sum(1)


def check_against_numpy(library, dot, lead, n, k, activation, residual, width, rows=None):
    """Runs ``library``'s ``quantize`` (into ``rows`` rows where given) and ``matmul`` (weights in
    panels ``width`` wide) on random data and checks them against the NumPy model: the quantized
    rows and scales equal, the int32 sums exact (the output within float32's rounding of the
    dequantization), and the result near fp32's. Row 1 (row 0 is zeros) and the first two
    columns hold the worst case of ``vpmaddubsw``'s int16 pair sums: rows at 255 times two weights
    at the column's largest, of one sign (the pairs' bound keeps them within 32767); the third
    column alternates signs at its largest, which saturates only where the kernel pairs other
    k values than the model does. The last row is all ties: halves round to even."""
    import tvm

    m = int(np.prod(lead))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((*lead, k), dtype=np.float32) * 4
    x[0] = 0  # a row of zeros: scale 0, no division by it
    x[1, :4] = np.abs(x[1]).max()
    ties = x.reshape(m, k)[-1]  # over 32, and its scale 1/32 exactly: small, not to loosen the bounds below
    ties[:] = (np.arange(k) % 8 - np.float32(3.5)) / 32
    ties[0] = np.float32(int8.LEVELS) / 32
    w = rng.standard_normal((k, n), dtype=np.float32)
    w[:2, 0], w[:2, 1] = np.abs(w[:, 0]).max(), -np.abs(w[:, 1]).max()
    w[:4, 2] = np.abs(w[:, 2]).max() * np.array([1, -1, 1, -1], np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal((*lead, n) if residual else (1,), dtype=np.float32)
    wq, sw = quantized_weight_model(w, dot)
    laid_out = weight_layout(wq, width)
    if dot.pair_levels:
        assert np.abs(pair_sums(laid_out)).max() == 128  # the first two columns' pairs at the bound
    else:
        assert (np.abs(wq).max(0) == int8.LEVELS).all()

    xq = tvm.runtime.tensor(np.full((rows, k) if rows else (*lead, k), 7, int8.ROWS_DTYPE))
    sx = tvm.runtime.tensor(np.zeros(m, "float32"))
    library["quantize"](tvm.runtime.tensor(x), xq, sx)
    want_xq, want_sx = quantized_rows(x)
    want_stored = (want_xq + int8.ROW_OFFSET).astype(int8.ROWS_DTYPE)
    if rows:  # the padding rows zeros, as the offset stores them
        want_stored = np.concatenate([want_stored.reshape(m, k), np.full((rows - m, k), int8.ROW_OFFSET, int8.ROWS_DTYPE)])
    np.testing.assert_array_equal(xq.numpy(), want_stored)
    np.testing.assert_array_equal(sx.numpy(), want_sx.reshape(-1))
    assert np.abs(want_xq).max() == int8.LEVELS

    y = tvm.runtime.tensor(np.zeros((*lead, n), "float32"))
    start = (-int8.ROW_OFFSET * wq.astype(np.int32).sum(0)).astype(np.int32)
    library["matmul"](xq, sx, *(tvm.runtime.tensor(a) for a in (laid_out, start, sw, b, r)), y)
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


@pytest.mark.parametrize("instruction", sorted(int8.DOT_PRODUCTS))
def test_the_build_quantizes_weights_as_the_numpy_model_does(instruction):
    """passes/int8_matmuls.quantized_weight (Relax, run at build time) against the model above:
    a column whose largest two weights share a pair (its scale then set by the pair), one that
    alternates signs at its largest (pairs summing to 0: the scale stays max |w| / 127, which a
    pairing of other k values would not give), and a column of zeros."""
    import tvm
    from tvm import relax

    from tvmbert.passes.int8_matmuls import quantized_weight

    dot = int8.DOT_PRODUCTS[instruction]
    k, n, width = 16, 16, 8
    w = np.random.default_rng(5).standard_normal((k, n), dtype=np.float32)
    w[:2, 0] = np.abs(w[:, 0]).max()
    w[:, 1] = np.clip(w[:, 1], -0.4, 0.4)  # no other pair near the largest: only the pairing decides the scale
    w[:4, 1] = [1, -1, 1, -1]
    w[:, 2] = 0
    builder = relax.BlockBuilder()
    weight = relax.Var("w", relax.TensorType((k, n), "float32"))
    with builder.function("main", [weight]):
        with builder.dataflow():
            operands = [builder.emit(operand) for operand in quantized_weight(weight, width, dot)]
            output = builder.emit_output(relax.Tuple(operands))
        builder.emit_func_output(output)
    machine = relax.VirtualMachine(tvm.compile(builder.get(), target=HOST), tvm.cpu())
    laid_out, sw, start = (a.numpy() for a in machine["main"](tvm.runtime.tensor(w)))
    want_wq, want_sw = quantized_weight_model(w, dot)
    np.testing.assert_array_equal(sw, want_sw)
    np.testing.assert_array_equal(laid_out, weight_layout(want_wq, width))
    np.testing.assert_array_equal(start, -int8.ROW_OFFSET * want_wq.astype(np.int32).sum(0))
    assert sw[1] == np.float32(1) / np.float32(int8.LEVELS) and sw[2] == 0 and not want_wq[:, 2].any()
    if dot.pair_levels:
        assert np.abs(pair_sums(laid_out)).max() <= 128 and list(want_wq[:2, 0]) == [64, 64]  # 127.99 / 2 each
    else:
        assert list(want_wq[:2, 0]) == [127, 127]


EPILOGUES = [(None, False), ("relax.nn.gelu", False), (None, True)]


@pytest.mark.simd
@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("lead, n, k, block_rows", [
    ((7,), 48, 64, None),  # AVX2: 3 x 3 tiles, two of them and one of a row; 2 panels
    ((2, 9), 96, 48, None),  # AVX-512: 6 x 4 tiles (3 of them); AVX2: 4 panels; K in 3 vectors of 16 (6 of 8)
    ((300,), 16, 32, None),  # AVX2: one-vector panels of 100 row tiles: no prefetch
    ((2, 25), 48, 64, 9),  # rows in blocks (AVX2: 3 tiles of 3 rows), the last tile smaller, in the last block
])
@pytest.mark.parametrize("activation, residual", EPILOGUES)
def test_int8_kernel_sums_exactly_what_numpy_sums(dot, lanes, lead, n, k, block_rows, activation, residual):
    import tvm

    dot = DOTS[dot]
    if int8.tile(n, lanes) is None:
        pytest.skip("N is not a multiple of the lanes")
    m = int(np.prod(lead))
    module = tvm.IRModule({"quantize": int8.quantize_rows_kernel(m, k, lanes, lead).with_attr("global_symbol", "quantize"),
                           "matmul": int8.kernel(m, n, k, lanes, lead, activation, residual, dot=dot,
                                                         block_rows=block_rows).with_attr("global_symbol", "matmul")})
    rows, vectors = int8.tile(n, lanes)
    check_against_numpy(tvm.compile(module, target=HOST), dot, lead, n, k, activation, residual, vectors * lanes)


@pytest.mark.simd
@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
def test_a_rotating_panel_major_int8_kernel_stores_the_row_major_result_rotated(dot, lanes):
    """ModernBERT's Q/K/V projection in int8: the panel-major kernel writes each panel's columns of
    every row together, what the row-major kernel writes, its first panels rotated (Q's and K's
    heads, ``y * cos + rotate_half(y) * sin`` with table row ``row % P``), the last one as it is."""
    import tvm

    lead, n, k, table_rows = (2, 11), 128, 64, 11  # 22 rows: a last tile smaller than the others; a padded batch of 2
    m = int(np.prod(lead))
    _, vectors = int8.tile(n, lanes)
    width = vectors * lanes
    panels = n // width
    rng = np.random.default_rng(5)
    x = rng.standard_normal((*lead, k), dtype=np.float32)
    wq = rng.integers(-64, 65, (panels, k // int8.DEPTH, width * int8.DEPTH)).astype("int8")  # pairs within 128
    start = rng.integers(-1000, 1000, n).astype("int32")
    sw, b = (rng.uniform(0.5, 1.5, n).astype("float32"), rng.standard_normal(n, dtype=np.float32))
    tables = rng.standard_normal((2, table_rows, width), dtype=np.float32)
    module = tvm.IRModule({
        "quantize": int8.quantize_rows_kernel(m, k, lanes, lead).with_attr("global_symbol", "quantize"),
        "rows": int8.kernel(m, n, k, lanes, lead, dot=DOTS[dot]).with_attr("global_symbol", "rows"),
        "panels": int8.kernel(m, n, k, lanes, lead, dot=DOTS[dot], panel_major=True,
                              rotary=(0, panels - 1, table_rows)).with_attr("global_symbol", "panels")})
    library = tvm.compile(module, target=HOST)
    xq, sx = tvm.runtime.tensor(np.zeros((*lead, k), int8.ROWS_DTYPE)), tvm.runtime.tensor(np.zeros(m, "float32"))
    library["quantize"](tvm.runtime.tensor(x), xq, sx)
    weights = [tvm.runtime.tensor(a) for a in (wq, start, sw, b)]
    row_major = tvm.runtime.tensor(np.zeros((*lead, n), "float32"))
    library["rows"](xq, sx, *weights, tvm.runtime.tensor(np.zeros(1, "float32")), row_major)
    panel_major = tvm.runtime.tensor(np.zeros((panels, m, width), "float32"))
    library["panels"](xq, sx, *weights, tvm.runtime.tensor(tables), panel_major)

    expected = row_major.numpy().reshape(m, panels, width).transpose(1, 0, 2).astype(np.float64)
    got = panel_major.numpy()
    np.testing.assert_array_equal(got[-1], expected[-1])  # V's panel, in a projection
    cos, sin = (table[np.arange(m) % table_rows] for table in tables)
    half = width // 2
    rotated = expected[:-1] * cos + np.concatenate([-expected[:-1, :, half:], expected[:-1, :, :half]], axis=2) * sin
    assert np.abs(got[:-1] - rotated).max() <= 1e-5 * np.abs(rotated).max()


@pytest.mark.amx_int8
@pytest.mark.parametrize("lead, n, k", [
    ((14,), 64, 128),  # a half block (16 rows), 2 of them padding: bert's 1 x 14
    ((2, 20), 96, 192),  # a whole block and a half one, 8 rows of padding; 3 panels; 3 k steps
    ((64,), 32, 64),  # whole blocks: no padding
    ((20,), 64, 128),  # a whole block, 12 rows of it padding
    ((300,), 64, 256),  # 9 whole blocks in 3 chunks of "L2" (row_chunk_bytes below), and a half one
    ((96,), 32, 192),  # 3 blocks in a chunk, 3 k steps: 11 rows of the previous block's epilogue a step, 1 left over
    ((64,), 32, 2176),  # 34 k steps: a row of the previous block's each for the first 32, none after
])
@pytest.mark.parametrize("activation, residual", EPILOGUES)
def test_amx_int8_kernel_sums_exactly_what_numpy_sums(lead, n, k, activation, residual):
    import tvm

    m = int(np.prod(lead))
    rows = amx.padded_rows(m)
    dot = int8.DOT_PRODUCTS["vpdpbusd"]  # AMX's rows and weights as VNNI's
    module = tvm.IRModule({
        "quantize": int8.quantize_rows_kernel(m, k, HOST_TARGET.int8_lanes, lead, rows).with_attr("global_symbol", "quantize"),
        "matmul": amx.int8_kernel(m, n, k, lead, activation, residual, row_chunk_bytes=5 * 32 * k).with_attr("global_symbol", "matmul")})
    check_against_numpy(tvm.compile(module, target=HOST), dot, lead, n, k, activation, residual, amx.TILE, rows)


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_TARGET.int8_lanes}))
@pytest.mark.parametrize("instruction", sorted({"vpmaddubsw", HOST_TARGET.int8_instruction}))
@pytest.mark.parametrize("activated_half", [0, 1])
def test_a_gated_activation_runs_in_the_vector_kernel_that_writes_half_the_columns(lanes, instruction, activated_half):
    """GeGLU without AMX: each panel's columns half activated, half their gates, quantized so, and
    the VNNI or vpmaddubsw kernel writes gelu(activated) x gate."""
    from tvmbert.passes.int8_matmuls import int8_matmuls

    # 22 rows: a last tile smaller than the others; 4 panels of 32 columns and their 32 gates (AVX-512), or of 8 and 8 (AVX2)
    lead, n, k = (2, 11), 256, 64
    kernels, main, y, expected = glu_through(int8_matmuls(lanes, instruction), lead, n, k, activated_half, 4)
    assert sorted(kernels) == [f"int8_matmul_{lead[0]}x{lead[1]}x{n}x{k}_gelu_gated", f"int8_quantize_rows_{lead[0]}x{lead[1]}x{k}"]
    assert "R.split" not in main and "R.nn.gelu" not in main
    # int8's error, a few percent of the largest; a column paired with another's gate would be off by the whole value
    assert y.shape == expected.shape and np.abs(y - expected).max() <= 0.03 * np.abs(expected).max()


@pytest.mark.amx_int8
@pytest.mark.parametrize("activated_half", [0, 1])
def test_a_gated_activation_on_amx_runs_in_the_kernel_that_writes_half_the_columns(activated_half):
    """GeGLU (ModernBERT's MLP): the pass orders the weight's columns, 16 activated then their
    gates a panel, quantizes them so, and the AMX kernel writes gelu(activated) x gate."""
    from tvmbert.passes.int8_matmuls import int8_matmuls

    lead, n, k = (2, 40), 192, 128  # 80 rows: two whole blocks and a half one; 6 panels
    kernels, main, y, expected = glu_through(int8_matmuls(HOST_TARGET.int8_lanes, "vpdpbusd", amx_tiles=True), lead, n, k,
                                             activated_half, 4)
    assert f"int8_matmul_{lead[0]}x{lead[1]}x{n}x{k}_gelu_gated" in kernels
    assert "R.split" not in main and "R.nn.gelu" not in main
    # int8's error, a few percent of the largest; a column paired with another's gate would be off by the whole value
    assert y.shape == expected.shape and np.abs(y - expected).max() <= 0.03 * np.abs(expected).max()


@pytest.mark.parametrize("mcpu, instruction, register", [
    ("skylake-avx512", "vpmaddubsw", "zmm"),  # AVX-512 without VNNI
    ("znver4", "vpdpbusd", "zmm"),  # AVX512-VNNI
    ("sapphirerapids", "vpdpbusd", "zmm"),
    ("alderlake", "vpdpbusd", "ymm"),  # AVX-VNNI without AVX-512
    ("haswell", "vpmaddubsw", "ymm"),
])
def test_each_target_gets_the_widest_dot_product_it_has(mcpu, instruction, register):
    """Only compiled: this host may lack them."""
    import tvm

    from tvmbert.core.targets import resolve

    spec = resolve(f"llvm -mcpu={mcpu}")
    dot = int8.DOT_PRODUCTS[spec.int8_instruction]
    assert dot.instruction == instruction
    module = tvm.IRModule({"main": int8.kernel(14, 96, 64, spec.int8_lanes, activation="relax.nn.gelu", dot=dot)})
    assembly = tvm.tirx.build(module, target=spec.tvm_target()).inspect_source("asm")
    rows, vectors = int8.tile(96, spec.int8_lanes)
    at_width = [line for line in assembly.splitlines() if f"{instruction}\t" in line and f"%{register}" in line]
    assert len(at_width) >= rows * vectors  # a whole tile's k step, at least


@pytest.mark.parametrize("mcpu, register", [("sapphirerapids", "zmm"), ("znver4", "zmm"), ("haswell", "ymm")])
def test_the_row_quantization_runs_on_whole_vectors_for_every_target(mcpu, register):
    """Compiled only. TVM leaves a loop with ``T.nearbyint`` scalar, and LLVM then vectorized it
    across rows with gathers and byte stores: on AVX-512, a quarter of bert-base's int8 time at
    8 x 128 on an Emerald Rapids."""
    import tvm

    from tvmbert.core.targets import resolve

    spec = resolve(f"llvm -mcpu={mcpu}")
    module = tvm.IRModule({"main": int8.quantize_rows_kernel(32, 768, spec.int8_lanes, rows=64)})
    assembly = tvm.tirx.build(module, target=spec.tvm_target()).inspect_source("asm")
    assert "gather" not in assembly and "pextrb" not in assembly
    assert any(re.search(r"\tv(rndscale|round)ps\t.*%" + register, line) for line in assembly.splitlines())


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
    assert meta["int8_instructions"][HOST_INT8_INSTRUCTION] > 0


@pytest.mark.simd
def test_bert_tiny_in_int8_the_vnni_way_verifies_with_the_instruction_emulated(tvmbert, tmp_path, monkeypatch):
    """The whole VNNI route on any host: u8 rows, quads of weights, the columns' starts computed at
    build time (none of which the kernel test above sees), against fp32 PyTorch."""
    from tvmbert.core.targets import TargetSpec

    monkeypatch.setattr(TargetSpec, "int8_instruction", property(lambda self: "vpdpbusd"))
    monkeypatch.setattr(TargetSpec, "has_amx_int8", property(lambda self: False))  # the vector kernel, also on AMX hosts
    monkeypatch.setitem(int8.DOT_PRODUCTS, "vpdpbusd", DOTS["vpdpbusd-emulated"])
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "int8", "--batch", "2", "--seq-len", "10", "--json",
                      "--workdir", str(tmp_path))
    assert outcome.code == 0, outcome.stderr
    assert 1e-4 < outcome.json["max_abs_diff"] < 0.05
    assert {m["name"]: m["value"] for m in outcome.json["accuracy"]}["cosine_min"] > 0.999
    # every weight matmul took the VNNI route: u8 rows, and a start per column (LLVM makes the
    # emulation's adjacent products vpmaddwd, so the library alone would not tell)
    optimized = (tmp_path / "bert-tiny" / "b2-s10-int8" / "optimize" / "module.py").read_text()
    assert len(re.findall(r'\(x: T\.Buffer\(\([^)]*\), "uint8"\)', optimized)) == 5
    assert len(re.findall(r'c0: T\.Buffer\(\((128|384|512),\), "int32"\)', optimized)) == 5


@pytest.mark.simd
def test_without_vnni_the_weights_pairs_stay_within_vpmaddubsws_int16_sums(tvmbert, workdir):
    """x86-64-v3's route (AVX2, no VNNI), run on every host that has those instructions: its
    weights keep 8 bits, and no two a lane sums in int16 pass 128 (rows up to 255: 32640 at most).
    verify checks the sums' results."""
    from tvmbert.core import targets

    avx2 = "llvm -mcpu=x86-64-v3"
    if targets.missing_host_features(targets.resolve(avx2).config):
        pytest.skip("this CPU cannot run x86-64-v3 code")
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "int8", "--batch", "2", "--seq-len", "10", "--json", "--target", avx2)
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and 1e-4 < outcome.json["max_abs_diff"] < 0.05
    assert {m["name"]: m["value"] for m in outcome.json["accuracy"]}["cosine_min"] > 0.999
    meta = build_meta(workdir, "b2-s10-int8", target=avx2)
    assert len(meta["int8_kernels"]) == 5 and meta["int8_instructions"]["vpmaddubsw"] > 0
    assert meta["int8_instructions"]["vpdpbusd"] == 0
    with np.load(workdir / "bert-tiny" / "b2-s10-int8" / targets.resolve(avx2).key / "build" / "params.npz") as params:
        weights = [params[name] for name in params.files if params[name].dtype == np.int8]
    assert len(weights) == 2 * 4 + 1  # two layers' Q/K/V, output, FFN in and out, and the pooler
    assert max(int(np.abs(w).max()) for w in weights) == int8.LEVELS  # 8 bits, where no pair binds
    assert max(int(np.abs(pair_sums(w)).max()) for w in weights) in (127, 128)  # and where one does, at its bound


def test_bert_tiny_in_int8_for_a_vnni_cpu_runs_every_matmul_on_vpdpbusd(tvmbert, workdir):
    """Compiled only: this host may lack VNNI (the kernel's arithmetic is checked emulated above)."""
    outcome = tvmbert("build", "bert-tiny", "--dtype", "int8", "--target", "llvm -mcpu=znver4", "--json")
    assert outcome.code == 0, outcome.stderr
    meta = build_meta(workdir, "b1-s14-int8", target="llvm -mcpu=znver4")
    assert len(meta["int8_kernels"]) == 5
    assert meta["int8_instructions"]["vpdpbusd"] >= 5 * 9 and meta["int8_instructions"]["vpmaddubsw"] == 0


def test_bert_tiny_in_int8_for_a_vnni_cpu_runs_its_attention_in_int8_where_its_tiles_fit(tvmbert, workdir):
    """Compiled only (the kernel's numerics: test_attention.py): 32 tokens take the int8 attention
    kernel's score tiles, 16 do not (fp32's kernel), and neither does AVX-512 without VNNI."""
    target = "llvm -mcpu=znver4"
    outcome = tvmbert("build", "bert-tiny", "--dtype", "int8", "--seq-len", "32", "--target", target, "--json")
    assert outcome.code == 0, outcome.stderr
    assert build_meta(workdir, "b1-s32-int8", target=target)["attention_kernels"] == ["attention_1x2x32x64_masked_panels64_int8"]
    for seq, mattr in (("16", ""), ("32", " -mattr=-avx512vnni")):
        outcome = tvmbert("optimize", "bert-tiny", "--dtype", "int8", "--seq-len", seq, "--target", target + mattr, "--json")
        assert outcome.code == 0, outcome.stderr
        attentions = [name for name in outcome.json["ops_after"] if name.startswith("tir:attention")]
        assert attentions and not any("_int" in name for name in attentions), attentions  # (op counts drop a name's digits)


@pytest.mark.slow
def test_bert_tiny_in_int8_for_an_amx_cpu_runs_every_matmul_on_amx_tiles(tvmbert, workdir):
    """Compiled only (the kernel's numerics: test_amx_int8_kernel_sums_exactly_what_numpy_sums, on
    AMX hosts). Every weight matmul fits AMX's tiles, its rows quantized into whole row tiles,
    and build lists them as AMX kernels: the loader asks for the tiles before it loads them."""
    outcome = tvmbert("build", "bert-tiny", "--dtype", "int8", "--target", "llvm -mcpu=sapphirerapids", "--json")
    assert outcome.code == 0, outcome.stderr
    meta = build_meta(workdir, "b1-s14-int8", target="llvm -mcpu=sapphirerapids")
    assert len(meta["int8_kernels"]) == 5 and meta["amx_kernels"] == meta["int8_kernels"]
    instructions = meta["int8_instructions"]
    assert instructions["tdpbusd"] >= 5 * 2 and instructions["vpdpbusd"] == 0 and meta["amx_instructions"]["tdpbusd"] > 0
    quantizers = meta["int8_quantize_kernels"]  # 14 rows (128 and 512 wide) and the pooler's 1: a half block each
    assert len(quantizers) == 3 and all(name.endswith("_to_16_rows") for name in quantizers)
    # -mattr=-amx-int8: the same CPU's vectors (optimize's cache follows -mattr too)
    vectors = "llvm -mcpu=sapphirerapids -mattr=-amx-int8"
    assert tvmbert("build", "bert-tiny", "--dtype", "int8", "--target", vectors, "--json").code == 0
    meta = build_meta(workdir, "b1-s14-int8", target=vectors)
    assert "amx_kernels" not in meta and meta["int8_instructions"]["vpdpbusd"] > 0 and meta["int8_instructions"]["tdpbusd"] == 0


def test_int8_attention_for_an_amx_cpu_runs_on_bf16_tiles(tvmbert, workdir):
    """Compiled only (the kernel's numerics: test_attention.py, on AMX hosts): with AMX, an int8
    build's attention runs its matmuls on ``tdpbf16ps``; without AMX-BF16, not on AMX (on this CPU's
    AVX-512 VNNI, in int8)."""
    target = "llvm -mcpu=sapphirerapids"
    outcome = tvmbert("build", "bert-tiny", "--dtype", "int8", "--seq-len", "32", "--target", target, "--json")
    assert outcome.code == 0, outcome.stderr
    meta = build_meta(workdir, "b1-s32-int8", target=target)
    assert meta["attention_kernels"] == ["attention_1x2x32x64_masked_amx"]
    assert meta["attention_kernels"][0] in meta["amx_kernels"] and meta["amx_instructions"]["tdpbf16ps"] > 0
    outcome = tvmbert("optimize", "bert-tiny", "--dtype", "int8", "--seq-len", "32", "--target", target + " -mattr=-amx-bf16", "--json")
    assert outcome.code == 0, outcome.stderr
    attentions = [name for name in outcome.json["ops_after"] if name.startswith("tir:attention")]
    assert attentions and not any("amx" in name for name in attentions)


@pytest.mark.amx
@pytest.mark.amx_int8
def test_bert_tiny_in_int8_on_amx_verifies_with_its_attention_on_bf16_tiles(tvmbert, workdir):
    """Run for real: the matmuls on AMX-INT8, the attention on AMX-BF16, against PyTorch fp32."""
    outcome = tvmbert("verify", "bert-tiny", "--dtype", "int8", "--batch", "2", "--seq-len", "32", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] < 0.05
    assert build_meta(workdir, "b2-s32-int8")["attention_kernels"] == ["attention_2x2x32x64_masked_amx"]


def test_an_int8_package_for_an_amx_cpu_asks_for_the_tiles_before_it_loads(workdir, tmp_path):
    """Compiled only: its manifest counts the AMX kernels, which is what makes tvmbert.load ask Linux
    for AMX's tile state first (on a CPU without it, the package is refused before that)."""
    manifest = export(JobConfig(model="bert-tiny", dtype="int8", workdir=str(workdir), target="llvm -mcpu=sapphirerapids"),
                      tmp_path / "amx", batches=(1,), seq_lens=(16,))
    assert manifest["amx_kernels"] == 5


def test_a_matmul_amx_tiles_do_not_fit_stays_on_vpdpbusd():
    """N = 48 is no whole number of AMX's 32-column panels; N = 64 with K = 64 is."""
    import tvm
    from tvm import relax

    from tvmbert.core.targets import resolve
    from tvmbert.passes.int8_matmuls import int8_matmuls

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((14, 64), "float32"))
    weights = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in
               (("w1", (64, 48)), ("b1", (48,)), ("w2", (64, 64)), ("b2", (64,)))]
    with builder.function("main", [x, *weights], attrs={"num_input": 1}):
        with builder.dataflow():
            narrow = builder.emit(relax.op.add(relax.op.matmul(x, weights[0]), weights[1]))
            wide = builder.emit(relax.op.add(relax.op.matmul(x, weights[2]), weights[3]))
            output = builder.emit_output(relax.Tuple([narrow, wide]))
        builder.emit_func_output(output)
    spec = resolve("llvm -mcpu=sapphirerapids")
    module = int8_matmuls(spec.int8_lanes, spec.int8_instruction, spec.has_amx_int8)(builder.get())
    kernels = {gv.name_hint: f for gv, f in module.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    on_amx = {name for name, f in kernels.items() if amx.KERNEL_ATTR in f.attrs}
    assert {name for name, f in kernels.items() if int8.KERNEL_ATTR in f.attrs} == {"int8_matmul_14x48x64", "int8_matmul_14x64x64"}
    assert on_amx == {"int8_matmul_14x64x64"}
    narrow = kernels["int8_matmul_14x48x64"].script()  # VNNI's u8 rows, one start per column
    assert 'x: T.Buffer((14, 64), "uint8")' in narrow and 'c0: T.Buffer((48,), "int32")' in narrow
    assert {"int8_quantize_rows_14x64", "int8_quantize_rows_14x64_to_16_rows"} <= set(kernels)


def test_a_matmul_of_weights_alone_is_left_to_the_build_time_transform():
    """DeBERTa's relative-position embeddings through its key projection: weights alone, which
    bind-params folds at build time. A kernel there was compiled into that build-time function,
    where LLVM aborted on its AMX tile stores."""
    from tvm import relax

    from tvmbert.core.targets import resolve
    from tvmbert.passes.int8_matmuls import int8_matmuls

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 64), "float32"))
    weights = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in
               (("positions", (16, 64)), ("w", (64, 64)), ("b", (64,)))]
    with builder.function("main", [x, *weights], attrs={"num_input": 1}):
        with builder.dataflow():
            tokens = builder.emit(relax.op.add(relax.op.matmul(x, weights[1]), weights[2]))
            positions = builder.emit(relax.op.add(relax.op.matmul(weights[0], weights[1]), weights[2]))
            output = builder.emit_output(relax.Tuple([tokens, positions]))
        builder.emit_func_output(output)
    spec = resolve("llvm -mcpu=sapphirerapids")
    module = int8_matmuls(spec.int8_lanes, spec.int8_instruction, spec.has_amx_int8)(builder.get())
    main = module["main"].script()
    assert main.count("R.call_tir(int8_matmul_16x64x64") == 1  # the tokens' matmul
    assert "R.matmul(positions, w" in main


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
    assert engine_dtypes("int8", ["tvm"])["tvm"].startswith("int8 weight matmuls")
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

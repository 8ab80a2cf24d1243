"""fp32 kernels LLVM can run at full width: the weight matmuls' FMA micro-kernel (its numerics on
shapes that take every branch, bert-tiny through it with row counts no multiple of the tile, against
PyTorch) and softmax's vectorized exp."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tvmbert.kernels import fma

from helpers import HOST, HOST_LANES, HOST_TARGET, build_meta, glu_module, glu_through, heap_buffers


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("lead, n, k", [
    ((16,), 96, 40),  # AVX-512: 2 row tiles x 2 panels of 3 vectors; K in blocks of 10; the next panel prefetched
    ((2, 8), 64, 64),  # two leading dims; AVX-512: one panel of 4 vectors, 2 row tiles of 6 and one of 4
    ((2, 7), 128, 40),  # 14 rows: tiles of 6 (AVX-512) or 4 (AVX2) and a last one of 2; the next panel prefetched
    ((1024,), 16, 16),  # one-vector panels, 128 row tiles: no prefetch (the panel's first stall no longer counts)
])
@pytest.mark.parametrize("activation, residual", [(None, False), ("relax.nn.gelu", False), (None, True)])
def test_fma_kernel_matches_float64(lanes, lead, n, k, activation, residual):
    import tvm

    if n % lanes:
        pytest.skip("N is not a multiple of the lanes")
    rows, vectors = fma.tile(n, lanes)
    m = int(np.prod(lead))
    width = vectors * lanes
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*lead, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    packed = np.ascontiguousarray(w.reshape(k, n // width, width).transpose(1, 0, 2))
    r = rng.standard_normal((*lead, n) if residual else (1,), dtype=np.float32)
    library = tvm.compile(tvm.IRModule({"main": fma.kernel(m, n, k, lanes, lead, activation, residual)}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((*lead, n), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (x, packed, b, r)), y)
    expected = x.astype(np.float64) @ w.astype(np.float64) + b
    if activation:
        expected = expected * (1 + np.vectorize(math.erf)(expected / math.sqrt(2))) / 2
    if residual:
        expected = expected + r
    assert np.abs(y.numpy() - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
def test_panel_major_output_holds_the_row_major_result(lanes):
    import tvm

    lead, n, k = (2, 11), 192, 24  # 22 rows: a last tile smaller than the others
    rows, vectors = fma.tile(n, lanes)
    width = vectors * lanes
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((*lead, k), (k, n), (n,)))
    operands = [x, np.ascontiguousarray(w.reshape(k, n // width, width).transpose(1, 0, 2)), b, np.zeros(1, "float32")]
    results = []
    for panel_major, shape in ((False, (*lead, n)), (True, (n // width, 22, width))):
        function = fma.kernel(22, n, k, lanes, lead, "relax.nn.gelu", panel_major=panel_major)
        library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
        y = tvm.runtime.tensor(np.zeros(shape, "float32"))
        library["main"](*(tvm.runtime.tensor(a) for a in operands), y)
        results.append(y.numpy())
    np.testing.assert_array_equal(results[1].transpose(1, 0, 2).reshape(*lead, n), results[0])


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
def test_a_rotating_panel_major_kernel_applies_rotary_positions_to_its_first_panels(lanes):
    import tvm

    lead, n, k, table_rows = (2, 11), 128, 24, 11  # 22 rows, each reading table row (row % 11): a padded batch of 2
    rows, vectors = fma.tile(n, lanes)
    width, m = vectors * lanes, 22
    panels = n // width
    rng = np.random.default_rng(3)
    x, w, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((*lead, k), (k, n), (n,)))
    tables = rng.standard_normal((2, table_rows, width), dtype=np.float32)
    function = fma.kernel(m, n, k, lanes, lead, None, panel_major=True, rotary=(0, panels - 1, table_rows))
    library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
    y = tvm.runtime.tensor(np.zeros((panels, m, width), "float32"))
    library["main"](*(tvm.runtime.tensor(a) for a in (x, np.ascontiguousarray(w.reshape(k, panels, width).transpose(1, 0, 2)), b,
                                                      tables)), y)
    expected = (x.reshape(m, k).astype(np.float64) @ w + b).reshape(m, panels, width).transpose(1, 0, 2)
    cos, sin = (table[np.arange(m) % table_rows] for table in tables)
    half = width // 2
    for p in range(panels - 1):  # the last panel (V's, in a projection) is stored as it is
        expected[p] = expected[p] * cos + np.concatenate([-expected[p][:, half:], expected[p][:, :half]], axis=1) * sin
    assert np.abs(y.numpy() - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("activated_half", [0, 1])
def test_a_gated_activation_runs_in_the_kernel_that_writes_half_the_columns(lanes, activated_half):
    from tvmbert.passes.fma_fp32 import fma_matmuls

    lead, n, k = (2, 11), 192, 40  # 22 rows: a last tile smaller than the others; 3 AVX-512 panels of 32 inputs and 32 gates
    kernels, main, y, expected = glu_through(fma_matmuls(lanes, 1), lead, n, k, activated_half, 2)
    assert kernels == [f"fma_matmul_{lead[0]}x{lead[1]}x{n}x{k}_gelu_gated"]
    assert "R.split" not in main and "R.nn.gelu" not in main
    assert y.shape == expected.shape and np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_gate_read_elsewhere_keeps_the_split():
    from tvmbert.passes.fma_fp32 import fma_matmuls

    module = fma_matmuls(16, 1)(glu_module((8,), 128, 32, 0, gate_read_twice=True))
    kernels = [gv.name_hint for gv, _ in module.functions_items() if gv.name_hint != "main"]
    assert kernels == ["fma_matmul_8x128x32"] and "R.split" in str(module["main"]) and "R.nn.gelu" in str(module["main"])


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
# AVX2 tiles of 4 rows: blocks of 2, 3 and 5 tiles; AVX-512 tiles of 8: 1, 1 and 3. Blocks of 24
# rows are two, whose (block, panel) pairs the threads share out; more go one after another.
@pytest.mark.parametrize("block_rows", [8, 12, 24])
def test_rows_done_a_block_at_a_time_give_the_one_sweeps_result(lanes, block_rows):
    import tvm

    lead, n, k, whole = (2, 19), 96, 40, 10**6  # 38 rows: whole tiles and a last smaller one, in the last block
    rows, vectors = fma.tile(n, lanes)
    width = vectors * lanes
    rng = np.random.default_rng(2)
    x, w, b, r = (rng.standard_normal(shape, dtype=np.float32) for shape in ((*lead, k), (k, n), (n,), (*lead, n)))
    packed = np.ascontiguousarray(w.reshape(k, n // width, width).transpose(1, 0, 2))
    for activation, residual, panel_major in (("relax.nn.gelu", False, False), (None, True, False), ("relax.nn.gelu", False, True)):
        results = []
        for block in (block_rows, whole):
            function = fma.kernel(38, n, k, lanes, lead, activation, residual, panel_major, block_rows=block)
            library = tvm.compile(tvm.IRModule({"main": function}), target=HOST)
            y = tvm.runtime.tensor(np.zeros((n // width, 38, width) if panel_major else (*lead, n), "float32"))
            library["main"](*(tvm.runtime.tensor(a) for a in (x, packed, b, r if residual else np.zeros(1, "float32"))), y)
            results.append(y.numpy())
        np.testing.assert_array_equal(results[0], results[1])
    assert fma.BLOCK_BYTES // ((768 + 3072) * 4) < 512  # bert-base's FFN at 8 x 512 goes in blocks, as measured


@pytest.mark.simd
@pytest.mark.parametrize("lanes", sorted({8, HOST_LANES}))
@pytest.mark.parametrize("n", [64, 96])  # AVX-512: 6 x 4 and 8 x 3 tiles, split in two stack buffers each
def test_accumulators_stay_off_the_heap(lanes, n):
    """A heap workspace for the accumulators is zeroed (memset) and stored at every tile; on the
    stack, LLVM keeps them in registers (bert-base 128 x 768 -> 3072 alone: 2.04 -> 1.92 ms)."""
    import tvm

    library = tvm.compile(tvm.IRModule({"main": fma.kernel(14, n, 32, lanes, residual=True)}), target=HOST)
    assert heap_buffers(library) == []


@pytest.mark.parametrize("m", [16, 128])
def test_a_matmul_within_one_block_of_rows_still_prefetches_the_next_panel(m):
    lines = re.search(r"for q in T.unroll\((\d+)\)", fma.kernel(m, 768, 768, 8).script())
    assert lines and int(lines[1]) > 0  # bert-base's output projection at 1 x 16 and 1 x 128 on AVX2


def test_tile_leaves_registers_for_the_weights_and_the_broadcast():
    for lanes, registers in ((16, 32), (8, 16)):
        for n in (16 * lanes, 6 * lanes, lanes):
            rows, vectors = fma.tile(n, lanes)
            assert rows * vectors + vectors + 1 <= registers
    assert fma.tile(24, 16) is None  # N not a multiple of the lanes: the matmul keeps its schedule


@pytest.mark.simd
def test_compute_bound_matmuls_run_on_the_kernel(tvmbert, workdir):
    outcome = tvmbert("verify", "bert-tiny", "--seq-len", "64", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-4
    meta = build_meta(workdir, "b1-s64-float32")
    # Q/K/V, attention output, FFN up and down; the pooler's one row too where the kernel takes every row count.
    assert len(meta["fma_kernels"]) == (4 if fma.min_rows(HOST_TARGET.key) > 1 else 5)
    assert not any(name.startswith("fma_") for name in meta["schedules"])  # no task: nothing to tune
    optimized = tvmbert("optimize", "bert-tiny", "--seq-len", "64", "--json")
    assert "fma-fp32" in optimized.json["passes"]


@pytest.mark.simd
def test_rows_that_are_no_multiple_of_the_tile_take_a_last_smaller_tile(tvmbert, workdir):
    # 3 x 13 = 39 rows: 6 tiles of 6 rows and one of 3 with AVX-512, nothing padded.
    outcome = tvmbert("verify", "bert-tiny", "--batch", "3", "--seq-len", "13", "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["passed"] and outcome.json["max_abs_diff"] <= 1e-4
    assert len(build_meta(workdir, "b3-s13-float32")["fma_kernels"]) == (4 if fma.min_rows(HOST_TARGET.key) > 3 else 5)


@pytest.mark.simd
def test_few_rows_take_the_kernel_unless_the_cpus_own_records_win_and_a_disabled_pass_keeps_the_schedules(tvmbert, workdir):
    assert tvmbert("build", "bert-tiny").code == 0  # 1 x 14: bound by streaming the weights
    assert ("fma_kernels" in build_meta(workdir, "b1-s14-float32")) == (fma.min_rows(HOST_TARGET.key) <= 14)
    assert fma.min_rows("llvm-sapphirerapids") == 16 and fma.min_rows("llvm-haswell") == 1
    outcome = tvmbert("optimize", "bert-tiny", "--seq-len", "64", "--disable", "fma-fp32", "--json")
    assert outcome.code == 0, outcome.stderr
    assert "fma-fp32" not in outcome.json["passes"]


def test_softmax_exp_is_within_one_ulp_zero_when_masked_and_vectorized():
    import tvm
    from tvm import te

    from tvmbert.kernels.scalar_math import exp_float32

    size = 1 << 16
    x = te.placeholder((size,), "float32", name="x")
    y = te.compute(x.shape, lambda i: exp_float32(x[i]), name="y")
    function = te.create_prim_func([x, y])
    schedule = tvm.s_tir.Schedule(function)
    _, lane = schedule.split(schedule.get_loops(schedule.get_sblock("y"))[0], [None, 16])
    schedule.vectorize(lane)
    library = tvm.compile(schedule.mod, target=HOST)
    inputs = np.linspace(-87, 0, size, dtype=np.float32)
    inputs[:3] = np.finfo(np.float32).min, -1e4, -87.5  # masked scores: exactly 0, never subnormal
    out = tvm.runtime.tensor(np.zeros(size, "float32"))
    library["main"](tvm.runtime.tensor(inputs), out)
    assert (out.numpy()[:3] == 0).all()
    exact = np.exp(inputs[3:].astype(np.float64))
    ulps = np.abs(out.numpy()[3:] - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    assert "expf" not in library.mod.inspect_source("asm")  # no libm call (TVM's exp would call expf per lane)

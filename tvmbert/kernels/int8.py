"""int8 matmuls by a weight: the weights quantized once at build time (symmetric, per output
channel), the activations per row at run time (symmetric, as each call finds them), the products
summed exactly in int32, then dequantized as the tile is stored, with the bias and the activation
or residual add. The pass ``int8-matmuls`` (``passes/int8_matmuls.py``) calls them, or on a CPU
with AMX-INT8 ``kernels/amx.int8_kernel`` for the matmuls its tiles fit (``tdpbusd``: the rows,
weights and columns' starts as for ``vpdpbusd`` below, 16 x 16 lanes at once).

The vector kernel's dot products run on one of two instructions (``DOT_PRODUCTS``, by the target).
Both take unsigned rows: the rows are quantized to symmetric levels (-127..127) and stored with
128 added (1..255), and each column's accumulators start from ``-128 x sum_k Wq[k, n]`` (computed
once at build time), which takes the offset back exactly. Both take the weights in quads, four k
values a lane:

- ``vpdpbusd`` (AVX512-VNNI on 512 bits, AVX-VNNI on 256): the four u8 x s8 products summed into
  each int32 lane, in place.
- ``vpmaddubsw`` then ``vpmaddwd`` by ones (AVX2, AVX-512 BW), where there is no VNNI: the same
  four products a lane in two instructions, the first summing them in pairs in int16, which
  saturates at 32767. Rows at 255 times two weights of 127 reach 64770, which is how ONNX
  Runtime's AVX2 kernels (and MetaSchedule's x86 intrinsics without VNNI) go wrong. So here each
  column's scale is bounded by its pairs as well (``DotProduct.pair_levels``): ``|Wq[2j, n] +
  Wq[2j + 1, n]| <= 128``, and a pair's sum stays within 255 x 128 = 32640 (opposite signs: 255 x
  127). The weights keep 8 bits; a column whose largest two share a pair loses up to one bit
  (what it costs: docs/precision.md, int8). Faster than the exact route it replaced, ``vpmaddwd``
  on int16 rows and sign-extended weights (two products a lane: CHANGELOG.md, 2026-11-25).

Both are exact: no sum leaves int32 (|start| + K x 255 x 127 <= K x 383 x 127 < 2^31 for K below
44000).

The weight is stored as int8 (a quarter of fp32's bytes to stream: few-row matmuls are bound by
that) in panels as the FMA kernel keeps them (``kernels/fma.py``), each k step ``DEPTH`` rows of
it: ``Wq[N / width, K / DEPTH, width x DEPTH]``.

Per tile of ``rows`` rows, ``rows x vectors`` int32 accumulators for the whole reduction; each k
step one broadcast of the row's ``DEPTH`` values (one int32) per row, and one weight load per
vector."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvmbert.kernels.fma import (
    ACTIVATION_ATTR,
    ACTIVATIONS,
    CACHE_LINE,
    GATED_ATTR,
    STACK_BYTES,
    assembly_of,
    prefetch_to_l2,
    row_blocks,
    whole,
)

KERNEL_ATTR = "tvmbert.int8_matmul"  # PrimFunc attribute marking the matmul kernel (build counts them)
# On the vector kernel's PrimFuncs, with fma's ACTIVATION_ATTR and GATED_ATTR: what a variant of one needs
INSTRUCTION_ATTR = "tvmbert.int8_instruction"  # its DotProduct's instruction
LANES_ATTR = "tvmbert.int8_lanes"
QUANTIZE_ATTR = "tvmbert.int8_quantize_rows"
LEVELS = 127  # symmetric int8: -127..127, so that negation never overflows
ROW_OFFSET = 128  # added to the rows' levels: the dot products' row operand is unsigned
ROWS_DTYPE = "uint8"
DEPTH = 4  # k values a lane per dot product
AMX_INSTRUCTION = "tdpbusd"  # AMX-INT8's tile dot product (kernels/amx.int8_kernel): vpdpbusd's operands, 16 x 16 lanes at once


def tile(n: int, lanes: int, gated: bool = False) -> tuple[int, int] | None:
    """(rows, vectors) of the int32 accumulator tile for N columns and the target's int32 lanes,
    or None where N is not a multiple of the lanes. Without VNNI each product needs a register of
    its own before it is added (``vpmaddubsw``, ``vpmaddwd`` by a register of ones, ``vpaddd``),
    besides the accumulators, the weight vectors and the broadcast: AVX2's 16 registers hold 3 x 3
    (4 x 3, as the FMA kernel runs, spills; 3 x 3 beat the other tiles that fit at 128 rows on Zen
    3, and one tile serves every row count: CHANGELOG.md, 2026-11-25). ``vpdpbusd`` adds in place and
    takes the same tiles (a register to spare; other tiles not tried: docs/benchmarks.md, int8 on
    Emerald Rapids). ``gated``: an even number of vectors, half of them the activated columns and
    half their gates (as ``fma.tile``)."""
    shapes = ((6, 4), (8, 3), (8, 2), (8, 1)) if lanes >= 16 else ((3, 3), (3, 2), (3, 1))
    return next(((rows, vectors) for rows, vectors in shapes
                 if n % (vectors * lanes) == 0 and (not gated or vectors % 2 == 0)), None)


def fits(n: int, k: int, lanes: int) -> bool:
    """Whether an N x K weight matmul runs here: K in whole vectors (the row quantization's; whole
    k steps for the matmul), N in whole tiles."""
    return lanes > 0 and k % lanes == 0 and tile(n, lanes) is not None


@dataclass(frozen=True)
class DotProduct:
    """How one instruction adds int8 products to int32 lanes: ``accumulate(acc, row_word, weights,
    lanes)``, TIR adding to the ``lanes`` int32 ``acc`` the products of ``row_word`` (a row's
    ``DEPTH`` values in one int32, broadcast to every lane) with ``weights`` (``DEPTH x lanes``
    int8); ``pair_levels``, where adjacent products are summed in int16 first: the bound on a pair
    of weights' real sum, in levels (the scale keeps ``|w0 + w1| / sw`` within it)."""

    instruction: str  # as the kernel's assembly shows it
    accumulate: Callable
    pair_levels: float | None = None


def _quads(acc, row_word, weights, lanes: int):
    from tvm.script import tirx as T

    # LLVM 22 declares the byte operands as i8 vectors; .256 is AVX-VNNI's as well as AVX512-VNNI's.
    name = f"llvm.x86.avx512.vpdpbusd.{32 * lanes}"
    return T.call_llvm_pure_intrin(f"int32x{lanes}", T.llvm_lookup_intrinsic_id(name), acc,
                                   T.reinterpret(row_word, dtype=f"int8x{4 * lanes}"), weights)


def _byte_pairs(acc, row_word, weights, lanes: int):
    from tvm.script import tirx as T

    bytes_name, pairs_name = (("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if lanes == 16
                              else ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"))
    pairs = T.call_llvm_pure_intrin(f"int16x{2 * lanes}", T.llvm_lookup_intrinsic_id(bytes_name),
                                    T.reinterpret(row_word, dtype=f"int8x{4 * lanes}"), weights)
    return acc + T.call_llvm_pure_intrin(f"int32x{lanes}", T.llvm_lookup_intrinsic_id(pairs_name), pairs,
                                         T.broadcast(T.int16(1), 2 * lanes))


# An int16 pair sum of two products stays within 255 x 128 = 32640 <= 32767 where |Wq0 + Wq1| <= 128:
# 127.99 leaves a real margin under 128, so that rounding each weight (by at most 1/2) keeps the
# integer sum <= 128, whatever fp32's rounding of the scale and the quotients.
PAIR_LEVELS = 127.99

DOT_PRODUCTS = {dot.instruction: dot for dot in (
    DotProduct("vpdpbusd", _quads),
    DotProduct("vpmaddubsw", _byte_pairs, PAIR_LEVELS),
)}


def instructions_in(executable) -> dict[str, int]:
    """How many of each dot product's instruction the executable's CPU code holds: which one its
    int8 matmuls run on (``tdpbusd``: AMX's, ``kernels/amx.py``)."""
    assembly = assembly_of(executable)
    return {name: assembly.count(f"\t{name}\t") for name in (*DOT_PRODUCTS, AMX_INSTRUCTION)}


def dequantized(total, row_scale, column_scale, bias):
    """TIR: an exact int32 sum (the column's start in it) back in float32, as every int8 kernel
    stores it, AMX's too: ``total x (sx x sw) + b``."""
    from tvm.script import tirx as T

    return T.Cast("float32", total) * (row_scale * column_scale) + bias


def kernel(m: int, n: int, k: int, lanes: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
           residual: bool = False, *, dot: DotProduct, block_rows: int | None = None, gated: bool = False,
           panel_major: bool = False, rotary: tuple[int, int, int] | None = None):
    """The PrimFunc ``y[*lead, n] = act(sx[row] * sw[n] * (c0[n] + xq[*lead, k] @ Wq[k, n]) + b[n]) (+ r[*lead, n])``
    with xq the rows as ``quantize_rows_kernel`` stores them, Wq as the module docstring lays it
    out, c0 the accumulators' start (``-ROW_OFFSET x sum_k Wq[k, n]``); ``m`` (the product of
    ``lead``) any row count; without ``residual``, r is one unread float. The rows go a block at a
    time, in ``fma.row_blocks``' blocks (fma.kernel's two blocks shared out with the panels ran no
    faster here: ModernBERT-base's four matmuls at 128-1024 rows on Zen 4, 0.99-1.01).
    ``gated`` (a GLU: ModernBERT's GeGLU) writes ``y[*lead, n / 2] = act(first half) * second
    half`` of each panel's columns, as ``fma.kernel`` does: Wq's columns (and sw, c0, b) in
    ``kernel_calls.gates_beside_inputs``' order, half a panel's width at a time. ``panel_major``
    (no residual) writes y as ``y[n / width, m, width]``, and ``rotary`` (first panel, end panel,
    table rows P; panel-major only) rotates panels first..end - 1 as they are stored, r holding
    the tables ``[2, P, width]``, as ``fma.kernel``'s do: the int8 build's Q/K/V projection then
    writes what the attention kernel reads, Q and K rotated (ModernBERT), with no pass between."""
    import tvm
    from tvm.script import tirx as T

    assert not (panel_major and residual) and not (gated and (residual or panel_major or not activation))
    epilogue = ACTIVATIONS[activation] if activation else (lambda value: value)
    lead = tuple(lead) if lead else (m,)
    rows, vectors = tile(n, lanes, gated)
    width = vectors * lanes
    half = vectors // 2  # a gated panel's activated vectors, then as many gates; a rotated panel's halves
    assert rotary is None or (panel_major and not activation and vectors % 2 == 0), (rotary, vectors)
    rotary_first, rotary_end, table_rows = rotary or (0, 0, 1)
    residual_shape = (*lead, n) if residual else (2, table_rows, width) if rotary else (1,)
    out_n = n // 2 if gated else n
    y_shape = (n // width, m, width) if panel_major else (*lead, out_n)
    words = k // DEPTH  # k steps: one int32 of each row's values per step
    panels, tiles, last_rows = n // width, m // rows, m % rows
    panel_lines = k * width // CACHE_LINE
    block_tiles, blocks = row_blocks(m, rows, k + n * 4, block_rows)
    steps = block_tiles * words
    per_step = -(-panel_lines // steps) if 2 * panel_lines >= steps else 0
    group_rows = STACK_BYTES // (width * 4)
    assert rows <= 2 * group_rows, (rows, width)

    def groups(tile_rows):
        return min(tile_rows, group_rows), tile_rows - min(tile_rows, group_rows)

    @T.macro
    def accumulate(x32, wq, acc, p, first_row, group, kw):
        for i in T.unroll(group):
            row_word = T.broadcast(x32[first_row + i, kw], lanes)
            for v in T.unroll(vectors):
                acc[i, T.ramp(v * lanes, 1, lanes)] = dot.accumulate(
                    acc[i, T.ramp(v * lanes, 1, lanes)], row_word, wq[p, kw, T.ramp(v * DEPTH * lanes, 1, DEPTH * lanes)], lanes)

    @T.macro
    def begin(c0, acc, p, group):
        for i in T.unroll(group):
            for v in T.unroll(vectors):
                acc[i, T.ramp(v * lanes, 1, lanes)] = c0[T.ramp(p * width + v * lanes, 1, lanes)]

    @T.macro
    def store_rotated(sx, sw, b, r, yf, acc, p, first_row, group):
        for i in T.unroll(group):
            for v in T.unroll(vectors):
                for j in T.vectorized(lanes):
                    yf[p, first_row + i, v * lanes + j] = dequantized(
                        acc[i, v * lanes + j], sx[first_row + i], sw[p * width + v * lanes + j], b[p * width + v * lanes + j]) \
                        * r[0, (first_row + i) % table_rows, v * lanes + j] \
                        + T.if_then_else(v < half, T.float32(-1), T.float32(1)) * dequantized(
                            acc[i, (v + half) % vectors * lanes + j], sx[first_row + i], sw[p * width + (v + half) % vectors * lanes + j],
                            b[p * width + (v + half) % vectors * lanes + j]) \
                        * r[1, (first_row + i) % table_rows, v * lanes + j]

    @T.macro
    def store(sx, sw, b, rf, yf, acc, p, first_row, group):
        for i in T.unroll(group):
            for v in T.unroll(half if gated else vectors):
                for j in T.vectorized(lanes):
                    if panel_major:
                        yf[p, first_row + i, v * lanes + j] = epilogue(dequantized(
                            acc[i, v * lanes + j], sx[first_row + i], sw[p * width + v * lanes + j], b[p * width + v * lanes + j]))
                    elif gated:
                        yf[first_row + i, p * (width // 2) + v * lanes + j] = epilogue(dequantized(
                            acc[i, v * lanes + j], sx[first_row + i], sw[p * width + v * lanes + j], b[p * width + v * lanes + j])) \
                            * dequantized(acc[i, (v + half) * lanes + j], sx[first_row + i], sw[p * width + (v + half) * lanes + j],
                                          b[p * width + (v + half) * lanes + j])
                    elif residual:
                        yf[first_row + i, p * width + v * lanes + j] = dequantized(
                            acc[i, v * lanes + j], sx[first_row + i], sw[p * width + v * lanes + j], b[p * width + v * lanes + j]) \
                            + rf[first_row + i, p * width + v * lanes + j]
                    else:
                        yf[first_row + i, p * width + v * lanes + j] = epilogue(dequantized(
                            acc[i, v * lanes + j], sx[first_row + i], sw[p * width + v * lanes + j], b[p * width + v * lanes + j]))

    @T.macro
    def store_tile(sx, sw, b, r, rf, yf, acc_head, acc_tail, p, t, head, tail):
        if rotary is not None:
            if rotary_first <= p and p < rotary_end:
                store_rotated(sx, sw, b, r, yf, acc_head, p, t * rows, head)
                if tail > 0:
                    store_rotated(sx, sw, b, r, yf, acc_tail, p, t * rows + head, tail)
            else:
                store(sx, sw, b, rf, yf, acc_head, p, t * rows, head)
                if tail > 0:
                    store(sx, sw, b, rf, yf, acc_tail, p, t * rows + head, tail)
        else:  # (no test of p where nothing rotates)
            store(sx, sw, b, rf, yf, acc_head, p, t * rows, head)
            if tail > 0:
                store(sx, sw, b, rf, yf, acc_tail, p, t * rows + head, tail)

    @T.macro
    def row_tile(x32, sx, wq, wf, c0, sw, b, r, rf, yf, p, t, head, tail):
        acc_head = T.alloc_buffer((head, width), "int32")
        acc_tail = T.alloc_buffer((max(tail, 1), width), "int32")
        begin(c0, acc_head, p, head)
        if tail > 0:
            begin(c0, acc_tail, p, tail)
        # One k step at a time, not unrolled: LLVM unrolls it by itself, where unrolling 8 made it load
        # later steps' weights early and spill accumulators (CHANGELOG.md, 2026-11-25).
        for kw in range(words):
            for q in T.unroll(per_step):
                T.evaluate(prefetch_to_l2(T.address_of(wf[T.min(p + 1, panels - 1) * (k * width) + T.min(
                    (t % block_tiles * words + kw) * per_step + q, panel_lines - 1) * CACHE_LINE])))
            accumulate(x32, wq, acc_head, p, t * rows, head, kw)
            if tail > 0:
                accumulate(x32, wq, acc_tail, p, t * rows + head, tail, kw)
        store_tile(sx, sw, b, r, rf, yf, acc_head, acc_tail, p, t, head, tail)

    @T.prim_func(s_tir=True)
    def int8_matmul(x: T.Buffer((*lead, k), ROWS_DTYPE), sx: T.Buffer((m,), "float32"),
                    wq: T.Buffer((panels, words, width * DEPTH), "int8"), c0: T.Buffer((n,), "int32"),
                    sw: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32"), r: T.Buffer(residual_shape, "float32"),
                    y: T.Buffer(y_shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, ACTIVATION_ATTR: activation or "",
                     GATED_ATTR: gated, INSTRUCTION_ATTR: dot.instruction, LANES_ATTR: lanes, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("int8_tiles"):
                T.reads(whole(x), whole(sx), whole(wq), whole(c0), whole(sw), whole(b), whole(r))
                T.writes(whole(y))
                x32 = T.decl_buffer((m, words), "int32", data=x.data)
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                yf = T.decl_buffer((n // width, m, width) if panel_major else (m, out_n), "float32", data=y.data)
                wf = T.decl_buffer((panels * k * width,), "int8", data=wq.data)
                for blk in range(blocks):
                    for p in T.parallel(panels):
                        for t in range(blk * block_tiles, T.min((blk + 1) * block_tiles, tiles)):
                            row_tile(x32, sx, wq, wf, c0, sw, b, r, rf, yf, p, t, *groups(rows))
                        if last_rows > 0 and blk == blocks - 1:
                            row_tile(x32, sx, wq, wf, c0, sw, b, r, rf, yf, p, tiles, *groups(last_rows))

    assert isinstance(int8_matmul, tvm.tirx.PrimFunc)
    return int8_matmul


def round_half_even(value):
    """TIR: ``value`` (float32) rounded to the nearest integer, ties to even, as NumPy's ``rint``. LLVM's
    ``roundeven`` called directly: TVM does not vectorize ``T.nearbyint`` (its loop stays scalar,
    and on 16 lanes LLVM's own vectorizer then gathered across rows: a quarter of bert-base's int8
    time at 8 x 128 on an Emerald Rapids)."""
    from tvm.script import tirx as T

    return T.call_llvm_pure_intrin("float32", T.llvm_lookup_intrinsic_id("llvm.roundeven"), value)


def row_quantizer(width: int, steps: int):
    """The TIR macro ``quantize_row(value, operands, qf, sx, row)``: row ``row`` of the float32
    values ``value(operands, row, column)`` (``steps`` x ``width`` columns, a vector of ``width``
    at a time) quantized as every int8 kernel here takes its rows: ``sx[row] = max|value| / 127``
    and ``qf[row, :] = round(value / sx[row]) + ROW_OFFSET`` (half to even, as NumPy rounds); a row
    of zeros gets ``sx = 0`` and ``ROW_OFFSET``. ``value`` is computed twice (its largest first),
    never stored: ``quantize_rows_kernel`` reads it, ``layer_norm.kernel(quantized=True)`` normalizes it."""
    from tvm.script import tirx as T

    @T.macro
    def quantize_row(value, operands, qf, sx, row):
        peak = T.alloc_buffer((width,), "float32")
        for j in T.vectorized(width):
            peak[j] = T.float32(0)
        for v in range(steps):
            for j in T.vectorized(width):
                peak[j] = T.max(peak[j], T.fabs(value(operands, row, v * width + j)))
        top = T.alloc_buffer((1,), "float32")
        top[0] = T.float32(0)
        for j in range(width):
            top[0] = T.max(top[0], peak[j])
        sx[row] = top[0] / T.float32(LEVELS)
        inverse = T.alloc_buffer((1,), "float32")
        inverse[0] = T.Select(top[0] > T.float32(0), T.float32(LEVELS) / top[0], T.float32(0))
        for v in range(steps):
            for j in T.vectorized(width):
                qf[row, v * width + j] = T.Cast(ROWS_DTYPE, round_half_even(value(operands, row, v * width + j) * inverse[0])
                                                + T.float32(ROW_OFFSET))

    return quantize_row


def _element(operands, row, column):
    return operands[0][row, column]


def quantize_rows_kernel(m: int, k: int, lanes: int, lead: tuple[int, ...] | None = None,
                         rows: int | None = None):
    """The PrimFunc ``(xq[*lead, k], sx[m]) = quantize(x[*lead, k])``: per row, ``sx = max|x| / 127``
    and ``xq = round(x / sx) + ROW_OFFSET`` (half to even, as NumPy rounds) in uint8; a row of
    zeros gets ``sx = 0`` and ``xq = ROW_OFFSET``. With ``rows`` (AMX's whole row tiles,
    ``kernels/amx.padded_rows``), xq is ``[rows, k]``, the rows past m zeros (``ROW_OFFSET``)."""
    import tvm
    from tvm.script import tirx as T

    lead = tuple(lead) if lead else (m,)
    assert k % lanes == 0, (k, lanes)
    vectors = k // lanes
    padding = rows - m if rows is not None else 0
    xq_shape = (rows, k) if rows is not None else (*lead, k)
    quantize_row = row_quantizer(lanes, vectors)

    @T.prim_func(s_tir=True)
    def quantize_rows(x: T.Buffer((*lead, k), "float32"), xq: T.Buffer(xq_shape, ROWS_DTYPE), sx: T.Buffer((m,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, QUANTIZE_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("quantize_rows"):
                T.reads(whole(x))
                T.writes(whole(xq), whole(sx))
                xf = T.decl_buffer((m, k), "float32", data=x.data)
                qf = T.decl_buffer((m + padding, k), ROWS_DTYPE, data=xq.data)
                for row in T.parallel(m):
                    quantize_row(_element, (xf,), qf, sx, row)
                for row in range(padding):
                    for v in range(vectors):
                        for j in T.vectorized(lanes):
                            qf[m + row, v * lanes + j] = T.Cast(ROWS_DTYPE, T.float32(ROW_OFFSET))

    assert isinstance(quantize_rows, tvm.tirx.PrimFunc)
    return quantize_rows

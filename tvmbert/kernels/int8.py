"""int8 matmuls by a weight: the weights quantized once at build time (symmetric, per output
channel), the activations per row at run time (symmetric, as each call finds them), the products
summed exactly in int32, then dequantized as the tile is stored, with the bias and the activation
or residual add. The pass ``int8-matmuls`` (``passes/int8_matmuls.py``) calls them.

The dot products run on ``pmaddwd`` (``vpmaddwd``): int16 pairs multiplied and summed into int32
lanes, the int8 values sign-extended to int16 first. It is exact (two products of int8 sum to at
most 2 x 127 x 127), where ``pmaddubsw`` (u8 x s8, the route of ONNX Runtime's dynamic
quantization and of MetaSchedule's x86 intrinsics without VNNI) saturates its int16 sums of two
products at 32767 and so needs 7-bit weights or a shifted u8 input to stay exact. AVX2 and AVX-512
both have it: one kernel, the vector width from the target. The weight is stored as int8 (a
quarter of fp32's bytes to stream: few-row matmuls are bound by that) in panels as the FMA kernel
keeps them (``kernels/fma.py``), each k step a pair of rows: ``Wq[N / width, K / 2, width, 2]``,
loaded as ``width x 2`` int8 and widened to int16 on the fly (``vpmovsxbw``).

Per tile of ``rows`` rows, ``rows x vectors`` int32 accumulators for the whole reduction; each k
pair one broadcast of the row's two int16 values (one int32) per row, and one widened weight load
per vector."""

from __future__ import annotations

from tvmbert.kernels.fma import ACTIVATIONS, CACHE_LINE, STACK_BYTES, prefetch_to_l2, whole

KERNEL_ATTR = "tvmbert.int8_matmul"  # PrimFunc attribute marking the matmul kernel (build counts them)
QUANTIZE_ATTR = "tvmbert.int8_quantize_rows"
LEVELS = 127  # symmetric int8: -127..127, so that negation never overflows


def tile(n: int, lanes: int) -> tuple[int, int] | None:
    """(rows, vectors) of the int32 accumulator tile for N columns and the target's int32 lanes,
    or None where N is not a multiple of the lanes. Each product needs a register of its own
    before it is added (``pmaddwd`` then ``paddd``), besides the accumulators, the weight vectors
    and the broadcast: AVX2's 16 registers hold 3 x 3 (4 x 3, as the FMA kernel runs, spilled
    accumulators to the stack at every step; 5 x 2, 4 x 2, 3 x 2 and 2 x 4 were no faster at 14,
    128 and 1024 rows: 270-300 GOP/s on 2 Zen 3 cores, whose ``vpmaddwd`` + ``vpaddd`` peak is
    ~68 GMAC/s a core, 1.5x its FMA's)."""
    shapes = ((6, 4), (8, 3), (8, 2), (8, 1)) if lanes >= 16 else ((3, 3), (3, 2), (3, 1))
    return next(((rows, vectors) for rows, vectors in shapes if n % (vectors * lanes) == 0), None)


def fits(n: int, k: int, lanes: int) -> bool:
    """Whether an N x K weight matmul runs here: K in whole vectors (the row quantization's; pairs
    for the matmul), N in whole tiles."""
    return lanes > 0 and k % lanes == 0 and tile(n, lanes) is not None


def pair_product(lanes: int):
    """TIR: ``pmaddwd(a, b)`` on ``2 x lanes`` int16 -> ``lanes`` int32 (AVX2 or AVX-512 by the lanes)."""
    from tvm.script import tirx as T

    name = "llvm.x86.avx512.pmaddw.d.512" if lanes == 16 else "llvm.x86.avx2.pmadd.wd"

    def product(a, b):
        return T.call_llvm_pure_intrin(f"int32x{lanes}", T.llvm_lookup_intrinsic_id(name), a, b)

    return product


def kernel(m: int, n: int, k: int, lanes: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
           residual: bool = False):
    """The PrimFunc ``y[*lead, n] = act(sx[row] * sw[n] * (xq[*lead, k] @ Wq[k, n]) + b[n]) (+ r[*lead, n])``
    with xq int16 holding int8 values, Wq as the module docstring lays it out; ``m`` (the product
    of ``lead``) any row count; without ``residual``, r is one unread float."""
    import tvm
    from tvm.script import tirx as T

    epilogue = ACTIVATIONS[activation] if activation else (lambda value: value)
    lead = tuple(lead) if lead else (m,)
    residual_shape = (*lead, n) if residual else (1,)
    rows, vectors = tile(n, lanes)
    width = vectors * lanes
    pairs = k // 2
    panels, tiles, last_rows = n // width, m // rows, m % rows
    panel_lines = pairs * width * 2 // CACHE_LINE
    steps = (tiles + (last_rows > 0)) * pairs
    per_step = -(-panel_lines // steps) if 2 * panel_lines >= steps else 0
    product = pair_product(lanes)
    group_rows = STACK_BYTES // (width * 4)
    assert rows <= 2 * group_rows, (rows, width)

    def groups(tile_rows):
        return min(tile_rows, group_rows), tile_rows - min(tile_rows, group_rows)

    @T.macro
    def accumulate(x32, wq, acc, p, first_row, group, kp):
        for i in T.unroll(group):
            pair = T.reinterpret(T.broadcast(x32[first_row + i, kp], lanes), dtype=f"int16x{2 * lanes}")
            for v in T.unroll(vectors):
                acc[i, T.ramp(v * lanes, 1, lanes)] = acc[i, T.ramp(v * lanes, 1, lanes)] + product(
                    pair, T.Cast(f"int16x{2 * lanes}", wq[p, kp, T.ramp(v * 2 * lanes, 1, 2 * lanes)]))

    @T.macro
    def store(sx, sw, b, rf, yf, acc, p, first_row, group):
        for i in T.unroll(group):
            for v in T.unroll(vectors):
                for j in T.vectorized(lanes):
                    if residual:
                        yf[first_row + i, p * width + v * lanes + j] = T.Cast("float32", acc[i, v * lanes + j]) \
                            * (sx[first_row + i] * sw[p * width + v * lanes + j]) + b[p * width + v * lanes + j] \
                            + rf[first_row + i, p * width + v * lanes + j]
                    else:
                        yf[first_row + i, p * width + v * lanes + j] = epilogue(T.Cast("float32", acc[i, v * lanes + j])
                            * (sx[first_row + i] * sw[p * width + v * lanes + j]) + b[p * width + v * lanes + j])

    @T.macro
    def row_tile(x32, sx, wq, wf, sw, b, rf, yf, p, t, head, tail):
        acc_head = T.alloc_buffer((head, width), "int32")
        acc_tail = T.alloc_buffer((max(tail, 1), width), "int32")
        for i in T.unroll(head):
            for v in T.unroll(vectors):
                acc_head[i, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
        if tail > 0:
            for i in T.unroll(tail):
                for v in T.unroll(vectors):
                    acc_tail[i, T.ramp(v * lanes, 1, lanes)] = T.broadcast(T.int32(0), lanes)
        # One k pair per step, not unrolled: LLVM unrolls it by itself, where unrolling 8 made it load
        # later steps' weights early and spill accumulators (128 x 3072 x 768, 2 Zen 3 cores: 275 -> 294 GOP/s).
        for kp in range(pairs):
            for q in T.unroll(per_step):
                T.evaluate(prefetch_to_l2(T.address_of(wf[T.min(p + 1, panels - 1) * (pairs * width * 2) + T.min(
                    (t * pairs + kp) * per_step + q, panel_lines - 1) * CACHE_LINE])))
            accumulate(x32, wq, acc_head, p, t * rows, head, kp)
            if tail > 0:
                accumulate(x32, wq, acc_tail, p, t * rows + head, tail, kp)
        store(sx, sw, b, rf, yf, acc_head, p, t * rows, head)
        if tail > 0:
            store(sx, sw, b, rf, yf, acc_tail, p, t * rows + head, tail)

    @T.prim_func(s_tir=True)
    def int8_matmul(x: T.Buffer((*lead, k), "int16"), sx: T.Buffer((m,), "float32"),
                    wq: T.Buffer((panels, pairs, width * 2), "int8"), sw: T.Buffer((n,), "float32"),
                    b: T.Buffer((n,), "float32"), r: T.Buffer(residual_shape, "float32"), y: T.Buffer((*lead, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("int8_tiles"):
                T.reads(whole(x), whole(sx), whole(wq), whole(sw), whole(b), whole(r))
                T.writes(whole(y))
                x32 = T.decl_buffer((m, pairs), "int32", data=x.data)
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                yf = T.decl_buffer((m, n), "float32", data=y.data)
                wf = T.decl_buffer((panels * pairs * width * 2,), "int8", data=wq.data)
                for p in T.parallel(panels):
                    for t in range(tiles):
                        row_tile(x32, sx, wq, wf, sw, b, rf, yf, p, t, *groups(rows))
                    if last_rows > 0:
                        row_tile(x32, sx, wq, wf, sw, b, rf, yf, p, tiles, *groups(last_rows))

    assert isinstance(int8_matmul, tvm.tirx.PrimFunc)
    return int8_matmul


def quantize_rows_kernel(m: int, k: int, lanes: int, lead: tuple[int, ...] | None = None):
    """The PrimFunc ``(xq[*lead, k], sx[m]) = quantize(x[*lead, k])``: per row, ``sx = max|x| / 127``
    and ``xq = round(x / sx)`` (half to even, as NumPy rounds) in int16; a row of zeros gets
    ``sx = 0`` and zeros."""
    import tvm
    from tvm.script import tirx as T

    lead = tuple(lead) if lead else (m,)
    assert k % lanes == 0, (k, lanes)
    vectors = k // lanes

    @T.prim_func(s_tir=True)
    def quantize_rows(x: T.Buffer((*lead, k), "float32"), xq: T.Buffer((*lead, k), "int16"), sx: T.Buffer((m,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, QUANTIZE_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("quantize_rows"):
                T.reads(whole(x))
                T.writes(whole(xq), whole(sx))
                xf = T.decl_buffer((m, k), "float32", data=x.data)
                qf = T.decl_buffer((m, k), "int16", data=xq.data)
                for row in T.parallel(m):
                    peak = T.alloc_buffer((lanes,), "float32")
                    for j in T.vectorized(lanes):
                        peak[j] = T.float32(0)
                    for v in range(vectors):
                        for j in T.vectorized(lanes):
                            peak[j] = T.max(peak[j], T.fabs(xf[row, v * lanes + j]))
                    top = T.alloc_buffer((1,), "float32")
                    top[0] = T.float32(0)
                    for j in range(lanes):
                        top[0] = T.max(top[0], peak[j])
                    sx[row] = top[0] / T.float32(LEVELS)
                    inverse = T.alloc_buffer((1,), "float32")
                    inverse[0] = T.Select(top[0] > T.float32(0), T.float32(LEVELS) / top[0], T.float32(0))
                    for v in range(vectors):
                        for j in T.vectorized(lanes):
                            qf[row, v * lanes + j] = T.Cast("int16", T.nearbyint(xf[row, v * lanes + j] * inverse[0]))

    assert isinstance(quantize_rows, tvm.tirx.PrimFunc)
    return quantize_rows

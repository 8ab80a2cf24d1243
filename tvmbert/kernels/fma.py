"""fp32 matmuls by a weight on a hand-written FMA micro-kernel. The pass ``fma-fp32``
(``passes/fma_fp32.py``) calls it.

Where a matmul takes it (every row count, or from ``MIN_ROWS`` of the target on: 1 x 128, 8 x 128), MetaSchedule's best schedules for bert-base's weight matmuls reached 210-230 GFLOP/s of
this machine's ~400 (two Sapphire Rapids cores: a loop of register-only FMAs runs 200 GFLOP/s on
each) after 300 trials each, and TVM offers no fp32
micro-kernel intrinsic. This kernel is the classic BLAS one (MLAS, oneDNN): the weight packed once
at build time into panels of ``vectors x lanes`` columns (``Wp[N / width, K, width]``, each panel
contiguous), each thread owning whole panels of a block of rows (or of two blocks); per tile of
``rows`` rows, ``rows x vectors`` accumulator registers for the whole reduction, each k step one
broadcast per row and one load per vector; bias, activation (a gated one too: GeGLU), residual
or rotary positions applied as the tile is stored (``passes/kernel_calls.Epilogues``,
``passes/attention_fp32``): each is one more pass over the result otherwise, and rotary positions
a copy of Q and K head-major too.
A panel is read from memory once, by the first row tile, and the next tiles find it in cache; the
first would stall on memory, so while a panel is computed the kernel prefetches the next one,
spread evenly over the panel's row tiles. Measured on
bert-base's 128 x 768 -> 3072 alone (2 threads, weights not in cache): ~280 GFLOP/s against 219
for the tuned record. The rows past the last whole tile take one smaller tile; N must be a
multiple of the vector lanes. Other matmuls (attention's two, few rows, a 2-label head) keep
their schedules (tuning databases, default schedules).
"""

from __future__ import annotations

from tvmbert.kernels.scalar_math import gelu_float32

KERNEL_ATTR = "tvmbert.fma_f32"  # PrimFunc attribute marking the kernel (build counts them)
# On this kernel's and the int8 kernel's PrimFuncs: what a panel-major variant of one needs
ACTIVATION_ATTR = "tvmbert.matmul_activation"  # the kernel's activation ("" for none)
GATED_ATTR = "tvmbert.matmul_gated"  # a gated activation's kernel: half the columns, no panel-major variant
# A matmul by a weight with few rows is bound by streaming the weight. Schedules tuned on the CPU
# itself stream it better there, below 16 rows (Sapphire Rapids, its shipped records, bert-base
# 1 x 14: 18.7 ms tuned, 20.4 on the kernel); every other CPU runs schedules carried from another
# one, which the kernel beats at every row count (AMD Zen 4, records carried from Sapphire Rapids,
# 1 x 14: 24.4 -> 18.3 ms; built for haswell, AVX2: 36.2 -> 22.4). From 16 rows on the kernel
# wins everywhere (an export's small buckets are rarely tuned: 1 x 16 untuned 40.8 ms, kernel
# 21.3). The fewest rows our kernels take, by target key (1 where a key is not listed): the
# pipeline's PassContext.min_rows; a function of the target alone, so that tune and build agree.
# A key names the instruction sets the target has (core/targets.llvm_key): a Sapphire Rapids whose
# VM hides AVX-512 is llvm-sapphirerapids_no-avx512f, where the AVX-512 records do not run.
MIN_ROWS = {"llvm-sapphirerapids": 16}
CACHE_LINE = 64
# The rows a matmul does at a time, every panel over them before the next rows: their inputs and
# outputs (rows x (K + N) floats) stay in cache while the panels pass. Swept whole, at 4096 rows
# (bert-base 8 x 512) each panel streamed all of X from memory and wrote a column strip of a 50 MB
# output, sharing each strip's edge cache lines with the next panel's thread: 4096 x 3072 x 768
# with GELU ran at 67.6 GFLOP/s on 2 Zen 1 cores, 78-83 in blocks of 128-512 rows (512 rows: 76.0 either way).
BLOCK_BYTES = 2 * 1024 * 1024
STACK_BYTES = 1023  # the largest buffer TVM allocates on the stack (runtime::kMaxStackAlloca - 1)
# Activations the kernel applies as it stores a tile (Relax op -> what it does to a float32 PrimExpr): the
# FFN's GELU then costs no pass over its 4 x hidden activations (bert-base 8 x 128: 2.9 ms x 12).
ACTIVATIONS = {"relax.nn.gelu": gelu_float32}


def min_rows(target_key: str) -> int:
    return MIN_ROWS.get(target_key, 1)


def row_blocks(m: int, rows: int, row_bytes: int, block_rows: int | None = None) -> tuple[int, int]:
    """How a matmul kernel walks ``m`` rows in tiles of ``rows``: (tiles a block holds, blocks).
    A block is at most ``block_rows`` rows, or as many rows of ``row_bytes`` (a row's inputs and
    outputs) as ``BLOCK_BYTES`` holds, the tiles spread over as few blocks as that allows, the
    last one short by less than a tile a block: where threads share out (block, panel) pairs, a
    short last block would leave one idle while another finishes a long one. The rows past the
    last whole tile are one more tile, in the last block."""
    all_tiles = m // rows + (m % rows > 0)
    most_tiles = max(1, (block_rows or BLOCK_BYTES // row_bytes) // rows)
    block_tiles = -(-all_tiles // -(-all_tiles // most_tiles))
    return block_tiles, -(-all_tiles // block_tiles)


def tile(n: int, lanes: int, gated: bool = False) -> tuple[int, int] | None:
    """(rows, vectors) of the accumulator tile for N columns and the target's vector lanes: as
    many accumulators as leave a register per weight vector and one for the broadcast (32 vector
    registers with AVX-512, 16 with AVX2), or None when N is not a multiple of the lanes. With
    AVX-512, 6 x 4 where N allows (10 loads per 24 FMAs against 8 x 3's 11: bert-base's four
    matmuls at 8 x 128, 2 threads, alone: 1-4% faster), else 8 x 3, 8 x 2, 8 x 1. ``gated``:
    an even number of vectors, half of them the activated columns and half their gates."""
    shapes = ((6, 4), (8, 3), (8, 2), (8, 1)) if lanes >= 16 else ((4, 3), (4, 2), (4, 1))
    return next(((rows, vectors) for rows, vectors in shapes
                 if n % (vectors * lanes) == 0 and (not gated or vectors % 2 == 0)), None)


def whole(buffer):
    """TIR: the region of every element of ``buffer`` (a kernel block's reads and writes)."""
    import tvm

    return tvm.tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d) for d in buffer.shape])


def assembly_of(executable) -> str:
    """A built executable's CPU code as assembly (generated again from its LLVM modules): where a
    kernel's key instructions are counted."""
    parts = []
    for imported in executable.mod.imports:
        if imported.kind == "llvm":
            parts.append(imported.inspect_source("asm"))
        parts.extend(m.inspect_source("asm") for m in imported.imports if m.kind == "llvm")
    return "\n".join(parts)


def prefetch_to_l2(address):
    """TIR: a software prefetch of the line at ``address`` (read, into L2: locality 2, data)."""
    from tvm.script import tirx as T

    return T.call_llvm_intrin("void", T.llvm_lookup_intrinsic_id("llvm.prefetch.p0"), address, T.int32(0), T.int32(2),
                              T.int32(1))


def kernel(m: int, n: int, k: int, lanes: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
           residual: bool = False, panel_major: bool = False, block_rows: int | None = None, gated: bool = False,
           rotary: tuple[int, int, int] | None = None):
    """The PrimFunc ``y[*lead, n] = act(x[*lead, k] @ W[k, n] + b[n]) (+ r[*lead, n])`` with W
    packed as ``Wp[n / width, k, width]``; ``m`` (the product of ``lead``) any row count (the
    rows past the last whole tile take a tile of their own); ``act`` one of ``ACTIVATIONS`` or
    none; without ``residual``, r is one unread float. ``panel_major`` (no residual) writes y as
    ``y[n / width, m, width]``: each panel's columns of all rows together (``passes/fma_fp32.panel_major_variant``).
    ``gated`` (a GLU: ModernBERT's GeGLU) writes ``y[*lead, n / 2] = act(first half) * second
    half`` of each panel's columns, W's and b's columns interleaved so that each panel holds
    ``width / 2`` activated columns and their gates (``passes/kernel_calls.gates_beside_inputs``):
    the product's other half is never written. ``rotary`` (first panel, end panel, table rows P;
    panel-major only) rotates panels first..end - 1 as it stores them, each one head's Q or K
    (ModernBERT's rotary positions, ``y * cos + rotate_half(y) * sin``, rotate_half(y) =
    ``[-y[width / 2:], y[:width / 2]]``), with r holding the tables ``[2, P, width]`` (cos, then
    sin) of row ``row % P``. The rows go in blocks (``block_rows``, by default what
    ``BLOCK_BYTES`` holds), every panel done on a block while its rows are in cache."""
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
    y_shape = (n // width, m, width) if panel_major else (*lead, n // 2 if gated else n)

    panels, tiles, last_rows = n // width, m // rows, m % rows
    k_block = max(d for d in range(1, 17) if k % d == 0)  # k steps unrolled between prefetches
    k_blocks = k // k_block
    panel_lines = k * width * 4 // CACHE_LINE
    block_tiles, blocks = row_blocks(m, rows, (k + n) * 4, block_rows)
    # Two blocks are shared out with the panels, (block, panel) pairs in that order, so that on 2
    # cores each reads half of X, not all of it (ModernBERT's N = 768 matmuls at 512 rows, alone:
    # 5-7% faster). More go one at a time, each core taking some of every block's panels: a core's
    # share of W is read again by its next block, from L3 (1024 x 768 -> 2304 and 3072 -> 768,
    # 7 and 8 blocks: 4-6% slower shared out).
    serial_blocks, parallel_blocks = (1, blocks) if blocks <= 2 else (blocks, 1)
    steps = block_tiles * k_blocks  # of a panel's pass over a block
    # Lines of the next panel to prefetch per k block; none where a panel has so many row tiles
    # that its first one's stall no longer counts (8 x 128 rows: 128 tiles).
    per_step = -(-panel_lines // steps) if 2 * panel_lines >= steps else 0
    line_floats = CACHE_LINE // 4

    # TVM puts a buffer on the stack only in scope "global" and under ``STACK_BYTES``; any other
    # is a heap workspace that LLVM zeroes (memset) and stores at every tile. On the stack, LLVM
    # keeps the accumulators in registers alone: a tile's rows in two buffers (head, tail) that fit.
    group_rows = STACK_BYTES // (width * 4)
    assert rows <= 2 * group_rows, (rows, width)

    def groups(tile_rows):
        return min(tile_rows, group_rows), tile_rows - min(tile_rows, group_rows)

    @T.macro
    def accumulate(xf, wp, acc, p, first_row, group, kb, kk):
        for i in T.unroll(group):
            for v in T.unroll(vectors):
                for j in T.vectorized(lanes):
                    acc[i, v * lanes + j] = acc[i, v * lanes + j] + xf[first_row + i, kb * k_block + kk] \
                        * wp[p, kb * k_block + kk, v * lanes + j]

    @T.macro
    def store_rotated(b, r, yf, acc, p, first_row, group):
        for i in T.unroll(group):
            for v in T.unroll(vectors):
                for j in T.vectorized(lanes):
                    yf[p, first_row + i, v * lanes + j] = (acc[i, v * lanes + j] + b[p * width + v * lanes + j]) \
                        * r[0, (first_row + i) % table_rows, v * lanes + j] \
                        + T.if_then_else(v < half, T.float32(-1), T.float32(1)) \
                        * (acc[i, (v + half) % vectors * lanes + j] + b[p * width + (v + half) % vectors * lanes + j]) \
                        * r[1, (first_row + i) % table_rows, v * lanes + j]

    @T.macro
    def store(b, rf, yf, acc, p, first_row, group):
        for i in T.unroll(group):
            for v in T.unroll(half if gated else vectors):
                for j in T.vectorized(lanes):
                    if gated:
                        yf[first_row + i, p * (width // 2) + v * lanes + j] = epilogue(acc[i, v * lanes + j] + b[p * width + v * lanes + j]) \
                            * (acc[i, (v + half) * lanes + j] + b[p * width + (v + half) * lanes + j])
                    elif residual:
                        yf[first_row + i, p * width + v * lanes + j] = acc[i, v * lanes + j] \
                            + b[p * width + v * lanes + j] + rf[first_row + i, p * width + v * lanes + j]
                    elif panel_major:
                        yf[p, first_row + i, v * lanes + j] = epilogue(acc[i, v * lanes + j] + b[p * width + v * lanes + j])
                    else:
                        yf[first_row + i, p * width + v * lanes + j] = epilogue(acc[i, v * lanes + j] + b[p * width + v * lanes + j])

    @T.macro
    def store_tile(b, rf, yf, acc_head, acc_tail, p, t, head, tail):
        store(b, rf, yf, acc_head, p, t * rows, head)
        if tail > 0:
            store(b, rf, yf, acc_tail, p, t * rows + head, tail)

    @T.macro
    def row_tile(xf, wp, wf, b, r, rf, yf, p, t, head, tail):  # rows t * rows .. + head + tail of panel p
        acc_head = T.alloc_buffer((head, width), "float32")
        acc_tail = T.alloc_buffer((max(tail, 1), width), "float32")  # unused (TVM has no empty buffer) without a tail
        # Zeroed a vector at a time, as the FMAs and stores access them: a row of 3 AVX2 vectors
        # zeroed as one <24 x float> made LLVM rebuild the accumulators from scalars at every
        # k block (AVX2 4 x 3 tile, 128 x 3072 x 768 on 2 Zen 4 cores: 135 -> 218 GFLOP/s; bert-base 1 x 128 built for haswell 167 -> 105 ms).
        for i in T.unroll(head):
            for v in T.unroll(vectors):
                for j in T.vectorized(lanes):
                    acc_head[i, v * lanes + j] = T.float32(0)
        if tail > 0:
            for i in T.unroll(tail):
                for v in T.unroll(vectors):
                    for j in T.vectorized(lanes):
                        acc_tail[i, v * lanes + j] = T.float32(0)
        for kb in range(k_blocks):
            for q in T.unroll(per_step):
                T.evaluate(prefetch_to_l2(T.address_of(wf[T.min(p + 1, panels - 1) * (k * width) + T.min(
                    (t % block_tiles * k_blocks + kb) * per_step + q, panel_lines - 1) * line_floats])))
            for kk in T.unroll(k_block):
                accumulate(xf, wp, acc_head, p, t * rows, head, kb, kk)
                if tail > 0:
                    accumulate(xf, wp, acc_tail, p, t * rows + head, tail, kb, kk)
        if rotary is not None:
            if rotary_first <= p and p < rotary_end:
                store_rotated(b, r, yf, acc_head, p, t * rows, head)
                if tail > 0:
                    store_rotated(b, r, yf, acc_tail, p, t * rows + head, tail)
            else:
                store_tile(b, rf, yf, acc_head, acc_tail, p, t, head, tail)
        else:  # (no test of p where nothing rotates)
            store_tile(b, rf, yf, acc_head, acc_tail, p, t, head, tail)

    @T.prim_func(s_tir=True)
    def fma_matmul(x: T.Buffer((*lead, k), "float32"), wp: T.Buffer((panels, k, width), "float32"),
                   b: T.Buffer((n,), "float32"), r: T.Buffer(residual_shape, "float32"), y: T.Buffer(y_shape, "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, ACTIVATION_ATTR: activation or "", GATED_ATTR: gated,
                     "op_pattern": 8})
        with T.sblock("root"):  # SplitLayoutRewritePreproc expects a root block
            with T.sblock("fma_tiles"):  # and a block under it
                T.reads(whole(x), whole(wp), whole(b), whole(r))
                T.writes(whole(y))
                xf = T.decl_buffer((m, k), "float32", data=x.data)
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                yf = T.decl_buffer((n // width, m, width) if panel_major else (m, n // 2 if gated else n), "float32", data=y.data)
                wf = T.decl_buffer((panels * k * width,), "float32", data=wp.data)
                for blk in range(serial_blocks):
                    for bp in T.parallel(parallel_blocks * panels):  # block blk + bp // panels, panel bp % panels
                        for t in range((blk + bp // panels) * block_tiles, T.min((blk + bp // panels + 1) * block_tiles, tiles)):
                            row_tile(xf, wp, wf, b, r, rf, yf, bp % panels, t, *groups(rows))
                        if last_rows > 0 and blk + bp // panels == blocks - 1:
                            row_tile(xf, wp, wf, b, r, rf, yf, bp % panels, tiles, *groups(last_rows))

    assert isinstance(fma_matmul, tvm.tirx.PrimFunc)
    return fma_matmul

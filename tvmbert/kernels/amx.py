"""Matmuls on Intel AMX's tiles: bf16 (AMX-BF16, ``tdpbf16ps``) and int8 (AMX-INT8,
``tdpbusd``). The passes ``amx-bf16`` (``passes/amx_bf16.py``) and ``int8-matmuls``
(``passes/int8_matmuls.py``) call them; the loader (``deploy/loader.py``) asks for the process
permission their instructions need (build lists every kernel here as ``amx_kernels``, and
``kernels/attention.amx_bf16_kernel``, which runs on the same tiles).

MetaSchedule's x86 tensor intrinsics cover VNNI's int8 only, and bf16 kernels scheduled by it
convert every bf16 value to fp32 in the inner loop (slower than fp32). AVX512-BF16's ``vdpbf16ps``
through a tensor intrinsic measured slower than fp32 too on Sapphire Rapids (docs/benchmarks.md,
bf16). AMX's ``tdpbf16ps`` multiplies 16 x 32 by 32 x 16 bf16 tiles into 16 x 16 fp32
accumulators: ~1 TFLOP/s per core; ``tdpbusd`` 16 x 64 u8 by 64 x 16 s8 into 16 x 16 int32, twice
that. TVM 0.27 has no AMX support, so the kernels are written directly in TIR with LLVM's AMX
intrinsics, and marked scheduled: tuning, task extraction and the default schedules leave them alone.

bf16: ``Y[M, N] (fp32) = X[M, K] (bf16) @ W[K, N] (bf16)``, fp32 accumulation, with M, N, K multiples of
32 and W packed once, at build time, as ``Wp[N/16, K/2, 16, 2]`` (AMX's VNNI layout: pairs of
consecutive k for each of 16 columns). The rewrite pads M (batch x tokens) to a multiple of 32 and
slices the result; a matmul whose N or K is not a multiple of 32 (a classifier with 2 labels)
keeps the bf16 loop nest.

int8: ``kernels/int8.py``'s quantization and layout (u8 rows with 128 added, quads of weights,
the columns' starts), the rows padded to 32 by the quantization kernel itself: see ``int8_kernel``.
"""

from __future__ import annotations

from tvmbert.kernels.fma import CACHE_LINE, assembly_of, prefetch_to_l2, whole
from tvmbert.kernels.int8 import AMX_INSTRUCTION as INT8_INSTRUCTION
from tvmbert.kernels.int8 import KERNEL_ATTR as INT8_KERNEL_ATTR
from tvmbert.kernels.int8 import dequantized
from tvmbert.kernels.scalar_math import gelu_float32

KERNEL_ATTR = "tvmbert.amx"  # PrimFunc attribute marking a kernel on AMX tiles (build counts them; the loader asks for them)
TILE = 32  # M, N and K granularity of the bf16 kernel (2 x 2 tiles of 16 x 16 fp32, K in steps of 32 bf16); M and N of the int8 one
INT8_K_STEP = 64  # the int8 kernel's K granularity: a tile row of 64 bytes
HALF_BLOCK = 16  # the int8 kernel's M granularity: a row tile (a 32-row block's half)
INSTRUCTIONS = ("tdpbf16ps", INT8_INSTRUCTION)  # what the kernels' assembly holds, bf16's and int8's
ACTIVATIONS = {"relax.nn.gelu": gelu_float32}  # applied as a block is stored (the FFN's GELU)


def tile_instruction(name: str, *args):
    """TIR: a call of LLVM's AMX intrinsic ``llvm.x86.<name>`` (tile numbers as int8 immediates)."""
    from tvm.script import tirx as T

    return T.call_llvm_intrin("void", T.llvm_lookup_intrinsic_id(f"llvm.x86.{name}"), *args)


def tile_configuration():
    """A TIR macro loading the configuration every AMX kernel runs with: palette 1, eight tiles of
    16 rows x 64 bytes (tmm0-3 the accumulators, tmm4-5 the rows, tmm6-7 the weights, or
    attention's K and V pairs)."""
    from tvm.script import tirx as T

    @T.macro
    def configure_tiles():
        cfg = T.alloc_buffer((64,), "uint8", scope="local")
        for byte in range(64):
            cfg[byte] = T.uint8(0)
        cfg[0] = T.uint8(1)
        for t in range(8):
            cfg[16 + 2 * t] = T.uint8(64)
            cfg[48 + t] = T.uint8(16)
        T.evaluate(tile_instruction("ldtilecfg", T.address_of(cfg[0])))

    return configure_tiles


def _row_chunk(row_blocks: int, block_bytes: int, chunk_bytes: int) -> int:
    """How many row blocks of ``block_bytes`` (their X) a chunk holds: the most that divide the
    blocks and fit ``chunk_bytes``, at least one."""
    return max((d for d in range(1, row_blocks + 1) if row_blocks % d == 0 and d * block_bytes <= chunk_bytes), default=1)


def next_panel_prefetch(k: int, element_bytes: int, blocks: int, steps: int):
    """A TIR macro ``prefetch(w_lines, p, step)``: the step-th of ``blocks x steps`` shares of the
    lines of the weights' next column panel (32 columns x k elements, after panel p; ``w_lines``
    the weights flat) into L2, so that its first row block does not wait on memory (at 128 rows a
    panel's weights are read from memory by 1 of its 4 row blocks). No lines where a panel has one
    block: that runs at memory's rate already (bert-base 1 x 14)."""
    from tvm.script import tirx as T

    panel_elements, line_elements = TILE * k, CACHE_LINE // element_bytes
    panel_lines = panel_elements // line_elements
    lines_per_step = -(-panel_lines // (blocks * steps)) if blocks > 1 else 0

    @T.macro
    def prefetch(w_lines, p, step):
        for line in range(lines_per_step):
            if step * lines_per_step + line < panel_lines:
                T.evaluate(prefetch_to_l2(T.address_of(w_lines[(p + 1) * panel_elements + (step * lines_per_step + line) * line_elements])))

    return prefetch


def bf16_fits(m: int, n: int, k: int) -> bool:
    """Whether the bf16 kernel takes a matmul of these sizes (M is padded, N and K are not)."""
    return m >= 1 and n % TILE == 0 and k % TILE == 0 and n > 0 and k > 0


def bf16_kernel(m: int, n: int, k: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
                residual: bool = False, out_dtype: str = "float32", row_chunk_bytes: int = 1 << 20, gated: bool = False):
    """The AMX PrimFunc for ``Y[m, n] = act(X[m, k] @ W[k, n] + b[n]) (+ R[m, n])`` (m, n, k
    multiples of 32), W packed, ``act`` one of ``ACTIVATIONS`` or none: bias, activation and
    residual applied to each 32 x 32 block after its tiles are stored (without ``residual``, R is
    one unread float), and Y written in ``out_dtype`` (bfloat16 where the next matmul reads it: no
    cast kernel over it). ``gated`` (a GLU: ModernBERT's GeGLU): each block's 32 columns are 16
    activated ones and their 16 gates (``passes/kernel_calls.gates_beside_inputs`` orders W's and b's
    columns so), and Y[m, n / 2] holds ``act(activated) * gate``: no kernel over the sum's columns.

    With ``lead`` (the leading dimensions of X and Y, whose product is m), X and Y have them instead
    of m: the kernels around it see no reshape. Parallel over column blocks of 32; each block runs
    over all row blocks, keeping a 32 x 32 fp32 result in four accumulator tiles (tmm0-3) while A
    (tmm4-5) and B (tmm6-7) tiles stream along K. As the int8 kernel does, a block's epilogue runs a
    few rows per k step of the next block, between its tile instructions, where the vector units
    are otherwise idle; and each step prefetches a few lines of the next column block's weights
    into L2, so that the next block's first row block does not wait on memory (at 128 rows a
    column block's weights are read from memory by 1 of its 4 row blocks).
    """
    import tvm
    from tvm.script import tirx as T

    assert m % TILE == 0 and n % TILE == 0 and k % TILE == 0, (m, n, k)
    assert not gated or (activation and not residual), (activation, residual)
    lda = k * 2  # row stride of X (bf16) in bytes
    row_blocks, col_blocks, k_blocks = m // TILE, n // TILE, k // TILE
    out_n, out_block = (n // 2, TILE // 2) if gated else (n, TILE)  # Y's columns, and a block's
    lead = tuple(lead) if lead else (m,)
    # Rows in chunks whose X (bf16) fits a core's L2 (SPR: 2 MiB): all column blocks of a chunk,
    # in parallel, before the next chunk, so that X is not streamed from L3 once per column block.
    chunk = _row_chunk(row_blocks, TILE * k * 2, row_chunk_bytes)
    rows_per_step = -(-TILE // k_blocks)  # of the previous block's epilogue, per k step of the next
    prefetch_next_panel = next_panel_prefetch(k, 2, chunk, k_blocks)
    configure_tiles = tile_configuration()
    epilogue = ACTIVATIONS[activation] if activation else (lambda value: value)

    @T.macro
    def store_row(b, rf, yf, blocks, slot, nb, row, i):
        """Row i of a stored block (the matrix's row + i): bias, activation or residual, cast."""
        for j in T.vectorized(out_block):
            if gated:
                yf[row + i, nb * out_block + j] = T.Cast(out_dtype, epilogue(blocks[slot, i, j] + b[nb * TILE + j])
                                                         * (blocks[slot, i, out_block + j] + b[nb * TILE + out_block + j]))
            elif residual:
                yf[row + i, nb * TILE + j] = T.Cast(out_dtype, blocks[slot, i, j] + b[nb * TILE + j] + rf[row + i, nb * TILE + j])
            else:
                yf[row + i, nb * TILE + j] = T.Cast(out_dtype, epilogue(blocks[slot, i, j] + b[nb * TILE + j]))

    @T.prim_func(s_tir=True)
    def amx_matmul(x: T.Buffer((*lead, k), "bfloat16"), wp: T.Buffer((n // 16, k // 2, 16, 2), "bfloat16"),
                   b: T.Buffer((n,), "float32"), r: T.Buffer((*lead, n) if residual else (1,), "float32"),
                   y: T.Buffer((*lead, out_n), out_dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):  # SplitLayoutRewritePreproc expects a root block
            with T.sblock("amx_tiles"):  # and a block under it
                T.reads(whole(x), whole(wp), whole(b), whole(r))
                T.writes(whole(y))
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                xu = T.decl_buffer((m, k), "uint16", data=x.data)
                yf = T.decl_buffer((m, out_n), out_dtype, data=y.data)
                wu = T.decl_buffer((n // 16, k // 2, 32), "uint16", data=wp.data)
                w_lines = T.decl_buffer((n * k,), "uint16", data=wp.data)
                for mc in range(row_blocks // chunk):
                    for nb in T.parallel(col_blocks):
                        configure_tiles()
                        blocks = T.alloc_buffer((2, TILE, TILE), "float32", scope="local")  # a block's tiles, stored; the previous one's
                        for mi in range(chunk):
                            row = (mc * chunk + mi) * TILE
                            for tile in T.unroll(4):
                                T.evaluate(tile_instruction("tilezero", T.int8(tile)))
                            for kb in range(k_blocks):
                                T.evaluate(tile_instruction("tileloadd64", T.int8(4), T.address_of(xu[row, kb * 32]), T.int64(lda)))
                                T.evaluate(tile_instruction("tileloadd64", T.int8(5), T.address_of(xu[row + 16, kb * 32]), T.int64(lda)))
                                T.evaluate(tile_instruction("tileloadd64", T.int8(6), T.address_of(wu[nb * 2, kb * 16, 0]), T.int64(64)))
                                T.evaluate(tile_instruction("tileloadd64", T.int8(7), T.address_of(wu[nb * 2 + 1, kb * 16, 0]), T.int64(64)))
                                T.evaluate(tile_instruction("tdpbf16ps", T.int8(0), T.int8(4), T.int8(6)))
                                T.evaluate(tile_instruction("tdpbf16ps", T.int8(1), T.int8(4), T.int8(7)))
                                T.evaluate(tile_instruction("tdpbf16ps", T.int8(2), T.int8(5), T.int8(6)))
                                T.evaluate(tile_instruction("tdpbf16ps", T.int8(3), T.int8(5), T.int8(7)))
                                if nb + 1 < col_blocks:
                                    prefetch_next_panel(w_lines, nb, mi * k_blocks + kb)
                                if mi > 0:
                                    for i in range(rows_per_step):
                                        if kb * rows_per_step + i < TILE:
                                            store_row(b, rf, yf, blocks, (mi - 1) % 2, nb, row - TILE, kb * rows_per_step + i)
                            for tile in T.unroll(4):
                                T.evaluate(tile_instruction("tilestored64", T.int8(tile),
                                                            T.address_of(blocks[mi % 2, (tile // 2) * 16, (tile % 2) * 16]), T.int64(TILE * 4)))
                        for i in range(TILE):
                            store_row(b, rf, yf, blocks, (chunk - 1) % 2, nb, (mc * chunk + chunk - 1) * TILE, i)
                        T.evaluate(tile_instruction("tilerelease"))

    assert isinstance(amx_matmul, tvm.tirx.PrimFunc)
    return amx_matmul


def int8_fits(n: int, k: int) -> bool:
    """Whether the int8 kernel takes an N x K weight (the rows are padded, N and K are not)."""
    return n > 0 and k > 0 and n % TILE == 0 and k % INT8_K_STEP == 0


def padded_rows(m: int) -> int:
    """The rows the int8 kernel reads for ``m``: whole 32-row blocks, or a 16-row half block last
    where that holds the rest (bert's 1 x 14 runs half the tile work of a whole block)."""
    return -(-m // HALF_BLOCK) * HALF_BLOCK


def int8_kernel(m: int, n: int, k: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
                residual: bool = False, row_chunk_bytes: int = 1 << 20, gated: bool = False):
    """The AMX-INT8 PrimFunc for ``y[*lead, n] = act(sx[row] * sw[n] * (c0[n] + xq[row, k] @ Wq[k, n]) + b[n])
    (+ r[*lead, n])``, the operands as ``kernels/int8.kernel`` takes them for ``vpdpbusd`` (the
    same numerics, exact in int32), except xq: ``padded_rows(m)`` rows of u8 (128 added; the rows
    past m are never stored), as ``int8.quantize_rows_kernel(..., rows=padded_rows(m))`` writes
    them, and Wq's panels 32 columns wide (``Wq[N / 32, K / 4, 32 x 4]``): each half of a panel,
    16 columns of ``K / 4`` rows of 64 bytes at a stride of 128, is one weight tile as ``tdpbusd``
    reads it.

    Parallel over panels; each runs over the row blocks of a chunk (their rows fit a core's L2)
    with a 32 x 32 int32 block in four accumulator tiles while row tiles (tmm4-5) and weight
    tiles (tmm6-7) stream along K, 64 at a time; the block is then stored, and dequantized with
    the column's start, the bias and the activation or residual a few rows per k step of the
    next block, between its tile instructions: the vector units work while the tiles do (after
    each block, the epilogue took as long as a quarter of FFN up's tile work: docs/benchmarks.md,
    int8 on Sapphire Rapids). A last half
    block (16 rows) runs on two accumulators and one row tile. ``gated``: as ``bf16_kernel``'s,
    y[*lead, n / 2] from each panel's 16 activated columns and their 16 gates."""
    import tvm
    from tvm.script import tirx as T

    assert int8_fits(n, k), (n, k)
    assert not gated or (activation and not residual), (activation, residual)
    out_n, out_block = (n // 2, TILE // 2) if gated else (n, TILE)  # y's columns, and a panel's
    epilogue = ACTIVATIONS[activation] if activation else (lambda value: value)
    lead = tuple(lead) if lead else (m,)
    residual_shape = (*lead, n) if residual else (1,)
    rows = padded_rows(m)
    whole_blocks, half_block = rows // TILE, rows % TILE > 0
    panels, k_steps = n // TILE, k // INT8_K_STEP
    panel_stride = TILE * 4  # bytes from one k quad of a panel to the next
    chunk = _row_chunk(whole_blocks, TILE * k, row_chunk_bytes)
    prefetch_next_panel = next_panel_prefetch(k, 1, chunk, k_steps)
    rows_per_step = -(-TILE // k_steps)  # of the previous block's epilogue, per k step of the next
    configure_tiles = tile_configuration()

    @T.macro
    def store_row(c0, sw, sx, b, rf, yf, block, p, row, i):
        """Row i of the stored block (the matrix's row + i): dequantized, with its epilogue."""
        if row + i < m:
            for j in T.vectorized(out_block):
                if gated:
                    yf[row + i, p * out_block + j] = epilogue(dequantized(block[i, j] + c0[p * TILE + j], sx[row + i], sw[p * TILE + j],
                                                                          b[p * TILE + j])) \
                        * dequantized(block[i, out_block + j] + c0[p * TILE + out_block + j], sx[row + i], sw[p * TILE + out_block + j],
                                      b[p * TILE + out_block + j])
                elif residual:
                    yf[row + i, p * TILE + j] = dequantized(block[i, j] + c0[p * TILE + j], sx[row + i], sw[p * TILE + j],
                                                            b[p * TILE + j]) + rf[row + i, p * TILE + j]
                else:
                    yf[row + i, p * TILE + j] = epilogue(dequantized(block[i, j] + c0[p * TILE + j], sx[row + i],
                                                                     sw[p * TILE + j], b[p * TILE + j]))

    @T.macro
    def row_block(x, wq, w_lines, c0, sw, sx, b, rf, yf, block, p, row, halves, stored, block_index, prefetching):
        # halves: 2 for a whole block (accumulators tmm0-3, rows tmm4-5), 1 for its first 16 rows.
        # stored: the row of the block the buffer holds (-1: none), whose rows are dequantized a
        # few per k step, between this block's tile instructions (they overlap on the core).
        # block_index: which share of the next panel's lines it prefetches, where ``prefetching``
        # (a chunk's blocks; not a last half block, the panel's only one).
        for tile in T.unroll(2 * halves):
            T.evaluate(tile_instruction("tilezero", T.int8(tile)))
        for ks in range(k_steps):
            for half in T.unroll(halves):
                T.evaluate(tile_instruction("tileloadd64", T.int8(4 + half), T.address_of(x[row + 16 * half, ks * INT8_K_STEP]), T.int64(k)))
            T.evaluate(tile_instruction("tileloadd64", T.int8(6), T.address_of(wq[p, ks * 16, 0]), T.int64(panel_stride)))
            T.evaluate(tile_instruction("tileloadd64", T.int8(7), T.address_of(wq[p, ks * 16, 64]), T.int64(panel_stride)))
            for half in T.unroll(halves):
                T.evaluate(tile_instruction("tdpbusd", T.int8(2 * half), T.int8(4 + half), T.int8(6)))
                T.evaluate(tile_instruction("tdpbusd", T.int8(2 * half + 1), T.int8(4 + half), T.int8(7)))
            if p + 1 < panels and prefetching:
                prefetch_next_panel(w_lines, p, block_index * k_steps + ks)
            if stored >= 0:
                for r in range(rows_per_step):
                    if ks * rows_per_step + r < TILE:
                        store_row(c0, sw, sx, b, rf, yf, block, p, stored, ks * rows_per_step + r)
        for half in T.unroll(halves):
            T.evaluate(tile_instruction("tilestored64", T.int8(2 * half), T.address_of(block[16 * half, 0]), T.int64(TILE * 4)))
            T.evaluate(tile_instruction("tilestored64", T.int8(2 * half + 1), T.address_of(block[16 * half, 16]), T.int64(TILE * 4)))

    @T.prim_func(s_tir=True)
    def amx_int8_matmul(x: T.Buffer((rows, k), "uint8"), sx: T.Buffer((m,), "float32"),
                        wq: T.Buffer((panels, k // 4, panel_stride), "int8"), c0: T.Buffer((n,), "int32"),
                        sw: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32"), r: T.Buffer(residual_shape, "float32"),
                        y: T.Buffer((*lead, out_n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, INT8_KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("amx_int8_tiles"):
                T.reads(whole(x), whole(sx), whole(wq), whole(c0), whole(sw), whole(b), whole(r))
                T.writes(whole(y))
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                yf = T.decl_buffer((m, out_n), "float32", data=y.data)
                w_lines = T.decl_buffer((n * k,), "int8", data=wq.data)
                for mc in range(whole_blocks // chunk):
                    for p in T.parallel(panels):
                        configure_tiles()
                        block = T.alloc_buffer((TILE, TILE), "int32", scope="local")  # the accumulator tiles, stored
                        for mi in range(chunk):
                            row_block(x, wq, w_lines, c0, sw, sx, b, rf, yf, block, p, (mc * chunk + mi) * TILE, 2,
                                      T.if_then_else(mi > 0, (mc * chunk + mi - 1) * TILE, -1), mi, True)
                        for i in range(TILE):
                            store_row(c0, sw, sx, b, rf, yf, block, p, (mc * chunk + chunk - 1) * TILE, i)
                        T.evaluate(tile_instruction("tilerelease"))
                if half_block:
                    for p in T.parallel(panels):
                        configure_tiles()
                        block = T.alloc_buffer((TILE, TILE), "int32", scope="local")
                        row_block(x, wq, w_lines, c0, sw, sx, b, rf, yf, block, p, whole_blocks * TILE, 1, -1, 0, False)
                        for i in range(HALF_BLOCK):
                            store_row(c0, sw, sx, b, rf, yf, block, p, whole_blocks * TILE, i)
                        T.evaluate(tile_instruction("tilerelease"))

    assert isinstance(amx_int8_matmul, tvm.tirx.PrimFunc)
    return amx_int8_matmul


def instructions_in(executable) -> dict[str, int]:
    """How many of each kernel's instruction (``tdpbf16ps``, ``tdpbusd``) the executable's CPU code holds."""
    assembly = assembly_of(executable)
    return {name: assembly.count(f"\t{name}\t") for name in INSTRUCTIONS}

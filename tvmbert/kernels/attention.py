"""fp32 self-attention as one hand-written kernel per layer. The pass ``attention-fp32``
(``passes/attention_fp32.py``) calls it.

As exported, a BERT layer's attention is nine kernels: the Q/K/V projection's output split in
three, each reshaped and transposed head-major (K transposed twice), ``Q K^T`` with its scale and
mask, softmax, ``P V``, and the transpose back: the split and transposes only move data, and the
matmuls and softmax each reread what the one before wrote (CHANGELOG.md, 2026-11-22). This kernel
reads Q, K and V where the projection wrote them (columns of its output) and writes its result
where the output projection reads it, so the moves vanish; per (sequence, head), K is transposed
once into a buffer in cache and V copied contiguous, the scores are computed on FMA register tiles,
scaled and masked as they are stored, the softmax runs over each row in cache (exp as
``scalar_math.exp_float32``) and ``P V`` accumulates in registers, divided by the row's sum as it
is stored (PyTorch divides the probabilities first). Sums run in another order and the scale and
mask may fuse into one FMA: within fp32 rounding of the graph. Shapes where the sequence or the
head size is not a multiple of the vector lanes keep the graph.

Where the projection runs on the FMA kernel or the vector int8 one and nothing else reads its
result, that kernel writes it panel-major instead (``passes/attention_fp32.PANEL_MAJOR_KERNELS``;
with bert-base's 64-column panels, one panel per head's Q, K or V) and this one reads the panels,
both faster for it; where a panel is one
head's V, ``P V`` reads it in place, uncopied. With ``--dtype bfloat16`` on AMX only the weight
matmuls are bf16 and the attention runs here too, in place of the graph's kernels (the
measurements: CHANGELOG.md, 2026-11-22).

``amx_bf16_kernel`` is the same attention with its two matmuls on AMX-BF16 tiles, for int8 builds
on AMX (``passes/pipeline.PassContext.attention_on_amx``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvmbert.kernels.amx import KERNEL_ATTR as AMX_KERNEL_ATTR
from tvmbert.kernels.amx import TILE, tile_configuration, tile_instruction
from tvmbert.kernels.fma import CACHE_LINE, STACK_BYTES, prefetch_to_l2, whole
from tvmbert.kernels.scalar_math import exp_float32

KERNEL_ATTR = "tvmbert.attention_f32"  # PrimFunc attribute marking the kernel (build counts them)
ROWS = 4  # query rows per register tile
# A block of query rows' scores is at most this many bytes: beside the head's K^T and V (64 KiB
# each per 256 tokens at bert-base's head size) it stays in a core's L2 while the block's
# softmax and P V reread it, where a whole head's scores (1 MiB at 512 tokens) would not.
SCORES_BYTES = 64 * 1024
# Past this many keys a head's keys are taken a block at a time, the softmax kept running (the
# row's max and sum so far, the output rescaled as they grow: flash attention's online softmax):
# whole rows of scores within SCORES_BYTES would leave blocks of 8 query rows at 2048 tokens and
# 4 at 4096, each rereading the head's K^T and V (1 MiB each at 4096 tokens) from past L2.
KEY_BLOCK = 512
SOFTMAX_VECTORS = 4  # vectors of a row's scores per softmax step (softmax_vectors)


@dataclass(frozen=True)
class _Grid:
    """Where each kernel here finds sequence b's token s, head h, in Q, K, V and the mask: the
    operands' layouts as ``kernel`` describes them."""

    batch: int
    heads: int
    seq: int
    dim: int
    lanes: int
    sources: tuple
    mask_shape: tuple | None
    tokens: int | None
    panel: int

    def __post_init__(self):
        assert all(offset % self.lanes == 0 and (not self.panel or columns % self.panel == 0)
                   for columns, offset in self.sources), self.sources
        object.__setattr__(self, "mask_shape", tuple(self.mask_shape) if self.mask_shape else (1,))

    @property
    def masked(self) -> bool:
        return len(self.mask_shape) == 4

    @property
    def rows_shape(self) -> tuple[int, ...]:
        return (self.batch * self.seq,) if self.tokens is not None else (1,)

    @property
    def rows_dtype(self) -> str:
        return "int64" if self.tokens is not None else "int32"

    def operand_shape(self, columns: int) -> tuple[int, ...]:
        operand_rows = self.tokens if self.tokens is not None else self.batch * self.seq
        return (columns // self.panel, operand_rows, self.panel) if self.panel else (operand_rows, columns)

    def row(self, rows, at):
        """The operands' row of grid position ``at`` (b * seq + s)."""
        from tvm.script import tirx as T

        return T.Cast("int32", rows[at]) if self.tokens is not None else at

    def at(self, operand, at_row, block, x):
        """Element ``x`` of the ``block``-th ``lanes`` columns of row ``at_row``, in either layout."""
        if self.panel:
            return operand[block // (self.panel // self.lanes), at_row, block % (self.panel // self.lanes) * self.lanes + x]
        return operand[at_row, block * self.lanes + x]

    def head_row(self, operand, rows, which: int, bh, s, block, x):
        """Element ``x`` of the ``block``-th lanes of head ``bh``'s row ``s`` in Q (0), K (1) or V (2)."""
        offset = self.sources[which][1]
        return self.at(operand, self.row(rows, bh // self.heads * self.seq + s), (offset + bh % self.heads * self.dim) // self.lanes + block, x)

    def mask_at(self, mask, b, h, i, j):
        index = [b, h, i, j]
        return mask[tuple(0 if size == 1 else at for size, at in zip(self.mask_shape, index))]


def _across_lanes(partial, count: int, combine, lanes: int | None = None):
    """The ``count`` values of ``partial`` combined as a tree: 4 dependent steps where a chain
    of 16 takes 15. With ``lanes``, its vectors are first combined into one, lane by lane (whole
    vector instructions), then that vector's lanes."""
    values = [partial[x] for x in range(count)]
    while lanes and len(values) > lanes:
        values = [combine(a, b) for a, b in zip(values[:len(values) // 2], values[len(values) // 2:])]
    while len(values) > 1:
        values = [combine(a, b) for a, b in zip(values[::2], values[1::2])]
    return values[0]


def vectors_per_tile(count: int, lanes: int) -> int:
    """Vectors per row of a register tile over ``count`` vectors: ``ROWS`` x this many
    accumulators leave registers for the loads (32 vector registers with AVX-512, 16 with AVX2).
    A power of two: a tile of three (48 floats, at 48 or 96 tokens) became one vector of 48
    lanes that LLVM widened and split, and the attention at 48 tokens took 14x its time at one."""
    return next(v for v in ((4, 2, 1) if lanes >= 16 else (2, 1)) if count % v == 0)


@dataclass(frozen=True)
class KeySpan:
    """The keys a block of ``rows`` query rows from ``first_row`` on attends to, in whole
    ``align``-wide blocks: all of them, or with a window, those within it."""

    seq: int
    rows: int
    window: int | None
    align: int

    def first(self, first_row):
        from tvm.script import tirx as T

        if self.window is None:
            return 0
        return T.max(first_row - self.window, 0) // self.align * self.align

    def end(self, first_row):
        from tvm.script import tirx as T

        if self.window is None:
            return self.seq
        return T.min((first_row + self.rows - 1 + self.window) // self.align * self.align + self.align, self.seq)


def window_block(seq: int, window: int, align: int) -> tuple[int, int]:
    """(query rows a block, the most keys its span holds) for a windowed kernel whose scores
    hold a block's span alone: the block computing the fewest scores in all (a span is the
    block's rows and the window either side, on whole ``align``-wide blocks: ModernBERT-base's
    32 rows and 64 keys either side, 160 keys) whose scores stay within SCORES_BYTES; blocks of
    16 rows or more, ties to the larger (each block's softmax and P V loops start over). Where
    none fits (a window of ~500 keys or more), ROWS rows and room for every key."""
    best = None
    for rows in range(4 * ROWS, seq + 1, 4 * ROWS):
        if seq % rows:
            continue
        span = key_span(seq, rows, window, align)
        spans = [int(span.end(first)) - int(span.first(first)) for first in range(0, seq, rows)]
        if rows * max(spans) * 4 <= SCORES_BYTES and (best is None or sum(spans) * rows <= best[0]):
            best = (sum(spans) * rows, rows, max(spans))
    return (best[1], best[2]) if best else (ROWS, seq)


def key_span(seq: int, rows: int, window: int | None, align: int) -> KeySpan:
    """A window that covers every key of every block computes them all, as without one."""
    assert seq % align == 0, (seq, align)
    return KeySpan(seq, rows, window if window is not None and window < seq else None, align)


def window_mask(window: int | None):
    """``windowed(i, j, score)``: the score, or the float32 minimum where query i and key j are
    more than ``window`` apart (the graph's mask value)."""
    from tvm.script import tirx as T

    if window is None:
        return lambda i, j, score: score
    return lambda i, j, score: T.Select(T.abs(i - j) <= window, score, T.float32(-3.4028234663852886e38))


@dataclass(frozen=True)
class Positions:
    """DeBERTa's position scores, which the kernels add to each score where the graph adds a
    [batch x heads, seq, seq] tensor of them gathered from two products (its c2p and p2c): query
    i's score of key j gains ``c2p[bh, i, query_table[i - j + S - 1]] * query_factor`` and
    ``p2c[bh, j, key_table[j - i + S - 1]] * key_factor``, the tables each relative position's
    column in its product. The kernel reads both tables as ``index`` (``index`` below): a row
    each, in key order. A term the model lacks has factor None (its operand one unread float).

    The operands are the products, [B * H, S, columns], or with ``weights`` what they multiply
    each head's Q and K by, [H, D, columns] (the position keys and queries, projected and transposed):
    ``kernel`` then computes the products itself, on register tiles as its scores, c2p a block
    of query rows at a time (the graph's batched matmuls ran at a third of the kernel's rate,
    and wrote [B * H, S, columns] twice a layer)."""

    query_factor: float | None
    key_factor: float | None
    query_columns: int = 1
    key_columns: int = 1
    weights: bool = False

    def shapes(self, batch: int, heads: int, seq: int, dim: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
        """The by_query, by_key and index operands' shapes."""
        lead = (heads, dim) if self.weights else (batch * heads, seq)
        return ((*lead, self.query_columns) if self.query_factor is not None else (1,),
                (*lead, self.key_columns) if self.key_factor is not None else (1,), (2, 2 * seq - 1))

    @staticmethod
    def index(query_table, key_table):
        """The kernel's [2, 2 S - 1] int32 ``index``: entry u of each row holds the column of
        query i and key j = i + u - (S - 1) in its product (row 0 c2p's, row 1 p2c's), so that a
        vector of keys reads consecutive entries."""
        import numpy as np

        return np.stack([np.asarray(query_table)[::-1], np.asarray(key_table)]).astype("int32")

    def product_rows(self, by_query, by_key, bh, i, j):
        """TIR: the addresses of query i's row of the c2p product and key j's of the p2c product,
        where the operands are the products (None for a term the model lacks)."""
        from tvm.script import tirx as T

        return (T.address_of(by_query[bh, i, 0]) if self.query_factor is not None else None,
                T.address_of(by_key[bh, j, 0]) if self.key_factor is not None else None)

    def scores(self, seq: int, lanes: int, index, i, first, query_row, key_rows):
        """TIR: the position scores of query i and keys first .. first + lanes, a vector, from
        the address of query i's c2p row and key ``first``'s p2c row (the next keys' rows
        following, ``key_columns`` apart); each term one hardware gather (its columns vary
        along the keys, and p2c's rows too: a vector index of scalar loads cost 6-7 cycles a
        score). The products the kernel computes carry their factor already."""
        from tvm.script import tirx as T

        at = T.Ramp(seq - 1 - i + first, 1, lanes)
        terms = []
        for factor, gathered in ((self.query_factor, lambda: gather_floats(query_row, index[0, at], lanes)),
                                 (self.key_factor, lambda: gather_floats(key_rows, T.Ramp(0, self.key_columns, lanes) + index[1, at], lanes))):
            if factor is not None:
                terms.append(gathered() if self.weights else gathered() * T.Broadcast(T.float32(factor), lanes))
        return terms[0] + terms[1] if len(terms) == 2 else terms[0]


def gather_floats(base, offsets, lanes: int):
    """TIR: the float32 vector ``base[offsets]`` (int32 offsets, in floats) by AVX-512's or
    AVX2's gather: TVM scalarizes a load at a vector of indices (an extract, a load and an
    insert a lane)."""
    from tvm.script import tirx as T

    if lanes == 16:
        return T.call_llvm_pure_intrin("float32x16", T.llvm_lookup_intrinsic_id("llvm.x86.avx512.mask.gather.dps.512"),
                                       T.Broadcast(T.float32(0), 16), base, offsets, T.Broadcast(T.bool(True), 16), T.int32(4))
    assert lanes == 8, lanes
    return T.call_llvm_pure_intrin("float32x8", T.llvm_lookup_intrinsic_id("llvm.x86.avx2.gather.d.ps.256"),
                                   T.Broadcast(T.float32(0), 8), base, offsets, T.reinterpret("float32x8", T.Broadcast(T.int32(-1), 8)),
                                   T.int8(4))


def softmax_vectors(seq: int, lanes: int) -> int:
    """Vectors of a score row the softmax takes at a time: its exp is a chain of ~25 dependent
    instructions, which the CPU overlaps only across the vectors of one loop step (one vector a
    step left the softmax latency-bound, ~20% of the kernel at 512 tokens)."""
    return next(v for v in (SOFTMAX_VECTORS, 2, 1) if seq % (v * lanes) == 0)


def key_alignment(seq: int, lanes: int) -> int:
    """The width, in keys, that a block of keys starts and ends on: whole score tiles and whole
    softmax steps."""
    return math.lcm(vectors_per_tile(seq // lanes, lanes) * lanes, softmax_vectors(seq, lanes) * lanes)


def key_block(seq: int, align: int) -> int:
    """Keys done at a time: all of them up to KEY_BLOCK, else KEY_BLOCK's whole ``align``-wide
    blocks (the last block of a head may be shorter)."""
    return seq if seq <= KEY_BLOCK else max(KEY_BLOCK // align, 1) * align


def query_block(seq: int, keys: int | None = None) -> int:
    """Query rows done at a time: the most, dividing ``seq`` in whole register tiles, whose
    scores over ``keys`` keys (all of them by default) stay within SCORES_BYTES (one tile's at least)."""
    keys = seq if keys is None else keys
    return max([rows for rows in range(ROWS, seq + 1, ROWS) if seq % rows == 0 and rows * keys * 4 <= SCORES_BYTES] or [ROWS])


def fits(seq: int, dim: int, lanes: int) -> bool:
    return lanes > 0 and seq % lanes == 0 and dim % lanes == 0


def _attention_function(grid: _Grid, positions: Positions | None, attributes: dict, name: str, every_head, out_dtype: str = "float32"):
    """A kernel's PrimFunc: its operands (``kernel``'s, and with ``positions`` the three that
    DeBERTa's position scores read, before ``y``, in ``out_dtype``) around one block of
    ``every_head``, a macro of its loops over them."""
    import tvm
    from tvm.script import tirx as T

    batch, heads, seq, dim = grid.batch, grid.heads, grid.seq, grid.dim
    (q_columns, _), (k_columns, _), (v_columns, _) = grid.sources
    mask_shape = grid.mask_shape
    attributes = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8, **attributes}
    if positions is None:
        @T.prim_func(s_tir=True)
        def attention(q: T.Buffer(grid.operand_shape(q_columns), "float32"), k: T.Buffer(grid.operand_shape(k_columns), "float32"),
                      v: T.Buffer(grid.operand_shape(v_columns), "float32"), mask: T.Buffer(mask_shape, "float32"),
                      rows: T.Buffer(grid.rows_shape, grid.rows_dtype), y: T.Buffer((batch, seq, heads, dim), out_dtype)):
            T.func_attr(attributes)
            with T.sblock("root"):
                with T.sblock(name):
                    T.reads(whole(q), whole(k), whole(v), whole(mask), whole(rows))
                    T.writes(whole(y))
                    every_head(q, k, v, mask, rows, rows, rows, rows, y)  # no position operands: nothing reads them
    else:
        query_shape, key_shape, index_shape = positions.shapes(batch, heads, seq, dim)

        @T.prim_func(s_tir=True)
        def attention(q: T.Buffer(grid.operand_shape(q_columns), "float32"), k: T.Buffer(grid.operand_shape(k_columns), "float32"),
                      v: T.Buffer(grid.operand_shape(v_columns), "float32"), mask: T.Buffer(mask_shape, "float32"),
                      rows: T.Buffer(grid.rows_shape, grid.rows_dtype), by_query: T.Buffer(query_shape, "float32"),
                      by_key: T.Buffer(key_shape, "float32"), index: T.Buffer(index_shape, "int32"),
                      y: T.Buffer((batch, seq, heads, dim), out_dtype)):
            T.func_attr(attributes)
            with T.sblock("root"):
                with T.sblock(name):
                    T.reads(whole(q), whole(k), whole(v), whole(mask), whole(rows), whole(by_query), whole(by_key), whole(index))
                    T.writes(whole(y))
                    every_head(q, k, v, mask, rows, by_query, by_key, index, y)

    assert isinstance(attention, tvm.tirx.PrimFunc)
    return attention


def kernel(batch: int, heads: int, seq: int, dim: int, lanes: int, sources, mask_shape: tuple[int, ...] | None,
           scale: float | None, tokens: int | None = None, panel: int = 0, window: int | None = None,
           positions: Positions | None = None):
    """The PrimFunc ``y[b, s, h, :] = softmax(q_h[s] K_h^T * scale + mask) V_h`` for every
    sequence b and head h, where ``sources`` gives, for Q, K and V in turn, ``(columns, offset)``:
    each is read from a ``[batch * seq, columns]`` operand, head h's ``dim`` columns starting at
    ``offset + h * dim``. ``mask`` broadcasts to ``[batch, heads, seq, seq]``; without one it is
    one unread float. With ``tokens`` (a packed build: ``packing.py``), the operands hold that
    many rows and the int64 ``rows[batch * seq]`` says which one holds sequence b's token s (in
    range: the packer makes it); otherwise ``rows`` is one unread int32. With ``panel``, each
    operand is held panel-major, ``[columns / panel, rows, panel]`` (``passes/attention_fp32.PANEL_MAJOR_KERNELS``).
    With ``window`` (ModernBERT's local layers), a score whose query and key are more than
    ``window`` positions apart is masked, and only the key blocks within the window of a block
    of query rows are computed (``key_span``): the work grows with the sequence, not its square.
    Without one, past KEY_BLOCK tokens, keys a block at a time with a running softmax (``key_block``).
    With ``positions`` (DeBERTa), each score gains its position scores (``Positions``), read from
    three more operands after ``rows``: by_query, by_key and index."""
    from tvm.script import tirx as T

    assert fits(seq, dim, lanes), (seq, dim, lanes)
    assert positions is None or window is None, "DeBERTa has no window"
    grid = _Grid(batch, heads, seq, dim, lanes, sources, mask_shape, tokens, panel)
    (q_columns, q_offset), (k_columns, k_offset), (v_columns, v_offset) = grid.sources
    # A window's key span is its block of query rows and the window either side, on whole
    # ``align``-wide blocks: score tiles and softmax steps of two vectors keep it tight (ModernBERT's
    # 32 query rows and 64 keys either side: 160 keys, where 64-wide blocks made it 192).
    narrow = window is not None and window < seq and (seq // lanes) % 2 == 0
    score_width = 2 * lanes if narrow else vectors_per_tile(seq // lanes, lanes) * lanes
    out_width = vectors_per_tile(dim // lanes, lanes) * lanes
    # The position products the kernel computes (``Positions.weights``): c2p's and p2c's columns, a tile's width of them.
    computed = positions is not None and positions.weights
    computes_query, computes_key = (computed and positions.query_factor is not None, computed and positions.key_factor is not None)
    query_columns = positions.query_columns if computes_query else lanes
    key_columns = positions.key_columns if computes_key else lanes
    assert query_columns % lanes == 0 and key_columns % lanes == 0, (query_columns, key_columns)
    query_width, key_width = (vectors_per_tile(columns // lanes, lanes) * lanes for columns in (query_columns, key_columns))
    width = max(score_width, out_width, query_width, key_width)
    softmax_width = score_width if narrow else softmax_vectors(seq, lanes) * lanes
    align = score_width if narrow else key_alignment(seq, lanes)
    # A block of query rows' scores, softmax and P V a block of keys at a time; a window bounds a
    # block's keys already (``key_span``: its rows and the window either side), so it takes them at
    # once (both together gave NaNs past one block of query rows at 1024 tokens: the scores buffer
    # mis-sized, it seems, by TVM's buffer compaction, whose region bound divided by zero in a variant).
    keys = key_block(seq, align) if window is None or window >= seq else seq
    single = keys >= seq  # one block of keys: no running max and sum, the output stored once
    # Narrow windowed tiles keep a block's scores from its span's first key on, so that the
    # block stays the one computing fewest scores at any length (scores over every key made it
    # 8 query rows at 2048 tokens, each computing a span of 160 keys).
    block_rows, span_keys = window_block(seq, window, align) if narrow else (query_block(seq, keys), keys)
    mask_shape, masked, scale_by = grid.mask_shape, grid.masked, T.float32(scale if scale is not None else 1.0)
    row, at, mask_at = grid.row, grid.at, grid.mask_at
    windowed = window_mask(window)
    span = key_span(seq, block_rows, window, align)
    lowest = T.float32(-3.4028234663852886e38)

    def across_lanes(partial, combine):
        return _across_lanes(partial, softmax_width, combine, lanes)

    def base(b0, kb):  # the key of the scores' first column
        return span.first(b0 * block_rows) if narrow else kb * keys

    def keys_first(b0, kb):  # the first key of block kb that query block b0 attends to
        return T.max(kb * keys, span.first(b0 * block_rows))

    def keys_end(b0, kb):
        return T.min(kb * keys + keys, span.end(b0 * block_rows))

    # The next head's Q, K and V rows (strided columns of the operands, which the hardware
    # prefetcher does not follow) are prefetched while this head's scores are computed, spread
    # over its score tiles, so that they arrive by the time they are read (CHANGELOG.md, 2026-11-22).
    line_floats = CACHE_LINE // 4
    row_lines = -(-dim // line_floats)
    row_tiles = (span_keys if narrow else seq) // score_width  # score tiles a row of tiles: over a windowed block's span at most
    per_tile = -(-seq * row_lines // ((seq // ROWS) * row_tiles))

    def prefetched_line(b0, t, c, n):
        """The n-th line the score tile (b0, t, c) prefetches: each tile its share, in order (a
        windowed block's tiles counted from its span's first)."""
        local = c - base(b0, 0) // score_width if narrow else c
        return ((b0 * (block_rows // ROWS) + t) * row_tiles + local) * per_tile + n

    def prefetch_next_head(operand, offset, rows, bh, line):
        line = T.min(line, seq * row_lines - 1)
        after = T.min(bh + 1, batch * heads - 1)
        return prefetch_to_l2(T.address_of(at(operand, row(rows, after // heads * seq + line // row_lines),
                                              (offset + after % heads * dim + line % row_lines * line_floats) // lanes, 0)))

    # A register tile's accumulators, ROWS x width floats, in two buffers of ROWS / 2 rows: TVM
    # puts a buffer on the stack (where LLVM keeps it in registers) only under fma.STACK_BYTES;
    # a larger one is a heap workspace, zeroed by memset and stored back at every tile.
    half = ROWS // 2
    assert half * width * 4 <= STACK_BYTES, width
    # Where a panel is exactly one head's V (bert-base: 64 columns) and the rows are the grid's,
    # P V reads V where the projection wrote it, contiguous already.
    v_in_place = panel == dim and tokens is None and v_offset % panel == 0

    @T.macro
    def zero(acc, columns):
        for i in T.unroll(half):
            for x in T.vectorized(columns):
                acc[i, x] = T.float32(0)

    @T.macro
    def score_fma(q, kt, rows, acc, bh, first, c, d0, e):  # query rows first .. first + half
        for i in T.unroll(half):
            for x in T.vectorized(score_width):
                acc[i, x] = acc[i, x] + grid.head_row(q, rows, 0, bh, first + i, d0, e) \
                    * kt[d0 * lanes + e, c * score_width + x]

    def scaled(product, written):  # a score tile's product scaled, plus the position scores written in its place first
        return product * scale_by + written if positions is not None else product * scale_by

    # ``local`` is a row of the block's scores, ``first`` the same row of the sequence; ``base``
    # the key at the block's first column.
    @T.macro
    def score_store(mask, scores, acc, bh, local, first, c, base):
        for i in T.unroll(half):
            for x in T.vectorized(score_width):
                if masked:
                    scores[local + i, c * score_width - base + x] = windowed(
                        first + i, c * score_width + x, scaled(acc[i, x], scores[local + i, c * score_width - base + x]) + mask_at(
                            mask, bh // heads, bh % heads, first + i, c * score_width + x))
                else:
                    scores[local + i, c * score_width - base + x] = windowed(
                        first + i, c * score_width + x, scaled(acc[i, x], scores[local + i, c * score_width - base + x]))

    @T.macro
    def position_product(operand, which, rows, weights, product, acc_top, acc_bottom, bh, first, count, columns, tile_width, factor):
        """``product[r] = (row first + r of head bh's Q (which 0) or K (1)) @ weights[its head] * factor``
        for r < count, on register tiles as the scores."""
        for t in range(count // ROWS):
            for c in range(columns // tile_width):
                zero(acc_top, tile_width)
                zero(acc_bottom, tile_width)
                for d0, e in T.grid(dim // lanes, lanes):
                    for i in T.unroll(half):
                        for x in T.vectorized(tile_width):
                            acc_top[i, x] = acc_top[i, x] + grid.head_row(operand, rows, which, bh, first + t * ROWS + i, d0, e) \
                                * weights[bh % heads, d0 * lanes + e, c * tile_width + x]
                            acc_bottom[i, x] = acc_bottom[i, x] + grid.head_row(operand, rows, which, bh, first + t * ROWS + half + i, d0, e) \
                                * weights[bh % heads, d0 * lanes + e, c * tile_width + x]
                for i in T.unroll(half):
                    for x in T.vectorized(tile_width):
                        product[t * ROWS + i, c * tile_width + x] = acc_top[i, x] * T.float32(factor)
                        product[t * ROWS + half + i, c * tile_width + x] = acc_bottom[i, x] * T.float32(factor)

    def product_rows(by_query, by_key, query_products, key_products, bh, i, local, j):
        """The addresses of query i's c2p row (``local`` in the block) and key j's p2c row: in the
        products the kernel computed, or in the operands."""
        if not computed:
            return positions.product_rows(by_query, by_key, bh, i, j)
        return (T.address_of(query_products[local, 0]) if computes_query else None,
                T.address_of(key_products[j, 0]) if computes_key else None)

    @T.macro
    def position_scores(by_query, by_key, index, query_products, key_products, scores, bh, b0, kb):
        """The block's position scores, where its score tiles add theirs, a vector of keys at a time."""
        for c in range(keys_first(b0, kb) // lanes, keys_end(b0, kb) // lanes):
            for i in range(block_rows):
                scores[i, T.Ramp(c * lanes - base(b0, kb), 1, lanes)] = positions.scores(
                    seq, lanes, index, b0 * block_rows + i, c * lanes,
                    *product_rows(by_query, by_key, query_products, key_products, bh, b0 * block_rows + i, i, c * lanes))

    @T.macro
    def output_start(out, rescale, acc, local, c):  # what the blocks of keys before this one summed, rescaled
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                acc[i, x] = out[local + i, c * out_width + x] * rescale[local + i]

    @T.macro
    def output_fma(scores, v, vh, acc, bh, local, c, j, base):
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                if v_in_place:
                    acc[i, x] = acc[i, x] + scores[local + i, j - base] * v[(v_offset + bh % heads * dim) // panel, bh // heads * seq + j,
                                                                            c * out_width + x]
                else:
                    acc[i, x] = acc[i, x] + scores[local + i, j - base] * vh[j, c * out_width + x]

    @T.macro
    def output_store(y, totals, acc, bh, local, first, c):
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                y[bh // heads, first + i, bh % heads, c * out_width + x] = acc[i, x] / totals[local + i]

    @T.macro
    def output_keep(out, acc, local, c):
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                out[local + i, c * out_width + x] = acc[i, x]

    @T.macro
    def key_block_step(q, k, v, mask, rows, by_query, by_key, index, query_products, key_products, y, kt, vh, scores, totals, row_max,
                       rescale, out, acc_top, acc_bottom, partial, bh, b0, kb, last):
        """Query block b0 over key block kb: its scores, their softmax (with the running max and
        sum of the blocks before unless ``single``) and P V, added to ``out`` or, ``last``, the
        output divided by the row sums."""
        # scores = Q K^T * scale + mask [+ position scores], a register tile at a time
        if positions is not None:
            position_scores(by_query, by_key, index, query_products, key_products, scores, bh, b0, kb)
        for t in range(block_rows // ROWS):
            for c in range(keys_first(b0, kb) // score_width, keys_end(b0, kb) // score_width):
                zero(acc_top, score_width)
                zero(acc_bottom, score_width)
                for n in T.unroll(per_tile):
                    T.evaluate(prefetch_next_head(q, q_offset, rows, bh, prefetched_line(b0, t, c, n)))
                    T.evaluate(prefetch_next_head(k, k_offset, rows, bh, prefetched_line(b0, t, c, n)))
                    T.evaluate(prefetch_next_head(v, v_offset, rows, bh, prefetched_line(b0, t, c, n)))
                for d0, e in T.grid(dim // lanes, lanes):
                    score_fma(q, kt, rows, acc_top, bh, b0 * block_rows + t * ROWS, c, d0, e)
                    score_fma(q, kt, rows, acc_bottom, bh, b0 * block_rows + t * ROWS + half, c, d0, e)
                score_store(mask, scores, acc_top, bh, t * ROWS, b0 * block_rows + t * ROWS, c, base(b0, kb))
                score_store(mask, scores, acc_bottom, bh, t * ROWS + half, b0 * block_rows + t * ROWS + half, c, base(b0, kb))
        # softmax's max, exp and sum over each row
        for i in range(block_rows):
            for x in T.vectorized(softmax_width):
                partial[x] = scores[i, keys_first(b0, kb) - base(b0, kb) + x]
            for c in range(keys_first(b0, kb) // softmax_width + 1, keys_end(b0, kb) // softmax_width):
                for x in T.vectorized(softmax_width):
                    partial[x] = T.max(partial[x], scores[i, c * softmax_width - base(b0, kb) + x])
            if single:
                row_max[i] = across_lanes(partial, T.max)
            else:
                rescale[i] = exp_float32(row_max[i] - T.max(row_max[i], across_lanes(partial, T.max)))
                row_max[i] = T.max(row_max[i], across_lanes(partial, T.max))
            for x in T.vectorized(softmax_width):
                partial[x] = T.float32(0)
            for c in range(keys_first(b0, kb) // softmax_width, keys_end(b0, kb) // softmax_width):
                for x in T.vectorized(softmax_width):
                    scores[i, c * softmax_width - base(b0, kb) + x] = exp_float32(scores[i, c * softmax_width - base(b0, kb) + x] - row_max[i])
                    partial[x] = partial[x] + scores[i, c * softmax_width - base(b0, kb) + x]
            if single:
                totals[i] = across_lanes(partial, lambda a, b: a + b)
            else:
                totals[i] = totals[i] * rescale[i] + across_lanes(partial, lambda a, b: a + b)
        # P V (over all keys: divided by the sums as stored; else added to the blocks' before)
        for t in range(block_rows // ROWS):
            for c in range(dim // out_width):
                if single:
                    zero(acc_top, out_width)
                    zero(acc_bottom, out_width)
                else:
                    output_start(out, rescale, acc_top, t * ROWS, c)
                    output_start(out, rescale, acc_bottom, t * ROWS + half, c)
                for j in range(keys_first(b0, kb), keys_end(b0, kb)):
                    output_fma(scores, v, vh, acc_top, bh, t * ROWS, c, j, base(b0, kb))
                    output_fma(scores, v, vh, acc_bottom, bh, t * ROWS + half, c, j, base(b0, kb))
                if last:
                    output_store(y, totals, acc_top, bh, t * ROWS, b0 * block_rows + t * ROWS, c)
                    output_store(y, totals, acc_bottom, bh, t * ROWS + half, b0 * block_rows + t * ROWS + half, c)
                else:
                    output_keep(out, acc_top, t * ROWS, c)
                    output_keep(out, acc_bottom, t * ROWS + half, c)

    @T.macro
    def every_head(q, k, v, mask, rows, by_query, by_key, index, y):
        for bh in T.parallel(batch * heads):
            kt = T.alloc_buffer((dim, seq), "float32")
            vh = T.alloc_buffer((1, 1) if v_in_place else (seq, dim), "float32")  # (TVM has no empty buffer)
            scores = T.alloc_buffer((block_rows, span_keys), "float32")
            totals = T.alloc_buffer((block_rows,), "float32")
            row_max = T.alloc_buffer((block_rows,), "float32")
            rescale = T.alloc_buffer((1,) if single else (block_rows,), "float32")
            out = T.alloc_buffer((1, 1) if single else (block_rows, dim), "float32")  # P V over the blocks of keys so far
            acc_top = T.alloc_buffer((half, width), "float32")
            acc_bottom = T.alloc_buffer((half, width), "float32")
            partial = T.alloc_buffer((softmax_width,), "float32")
            block = T.alloc_buffer((lanes, lanes), "float32", scope="local")
            # the position products the kernel computes: p2c's for every key, c2p's for a block of query rows
            query_products = T.alloc_buffer((block_rows, query_columns) if computes_query else (1, 1), "float32")
            key_products = T.alloc_buffer((seq, key_columns) if computes_key else (1, 1), "float32")
            if computes_key:
                position_product(k, 1, rows, by_key, key_products, acc_top, acc_bottom, bh, 0, seq, key_columns, key_width,
                                 positions.key_factor)
            # this head's K transposed and V (unless read in place), contiguous (rows of the operands are far apart: cache sets)
            if not v_in_place:
                for j in range(seq):
                    for d0 in range(dim // lanes):
                        for x in T.vectorized(lanes):
                            vh[j, d0 * lanes + x] = grid.head_row(v, rows, 2, bh, j, d0, x)
            for j0 in range(seq // lanes):  # in lanes x lanes blocks through registers
                for d0 in range(dim // lanes):
                    for r in T.unroll(lanes):
                        for x in T.vectorized(lanes):
                            block[r, x] = grid.head_row(k, rows, 1, bh, j0 * lanes + r, d0, x)
                    for c in T.unroll(lanes):
                        for x in T.vectorized(lanes):
                            kt[d0 * lanes + c, j0 * lanes + x] = block[x, c]
            for b0 in range(seq // block_rows):  # a block of query rows: its scores stay in cache
                if computes_query:
                    position_product(q, 0, rows, by_query, query_products, acc_top, acc_bottom, bh, b0 * block_rows, block_rows,
                                     query_columns, query_width, positions.query_factor)
                if single:
                    key_block_step(q, k, v, mask, rows, by_query, by_key, index, query_products, key_products, y, kt, vh, scores, totals,
                                   row_max, rescale, out, acc_top, acc_bottom, partial, bh, b0, 0, True)
                else:
                    for i in range(block_rows):
                        row_max[i] = lowest
                        totals[i] = T.float32(0)
                        for d in T.vectorized(dim):
                            out[i, d] = T.float32(0)
                    for kb in range(span.first(b0 * block_rows) // keys, (span.end(b0 * block_rows) - 1) // keys):
                        key_block_step(q, k, v, mask, rows, by_query, by_key, index, query_products, key_products, y, kt, vh, scores, totals,
                                       row_max, rescale, out, acc_top, acc_bottom, partial, bh, b0, kb, False)
                    key_block_step(q, k, v, mask, rows, by_query, by_key, index, query_products, key_products, y, kt, vh, scores, totals,
                                   row_max, rescale, out, acc_top, acc_bottom, partial, bh, b0, (span.end(b0 * block_rows) - 1) // keys, True)

    return _attention_function(grid, positions, {KERNEL_ATTR: True}, "attention_tiles", every_head)


def amx_bf16_fits(seq: int, dim: int, lanes: int) -> bool:
    """Whether ``amx_bf16_kernel`` takes a head: whole 32 x 32 blocks of tiles both ways."""
    return lanes == 16 and seq % TILE == 0 and dim % TILE == 0


# 2^f on [-1/2, 1/2] (ln2^k / k!, highest power first): within 2.4e-6 of it, where a probability
# rounded to bf16 keeps 2^-9.
EXP2_POLYNOMIAL = (1.3333558146428443e-3, 9.6181291076284772e-3, 5.5504108664821580e-2, 2.4022650695910071e-1,
                   6.9314718055994531e-1, 1.0)
LOG2_E = 1.4426950408889634
EXP2_FLOOR = -125.0  # 2^(-125 - 1/2) is still a normal float32: no subnormal probability, whose products stall


def _llvm_vector_call(dtype: str, name: str, *args):
    from tvm.script import tirx as T

    return T.call_llvm_pure_intrin(dtype, T.llvm_lookup_intrinsic_id(name), *args)


def _bf16_bits(value, lanes: int):
    """TIR: a vector of float32 rounded to bf16, half to even (``vcvtneps2bf16``, every AMX CPU
    has AVX512-BF16), its bits as uint16."""
    from tvm.script import tirx as T

    return T.reinterpret(f"uint16x{lanes}", _llvm_vector_call(f"bfloat16x{lanes}", "llvm.x86.avx512bf16.cvtneps2bf16.512", value))


def _widened(bits, lanes: int):
    """TIR: bf16 bits (uint16) as the float32 they are."""
    from tvm.script import tirx as T

    return T.reinterpret(f"float32x{lanes}", T.Cast(f"uint32x{lanes}", bits) << T.uint32(16))


def _bf16_rest_bits(value, lanes: int):
    """TIR: what rounding ``value`` to bf16 leaves (exact in float32), itself in bf16."""
    return _bf16_bits(value - _widened(_bf16_bits(value, lanes), lanes), lanes)


def _pairs(first, second, lanes: int):
    """TIR: two vectors of float32 in bf16 as AMX's pairs, a uint32 each (``first`` the low half)."""
    from tvm.script import tirx as T

    return T.Cast(f"uint32x{lanes}", second) << T.uint32(16) | T.Cast(f"uint32x{lanes}", first)


def _exp_of_difference(scores, row_max, lanes: int, floor: float = EXP2_FLOOR):
    """TIR: ``exp(scores - row_max)`` for a vector of 16 scores (AVX-512): 2^t (t the score in
    bits) as a polynomial in t's fraction, scaled by ``vscalefps`` by its integer part, within
    2.4e-6 of it. A masked score (-3.4e38) gives 2^floor, not 0: at EXP2_FLOOR 1e-38 of a row's
    weight, which no sum of fp32 keeps."""
    from tvm import tirx
    from tvm.script import tirx as T

    def vector(value):
        return T.Broadcast(T.float32(value), lanes)

    # The difference first: a row whose every key is masked has scores of ~-3.4e38, whose times
    # log2(e) overflows; their differences are 0, as in PyTorch's softmax (the values' mean).
    t = T.max((scores - T.Broadcast(row_max, lanes)) * vector(LOG2_E), vector(floor))
    whole_part = _llvm_vector_call(f"float32x{lanes}", "llvm.roundeven", t)
    fraction = t - whole_part
    power = vector(EXP2_POLYNOMIAL[0])
    for coefficient in EXP2_POLYNOMIAL[1:]:
        power = power * fraction + vector(coefficient)
    return _llvm_vector_call(f"float32x{lanes}", "llvm.x86.avx512.mask.scalef.ps.512", power, whole_part, power,
                             tirx.const(-1, "int16"), T.int32(4))


def bf16_probabilities(scores, row_max, lanes: int):
    """TIR: ``exp(scores - row_max)`` rounded to bf16 (its bits as uint16) for a vector of 16 scores
    (AVX-512 with AVX512-BF16, as every AMX CPU has), in 16 instructions where ``exp_float32``
    and the rounding by integer operations took 30, the softmax's cost on tiles (43% of the AMX
    kernel at 512 tokens): ``_exp_of_difference``, rounded half to even by ``vcvtneps2bf16``."""
    return _bf16_bits(_exp_of_difference(scores, row_max, lanes), lanes)


def amx_bf16_kernel(batch: int, heads: int, seq: int, dim: int, lanes: int, sources, mask_shape: tuple[int, ...] | None,
                    scale: float | None, tokens: int | None = None, panel: int = 0, window: int | None = None,
                    positions: Positions | None = None, bf16_scores: bool = False, out_dtype: str = "float32"):
    """``kernel``'s attention (same operands and output, DeBERTa's position scores too) with its two matmuls on AMX-BF16
    (``tdpbf16ps``, fp32 sums), for the int8 build on AMX, where the fp32 kernel took a quarter of
    bert-base's time at 8 x 128 (docs/benchmarks.md, int8 on Sapphire Rapids).

    The scores to about 16 bits: Q and K split in a bf16 part and a bf16 rest, ``Qh Kh + Qh Kl +
    Ql Kh`` (what is left out, ``Ql Kl``, is 2^-16 of a product; bf16 alone keeps 2^-8). With
    ``bf16_scores`` one product, ``Qh Kh``: Q and K rounded to bf16 as a bf16 model's own are
    (``--dtype bfloat16`` builds; PyTorch's bf16 attention scores so). The
    softmax's exp turns a score's error into the probability's: with scores of +-30 one product
    misses P V's own bf16 error 3-7-fold (tests/test_attention.py); on all-MiniLM-L6-v2's real
    tokens it measured no different. Three products on tiles cost less than the conversions.
    P V on bf16 probabilities and values (2^-8 of a probability at most, and linear), divided by
    the sum of those bf16 probabilities, so that a row's weights sum to 1; scale, mask and
    softmax in fp32, as in ``kernel``.

    Per (sequence, head): Q and the probabilities as bf16 rows (row tiles, 32 values a row), K
    and V as AMX's pairs (``Wp[K/2, N, 2]``: K^T's by hardware gathers of K's bf16 rows, V's by
    interleaving pairs of rows), then 32 x 32 blocks of four accumulator tiles (tmm0-3), row
    tiles in tmm4-5 and pair tiles in tmm6-7, as ``amx.bf16_kernel``. Scores, softmax and P V go
    32 query rows at a time, as the fp32 kernel's blocks do: a whole head's scores and
    probabilities (1.5 MiB at 512 tokens) beside K's and V's pairs outgrew a core's 2 MiB L2.
    With ``window``, as ``kernel``: only the key blocks within it. ``out_dtype`` bfloat16: y
    rounded to bf16 as it is stored, for a bf16 build's next projection."""
    from tvm.script import tirx as T

    assert amx_bf16_fits(seq, dim, lanes), (seq, dim, lanes)
    assert positions is None or (window is None and not positions.weights), "DeBERTa has no window; its products come computed"
    span = key_span(seq, TILE, window, TILE)
    windowed = window_mask(window)
    grid = _Grid(batch, heads, seq, dim, lanes, sources, mask_shape, tokens, panel)
    (q_columns, _), (k_columns, _), (v_columns, _) = grid.sources
    mask_shape, masked, scale_by = grid.mask_shape, grid.masked, T.float32(scale if scale is not None else 1.0)
    configure_tiles = tile_configuration()

    def across_lanes(partial, combine):
        return _across_lanes(partial, lanes, combine)

    # With position scores, a loop before the mask's scales the scores and adds them (gathers, whole vectors).
    scale_by_then = scale_by if positions is None else T.float32(1.0)

    parts = 1 if bf16_scores else 2  # of Q and K in bf16: a part, and with three products a rest
    pairs = lanes // 2

    @T.macro
    def zero_block():
        for tile in T.unroll(4):
            T.evaluate(tile_instruction("tilezero", T.int8(tile)))

    @T.macro
    def block_product(a, a_row, a_stride, b, b_row, b_column, b_stride, k_first, k_end):
        """tmm0-3 += a[a_row .. + 32, k_first .. k_end] @ b (pairs of those k), k steps of 32."""
        for ks in range(k_first // TILE, k_end // TILE):
            T.evaluate(tile_instruction("tileloadd64", T.int8(4), T.address_of(a[a_row, ks * TILE]), T.int64(a_stride)))
            T.evaluate(tile_instruction("tileloadd64", T.int8(5), T.address_of(a[a_row + 16, ks * TILE]), T.int64(a_stride)))
            T.evaluate(tile_instruction("tileloadd64", T.int8(6), T.address_of(b[b_row + ks * 16, b_column]), T.int64(b_stride)))
            T.evaluate(tile_instruction("tileloadd64", T.int8(7), T.address_of(b[b_row + ks * 16, b_column + 16]), T.int64(b_stride)))
            T.evaluate(tile_instruction("tdpbf16ps", T.int8(0), T.int8(4), T.int8(6)))
            T.evaluate(tile_instruction("tdpbf16ps", T.int8(1), T.int8(4), T.int8(7)))
            T.evaluate(tile_instruction("tdpbf16ps", T.int8(2), T.int8(5), T.int8(6)))
            T.evaluate(tile_instruction("tdpbf16ps", T.int8(3), T.int8(5), T.int8(7)))

    @T.macro
    def store_block(c, c_row, c_column, c_stride):
        for tile in T.unroll(4):
            T.evaluate(tile_instruction("tilestored64", T.int8(tile), T.address_of(c[c_row + tile // 2 * 16, c_column + tile % 2 * 16]),
                                        T.int64(c_stride)))

    @T.macro
    def every_head(q, k, v, mask, rows, by_query, by_key, index, y):
        for bh in T.parallel(batch * heads):
            configure_tiles()
            qb = T.alloc_buffer((seq, dim), "uint16")  # Q's rows in bf16
            ql = T.alloc_buffer((1, 1) if bf16_scores else (seq, dim), "uint16")  # and what that rounding left, in bf16
            kb = T.alloc_buffer((dim // 2, seq), "uint32")  # K^T's pairs: kb[d / 2, j] = K[j, d], K[j, d + 1]
            kl = T.alloc_buffer((1, 1) if bf16_scores else (dim // 2, seq), "uint32")  # and what rounding them left
            vb = T.alloc_buffer((seq // 2, dim), "uint32")  # V's pairs: vb[j / 2, d] = V[j, d], V[j + 1, d]
            kr = T.alloc_buffer((parts, seq, dim // 2), "uint32")  # K's rows in bf16 as pairs (and what that rounding left)
            scores = T.alloc_buffer((TILE, seq), "float32")  # a block of query rows' scores
            pb = T.alloc_buffer((TILE, seq), "uint16")  # their probabilities (not yet divided by their sum) in bf16
            totals = T.alloc_buffer((TILE,), "float32")
            out = T.alloc_buffer((TILE, TILE), "float32")
            partial = T.alloc_buffer((lanes,), "float32")
            row_max = T.alloc_buffer((1,), "float32")
            for s in range(seq):  # Q's and K's rows in bf16
                for d0 in range(dim // lanes):
                    qb[s, T.Ramp(d0 * lanes, 1, lanes)] = _bf16_bits(grid.head_row(q, rows, 0, bh, s, d0, T.Ramp(0, 1, lanes)), lanes)
                    kr[0, s, T.Ramp(d0 * pairs, 1, pairs)] = T.reinterpret(
                        f"uint32x{pairs}", _bf16_bits(grid.head_row(k, rows, 1, bh, s, d0, T.Ramp(0, 1, lanes)), lanes))
                    if not bf16_scores:
                        ql[s, T.Ramp(d0 * lanes, 1, lanes)] = _bf16_rest_bits(grid.head_row(q, rows, 0, bh, s, d0, T.Ramp(0, 1, lanes)), lanes)
                        kr[1, s, T.Ramp(d0 * pairs, 1, pairs)] = T.reinterpret(
                            f"uint32x{pairs}", _bf16_rest_bits(grid.head_row(k, rows, 1, bh, s, d0, T.Ramp(0, 1, lanes)), lanes))
            for s2 in range(seq // 2):
                for d0 in range(dim // lanes):
                    vb[s2, T.Ramp(d0 * lanes, 1, lanes)] = _pairs(
                        _bf16_bits(grid.head_row(v, rows, 2, bh, 2 * s2, d0, T.Ramp(0, 1, lanes)), lanes),
                        _bf16_bits(grid.head_row(v, rows, 2, bh, 2 * s2 + 1, d0, T.Ramp(0, 1, lanes)), lanes), lanes)
            # K^T's pairs: a pair of K's row is a uint32 of its bf16 row, so kb is the transpose of
            # those rows' uint32s, a hardware gather of a key's pair per lane (the transpose in
            # registers took a tenth of the kernel at 512 tokens).
            for c in range(dim // 2):
                for j0 in range(seq // lanes):
                    kb[c, T.Ramp(j0 * lanes, 1, lanes)] = T.reinterpret(f"uint32x{lanes}", gather_floats(
                        T.address_of(kr[0, 0, 0]), T.Ramp(j0 * lanes * (dim // 2) + c, dim // 2, lanes), lanes))
                    if not bf16_scores:
                        kl[c, T.Ramp(j0 * lanes, 1, lanes)] = T.reinterpret(f"uint32x{lanes}", gather_floats(
                            T.address_of(kr[1, 0, 0]), T.Ramp(j0 * lanes * (dim // 2) + c, dim // 2, lanes), lanes))
            for i0 in range(seq // TILE):  # a block of query rows at a time: its scores stay in L1 and L2
                for j0 in range(span.first(i0 * TILE) // TILE, span.end(i0 * TILE) // TILE):
                    zero_block()  # Q K^T as Qh Kh^T (+ Qh Kl^T + Ql Kh^T)
                    block_product(qb, i0 * TILE, dim * 2, kb, 0, j0 * TILE, seq * 4, 0, dim)
                    if not bf16_scores:
                        block_product(qb, i0 * TILE, dim * 2, kl, 0, j0 * TILE, seq * 4, 0, dim)
                        block_product(ql, i0 * TILE, dim * 2, kb, 0, j0 * TILE, seq * 4, 0, dim)
                    store_block(scores, 0, j0 * TILE, seq * 4)
                # scale, mask, softmax's max, exp and sum over each row; the probabilities in bf16
                for i in range(TILE):
                    if positions is not None:
                        for c in range(span.first(i0 * TILE) // lanes, span.end(i0 * TILE) // lanes):
                            scores[i, T.Ramp(c * lanes, 1, lanes)] = scores[i, T.Ramp(c * lanes, 1, lanes)] * T.Broadcast(scale_by, lanes) \
                                + positions.scores(seq, lanes, index, i0 * TILE + i, c * lanes,
                                                   *positions.product_rows(by_query, by_key, bh, i0 * TILE + i, c * lanes))
                    for x in T.vectorized(lanes):
                        partial[x] = T.float32(-3.4028234663852886e38)
                    for c in range(span.first(i0 * TILE) // lanes, span.end(i0 * TILE) // lanes):
                        for x in T.vectorized(lanes):
                            if masked:
                                scores[i, c * lanes + x] = windowed(i0 * TILE + i, c * lanes + x, scores[i, c * lanes + x] * scale_by_then + grid.mask_at(
                                    mask, bh // heads, bh % heads, i0 * TILE + i, c * lanes + x))
                            else:
                                scores[i, c * lanes + x] = windowed(i0 * TILE + i, c * lanes + x, scores[i, c * lanes + x] * scale_by_then)
                            partial[x] = T.max(partial[x], scores[i, c * lanes + x])
                    row_max[0] = across_lanes(partial, T.max)
                    partial[T.Ramp(0, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
                    for c in range(span.first(i0 * TILE) // lanes, span.end(i0 * TILE) // lanes):
                        pb[i, T.Ramp(c * lanes, 1, lanes)] = bf16_probabilities(scores[i, T.Ramp(c * lanes, 1, lanes)], row_max[0], lanes)
                        partial[T.Ramp(0, 1, lanes)] = partial[T.Ramp(0, 1, lanes)] + _widened(pb[i, T.Ramp(c * lanes, 1, lanes)], lanes)
                    totals[i] = across_lanes(partial, lambda a, b: a + b)
                # y = P V / sum
                for d0 in range(dim // TILE):
                    zero_block()
                    block_product(pb, 0, seq * 2, vb, 0, d0 * TILE, dim * 4, span.first(i0 * TILE), span.end(i0 * TILE))
                    store_block(out, 0, 0, TILE * 4)
                    for i in range(TILE):
                        for x in T.vectorized(TILE):
                            y[bh // heads, i0 * TILE + i, bh % heads, d0 * TILE + x] = T.Cast(out_dtype, out[i, x] / totals[i])
            T.evaluate(tile_instruction("tilerelease"))

    return _attention_function(grid, positions, {KERNEL_ATTR: True, AMX_KERNEL_ATTR: True}, "attention_amx_tiles", every_head, out_dtype)


INT8_KEYS = 32  # keys a score tile of the int8 kernel: two vectors of 16
INT8_BLOCK_ROWS = 32  # query rows whose scores and weights the int8 kernel keeps at a time
INT8_SCORE_ROWS = 8  # query rows a score tile (two accumulator buffers of 4: fma.STACK_BYTES)
INT8_OUTPUT_ROWS = 4  # query rows a P V tile (buffers of 2 rows, one for each byte plane of the weights, up to 4 vectors wide)
# A weight of P V (at most its row's largest) in 16 bits, two uint8 planes of one vpdpbusd each:
# in 8 bits, the weights under half a level (1/510 of the largest) were dropped, which a long row's
# many small ones add up past (a peak and 2000 keys at 1/600 of it: 4/5 of the row's mass).
WEIGHT_LEVELS = 65535
# The int8 kernel's exps at least 2^-64, so that a masked key's weight (its exp times V's row
# scale) stays a normal float, never a subnormal that stalls the multiply; the floor is under
# half a level of any row's largest weight, and 8192 keys at it add 4e-16 to a row's sum.
WEIGHT_EXP_FLOOR = -64.0
# Where a row's largest weight is under this (its unmasked keys' V rows all zero: the output is
# 0), its levels are all 0, where WEIGHT_LEVELS / it could overflow to inf.
SMALLEST_WEIGHT = 2.0 ** -100
QUAD_BIAS = -2139062144  # 0x80808080: each byte of a quad moved from uint8 (+128) to int8


def vnni_int8_fits(seq: int, dim: int, lanes: int) -> bool:
    """Whether ``vnni_int8_kernel`` takes a head: whole score tiles of keys, whole vectors of its columns."""
    return lanes == 16 and seq % INT8_KEYS == 0 and seq % INT8_BLOCK_ROWS == 0 and dim % lanes == 0


def vnni_int8_kernel(batch: int, heads: int, seq: int, dim: int, lanes: int, sources, mask_shape: tuple[int, ...] | None,
                     scale: float | None, tokens: int | None = None, panel: int = 0, window: int | None = None, *, dot):
    """``kernel``'s attention (same operands and output) with its two matmuls in int8 on ``dot``
    (``kernels/int8.DOT_PRODUCTS``' ``vpdpbusd``: 64 products an instruction where an FMA does 16),
    for int8 builds on AVX-512 VNNI without AMX, where the fp32 kernel was a sixth of
    modernbert-base's int8 time (docs/benchmarks.md). What ONNX Runtime's dynamic quantization and
    NNCF do to these two matmuls, per row here rather than per tensor:

    - Q and K per (token, head) row, symmetric, as ``kernels/int8.row_quantizer`` quantizes a
      matmul's rows (Q unsigned with its +128, K signed; each key's scores start from ``-128 x
      sum_d K[j, d]``, which takes Q's offset back exactly);
    - V per (token, head) row too, its scale folded into the weights: ``w_j = exp(score_j - row
      max) x sv_j``, quantized per query row as ``round(65535 w / max w)``, two uint8 planes (high
      and low byte, a ``vpdpbusd`` each), and P V rescaled by ``max w / 65535`` and divided by the
      sum of the exps (fp32). V per column with the probabilities in 255 levels of 1 had 4x the
      error on all-MiniLM-L6-v2's real activations (a few tokens' large V coarsened every
      other's; the small weights lost the most: 0.9-4.4% of a layer's output where this loses
      0.6-1.0%), and 8-bit weights drop a long row's small ones (``WEIGHT_LEVELS``).

    Scale, mask, max and exp in fp32, as in ``kernel``. Per (sequence, head): Q's, K's
    and V's rows quantized, K^T's quads by hardware gathers of K's (as ``amx_bf16_kernel``), V's
    quads four rows interleaved; then blocks of INT8_BLOCK_ROWS query rows: their scores over the
    block's key span, the weights, P V. With ``window``, only the key tiles within it. No
    DeBERTa position scores (its builds keep the fp32 kernel)."""
    from tvm.script import tirx as T

    from tvmbert.kernels.int8 import ROW_OFFSET, ROWS_DTYPE, row_quantizer

    assert vnni_int8_fits(seq, dim, lanes), (seq, dim, lanes)
    grid = _Grid(batch, heads, seq, dim, lanes, sources, mask_shape, tokens, panel)
    span = key_span(seq, INT8_BLOCK_ROWS, window, INT8_KEYS)
    windowed = window_mask(window)
    masked, scale_by = grid.masked, T.float32(scale if scale is not None else 1.0)
    words = dim // 4  # a row's quads: one int32 of four values
    score_half, output_half = INT8_SCORE_ROWS // 2, INT8_OUTPUT_ROWS // 2
    out_width = vectors_per_tile(dim // lanes, lanes) * lanes
    quantize_row = row_quantizer(lanes, dim // lanes)

    def head_value(operands, s, column):  # row_quantizer's value: operands (operand, rows, Q 0 / K 1 / V 2, head)
        operand, rows, which, bh = operands
        return grid.head_row(operand, rows, which, bh, s, column // lanes, column % lanes)

    def across_lanes(partial, combine):
        return _across_lanes(partial, lanes, combine)

    def quads(acc, word, weights):  # acc (int32 x lanes) += word's four uint8 . each lane's four int8 of weights
        return dot.accumulate(acc, T.broadcast(word, lanes), weights, lanes)

    @T.macro
    def score_tile(qq32, kt8, ck, acc, first_row, c):
        for i in T.unroll(score_half):
            for v in T.unroll(INT8_KEYS // lanes):
                acc[i, T.ramp(v * lanes, 1, lanes)] = ck[T.ramp(c * INT8_KEYS + v * lanes, 1, lanes)]
        for w in range(words):
            for i in T.unroll(score_half):
                for v in T.unroll(INT8_KEYS // lanes):
                    acc[i, T.ramp(v * lanes, 1, lanes)] = quads(acc[i, T.ramp(v * lanes, 1, lanes)], qq32[first_row + i, w],
                                                                kt8[w, T.ramp((c * INT8_KEYS + v * lanes) * 4, 1, 4 * lanes)])

    @T.macro
    def score_store(mask, scores, sq, sk, acc, bh, local, first_row, c):
        for i in T.unroll(score_half):
            for x in T.vectorized(INT8_KEYS):
                if masked:
                    scores[local + i, c * INT8_KEYS + x] = windowed(
                        first_row + i, c * INT8_KEYS + x, T.Cast("float32", acc[i, x]) * (sq[first_row + i] * scale_by) * sk[c * INT8_KEYS + x]
                        + grid.mask_at(mask, bh // heads, bh % heads, first_row + i, c * INT8_KEYS + x))
                else:
                    scores[local + i, c * INT8_KEYS + x] = windowed(
                        first_row + i, c * INT8_KEYS + x, T.Cast("float32", acc[i, x]) * (sq[first_row + i] * scale_by) * sk[c * INT8_KEYS + x])

    @T.macro
    def output_tile(high32, low32, vq8, acc_high, acc_low, local, c, first_key, end_key):
        """P V of ``output_half`` rows, the weights' high bytes and low bytes summed apart (each
        sum within int32 at any length), V's quads loaded once for both."""
        for i in T.unroll(output_half):
            for x in T.vectorized(out_width):
                acc_high[i, x] = T.int32(0)
                acc_low[i, x] = T.int32(0)
        for w in range(first_key // 4, end_key // 4):
            for i in T.unroll(output_half):
                for v in T.unroll(out_width // lanes):
                    acc_high[i, T.ramp(v * lanes, 1, lanes)] = quads(acc_high[i, T.ramp(v * lanes, 1, lanes)], high32[local + i, w],
                                                                     vq8[w, T.ramp((c * out_width + v * lanes) * 4, 1, 4 * lanes)])
                    acc_low[i, T.ramp(v * lanes, 1, lanes)] = quads(acc_low[i, T.ramp(v * lanes, 1, lanes)], low32[local + i, w],
                                                                    vq8[w, T.ramp((c * out_width + v * lanes) * 4, 1, 4 * lanes)])

    @T.macro
    def output_store(y, rescale, acc_high, acc_low, bh, local, first_row, c):
        for i in T.unroll(output_half):
            for x in T.vectorized(out_width):
                y[bh // heads, first_row + i, bh % heads, c * out_width + x] = \
                    (T.Cast("float32", acc_high[i, x]) * T.float32(256) + T.Cast("float32", acc_low[i, x])) * rescale[local + i]

    @T.macro
    def every_head(q, k, v, mask, rows, by_query, by_key, index, y):
        for bh in T.parallel(batch * heads):
            qq = T.alloc_buffer((seq, dim), ROWS_DTYPE)  # Q's rows quantized (+128)
            sq = T.alloc_buffer((seq,), "float32")
            kr = T.alloc_buffer((seq, dim), ROWS_DTYPE)  # K's rows quantized (+128)
            sk = T.alloc_buffer((seq,), "float32")
            kt = T.alloc_buffer((words, seq), "int32")  # K^T's quads: kt[w, j] = K[j, 4w .. 4w + 3] in int8
            ck = T.alloc_buffer((seq,), "int32")  # each key's scores' start: -128 x sum_d K[j, d]
            vr = T.alloc_buffer((seq, dim), ROWS_DTYPE)  # V's rows quantized (+128)
            sv = T.alloc_buffer((seq,), "float32")
            vq = T.alloc_buffer((seq // 4, dim), "int32")  # V's quads: vq[j / 4, d] = V[j .. j + 3, d] in int8
            scores = T.alloc_buffer((INT8_BLOCK_ROWS, seq), "float32")  # a block of query rows' scores, then weights
            high = T.alloc_buffer((INT8_BLOCK_ROWS, seq), "uint8")  # their weights' levels: high bytes
            low = T.alloc_buffer((INT8_BLOCK_ROWS, seq), "uint8")  # and low bytes
            rescale = T.alloc_buffer((INT8_BLOCK_ROWS,), "float32")  # a row's P V to its output: max w / 65535 / sum of exps
            peak = T.alloc_buffer((lanes,), "float32")
            factor = T.alloc_buffer((1,), "float32")
            acc_top = T.alloc_buffer((score_half, INT8_KEYS), "int32")
            acc_bottom = T.alloc_buffer((score_half, INT8_KEYS), "int32")
            top_high = T.alloc_buffer((output_half, out_width), "int32")
            top_low = T.alloc_buffer((output_half, out_width), "int32")
            bottom_high = T.alloc_buffer((output_half, out_width), "int32")
            bottom_low = T.alloc_buffer((output_half, out_width), "int32")
            partial = T.alloc_buffer((lanes,), "float32")
            sums = T.alloc_buffer((lanes,), "int32")
            levels = T.alloc_buffer((lanes,), "int32")
            row_max = T.alloc_buffer((1,), "float32")
            qq32 = T.decl_buffer((seq, words), "int32", data=qq.data)
            kt8 = T.decl_buffer((words, seq * 4), "int8", data=kt.data)
            vq8 = T.decl_buffer((seq // 4, dim * 4), "int8", data=vq.data)
            high32 = T.decl_buffer((INT8_BLOCK_ROWS, seq // 4), "int32", data=high.data)
            low32 = T.decl_buffer((INT8_BLOCK_ROWS, seq // 4), "int32", data=low.data)
            for s in range(seq):
                quantize_row(head_value, (q, rows, 0, bh), qq, sq, s)
                quantize_row(head_value, (k, rows, 1, bh), kr, sk, s)
                quantize_row(head_value, (v, rows, 2, bh), vr, sv, s)
            # K^T's quads: a quad of K's row is an int32 of its bytes, so kt is the transpose of
            # those rows' int32s, a hardware gather of a key's quad per lane (the offset taken off)
            for w in range(words):
                for j0 in range(seq // lanes):
                    kt[w, T.ramp(j0 * lanes, 1, lanes)] = T.reinterpret(f"int32x{lanes}", gather_floats(
                        T.address_of(kr[0, 0]), T.ramp(j0 * lanes * words + w, words, lanes), lanes)) ^ T.broadcast(T.int32(QUAD_BIAS), lanes)
            for j0 in range(seq // lanes):
                for x in T.vectorized(lanes):
                    sums[x] = T.int32(0)
                for w in range(words):
                    sums[T.ramp(0, 1, lanes)] = quads(sums[T.ramp(0, 1, lanes)], T.int32(0x01010101), kt8[w, T.ramp(j0 * lanes * 4, 1, 4 * lanes)])
                for x in T.vectorized(lanes):
                    ck[j0 * lanes + x] = sums[x] * T.int32(-ROW_OFFSET)
            # V's quads: four rows' levels interleaved, a byte each (the offset taken off)
            for s4 in range(seq // 4):
                for d0 in range(dim // lanes):
                    for x in T.vectorized(lanes):
                        vq[s4, d0 * lanes + x] = (T.Cast("int32", vr[4 * s4, d0 * lanes + x]) | T.Cast("int32", vr[4 * s4 + 1, d0 * lanes + x]) << 8
                                                  | T.Cast("int32", vr[4 * s4 + 2, d0 * lanes + x]) << 16
                                                  | T.Cast("int32", vr[4 * s4 + 3, d0 * lanes + x]) << 24) ^ T.int32(QUAD_BIAS)
            for i0 in range(seq // INT8_BLOCK_ROWS):
                first_key, end_key = span.first(i0 * INT8_BLOCK_ROWS), span.end(i0 * INT8_BLOCK_ROWS)
                # scores = Q K^T * scale + mask, INT8_SCORE_ROWS x INT8_KEYS a tile
                for t in range(INT8_BLOCK_ROWS // INT8_SCORE_ROWS):
                    for c in range(first_key // INT8_KEYS, end_key // INT8_KEYS):
                        score_tile(qq32, kt8, ck, acc_top, i0 * INT8_BLOCK_ROWS + t * INT8_SCORE_ROWS, c)
                        score_tile(qq32, kt8, ck, acc_bottom, i0 * INT8_BLOCK_ROWS + t * INT8_SCORE_ROWS + score_half, c)
                        score_store(mask, scores, sq, sk, acc_top, bh, t * INT8_SCORE_ROWS, i0 * INT8_BLOCK_ROWS + t * INT8_SCORE_ROWS, c)
                        score_store(mask, scores, sq, sk, acc_bottom, bh, t * INT8_SCORE_ROWS + score_half,
                                    i0 * INT8_BLOCK_ROWS + t * INT8_SCORE_ROWS + score_half, c)
                # softmax's max and exp over each row, the weights (exp times V's row scale), their levels
                for i in range(INT8_BLOCK_ROWS):
                    for x in T.vectorized(lanes):
                        partial[x] = T.float32(-3.4028234663852886e38)
                    for c in range(first_key // lanes, end_key // lanes):
                        for x in T.vectorized(lanes):
                            partial[x] = T.max(partial[x], scores[i, c * lanes + x])
                    row_max[0] = across_lanes(partial, T.max)
                    for x in T.vectorized(lanes):
                        partial[x] = T.float32(0)
                        peak[x] = T.float32(0)
                    for c in range(first_key // lanes, end_key // lanes):
                        scores[i, T.Ramp(c * lanes, 1, lanes)] = _exp_of_difference(scores[i, T.Ramp(c * lanes, 1, lanes)], row_max[0], lanes,
                                                                                    WEIGHT_EXP_FLOOR)
                        partial[T.Ramp(0, 1, lanes)] = partial[T.Ramp(0, 1, lanes)] + scores[i, T.Ramp(c * lanes, 1, lanes)]
                        scores[i, T.Ramp(c * lanes, 1, lanes)] = scores[i, T.Ramp(c * lanes, 1, lanes)] * sv[T.Ramp(c * lanes, 1, lanes)]
                        peak[T.Ramp(0, 1, lanes)] = T.max(peak[T.Ramp(0, 1, lanes)], scores[i, T.Ramp(c * lanes, 1, lanes)])
                    row_max[0] = across_lanes(peak, T.max)  # the largest weight
                    factor[0] = T.Select(row_max[0] > T.float32(SMALLEST_WEIGHT), T.float32(WEIGHT_LEVELS) / row_max[0], T.float32(0))
                    rescale[i] = row_max[0] / T.float32(WEIGHT_LEVELS) / across_lanes(partial, lambda a, b: a + b)
                    for c in range(first_key // lanes, end_key // lanes):
                        levels[T.Ramp(0, 1, lanes)] = T.Cast(f"int32x{lanes}", T.min(_llvm_vector_call(
                            f"float32x{lanes}", "llvm.roundeven", scores[i, T.Ramp(c * lanes, 1, lanes)] * T.Broadcast(factor[0], lanes)),
                            T.Broadcast(T.float32(WEIGHT_LEVELS), lanes)))
                        high[i, T.Ramp(c * lanes, 1, lanes)] = T.Cast(f"uint8x{lanes}", levels[T.Ramp(0, 1, lanes)] >> 8)
                        low[i, T.Ramp(c * lanes, 1, lanes)] = T.Cast(f"uint8x{lanes}", levels[T.Ramp(0, 1, lanes)] & 255)
                # y = P V, rescaled
                for t in range(INT8_BLOCK_ROWS // INT8_OUTPUT_ROWS):
                    for c in range(dim // out_width):
                        output_tile(high32, low32, vq8, top_high, top_low, t * INT8_OUTPUT_ROWS, c, first_key, end_key)
                        output_tile(high32, low32, vq8, bottom_high, bottom_low, t * INT8_OUTPUT_ROWS + output_half, c, first_key, end_key)
                        output_store(y, rescale, top_high, top_low, bh, t * INT8_OUTPUT_ROWS, i0 * INT8_BLOCK_ROWS + t * INT8_OUTPUT_ROWS, c)
                        output_store(y, rescale, bottom_high, bottom_low, bh, t * INT8_OUTPUT_ROWS + output_half,
                                     i0 * INT8_BLOCK_ROWS + t * INT8_OUTPUT_ROWS + output_half, c)

    return _attention_function(grid, None, {KERNEL_ATTR: True}, "attention_int8_tiles", every_head)

"""fp32 self-attention as one hand-written kernel per layer: the kernel and the graph rewrite that
calls it. Below the stages: optimize adds the rewrite (pass ``attention-fp32``).

As exported, a BERT layer's attention is nine kernels: the Q/K/V projection's output split in
three, each reshaped and transposed head-major (K transposed twice), ``Q K^T`` with its scale and
mask, softmax, ``P V``, and the transpose back. At bert-base 8 x 128 the split and transposes move
data for 25 ms, the two matmuls (tuned) run at 150-210 GFLOP/s for 28 ms and the softmax takes
14 ms. This kernel reads Q, K and V where the projection wrote them (columns of its output) and
writes its result where the output projection reads it, so the moves vanish; per (sequence, head),
K is transposed once into a buffer in cache and V copied contiguous, the scores are computed on
FMA register tiles, scaled and masked as they are stored, the softmax runs over each row in cache
(exp as ``scalar_math.exp_float32``) and ``P V`` accumulates in registers, divided by the row's
sum as it is stored (PyTorch divides the probabilities first). Sums run in another order and the
scale and mask may fuse into one FMA: within fp32 rounding of the graph. Shapes where the
sequence or the head size is not a multiple of the vector lanes keep the graph.

Where the projection runs on the FMA kernel and nothing else reads its result, that kernel writes
it panel-major instead (``fma.panel_major_variant``; with bert-base's 64-column panels, one panel
per head's Q, K or V) and this one reads the panels: bert-base 8 x 128, both alone, the
projection 12.1 -> 11.7 ms and the attention 2.4 -> 2.1 ms; where a panel is one head's V,
``P V`` reads it in place, uncopied (2.07 -> 1.99 ms). With ``--dtype bfloat16`` on AMX only
the weight matmuls are bf16 and the attention runs here too (8 x 128: 58 ms of graph kernels -> 25).
"""

from __future__ import annotations

from typing import NamedTuple

from tvmbert.kernels.fma import CACHE_LINE, STACK_BYTES, prefetch_to_l2
from tvmbert.kernels.scalar_math import exp_float32

KERNEL_ATTR = "tvmbert.attention_f32"  # PrimFunc attribute marking the kernel (build counts them)
ROWS = 4  # query rows per register tile


def vectors_per_tile(count: int, lanes: int) -> int:
    """Vectors per row of a register tile over ``count`` vectors: ``ROWS`` x this many
    accumulators leave registers for the loads (32 vector registers with AVX-512, 16 with AVX2)."""
    most = 4 if lanes >= 16 else 2
    return next(v for v in range(most, 0, -1) if count % v == 0)


def fits(seq: int, dim: int, lanes: int) -> bool:
    return lanes > 0 and seq % lanes == 0 and dim % lanes == 0


def kernel(batch: int, heads: int, seq: int, dim: int, lanes: int, sources, mask_shape: tuple[int, ...] | None,
           scale: float | None, tokens: int | None = None, panel: int = 0):
    """The PrimFunc ``y[b, s, h, :] = softmax(q_h[s] K_h^T * scale + mask) V_h`` for every
    sequence b and head h, where ``sources`` gives, for Q, K and V in turn, ``(columns, offset)``:
    each is read from a ``[batch * seq, columns]`` operand, head h's ``dim`` columns starting at
    ``offset + h * dim``. ``mask`` broadcasts to ``[batch, heads, seq, seq]``; without one it is
    one unread float. With ``tokens`` (a packed build: ``packing.py``), the operands hold that
    many rows and the int64 ``rows[batch * seq]`` says which one holds sequence b's token s (in
    range: the packer makes it); otherwise ``rows`` is one unread int32. With ``panel``, each
    operand is held panel-major, ``[columns / panel, rows, panel]`` (``fma.panel_major_variant``)."""
    import tvm
    from tvm.script import tirx as T

    assert fits(seq, dim, lanes), (seq, dim, lanes)
    (q_columns, q_offset), (k_columns, k_offset), (v_columns, v_offset) = sources
    assert all(offset % lanes == 0 and (not panel or columns % panel == 0) for columns, offset in sources), sources
    score_width = vectors_per_tile(seq // lanes, lanes) * lanes
    out_width = vectors_per_tile(dim // lanes, lanes) * lanes
    width = max(score_width, out_width)
    mask_shape = tuple(mask_shape) if mask_shape else (1,)
    masked = len(mask_shape) == 4
    scale_by = T.float32(scale if scale is not None else 1.0)
    operand_rows = tokens if tokens is not None else batch * seq
    rows_shape, rows_dtype = ((batch * seq,), "int64") if tokens is not None else ((1,), "int32")

    def row(rows, at):  # the operands' row of grid position ``at`` (b * seq + s)
        return T.Cast("int32", rows[at]) if tokens is not None else at

    def at(operand, at_row, block, x):
        """Element ``x`` of the ``block``-th ``lanes`` columns of row ``at_row``, in either layout."""
        if panel:
            return operand[block // (panel // lanes), at_row, block % (panel // lanes) * lanes + x]
        return operand[at_row, block * lanes + x]

    def operand_shape(columns):
        return (columns // panel, operand_rows, panel) if panel else (operand_rows, columns)

    def mask_at(mask, b, h, i, j):
        index = [b, h, i, j]
        return mask[tuple(0 if size == 1 else at for size, at in zip(mask_shape, index))]

    def across_lanes(partial, combine):
        """The lanes of ``partial`` combined as a tree: 4 dependent steps where a chain takes 15."""
        values = [partial[x] for x in range(lanes)]
        while len(values) > 1:
            values = [combine(a, b) for a, b in zip(values[::2], values[1::2])]
        return values[0]

    # The next head's Q, K and V rows (strided columns of the operands, which the hardware
    # prefetcher does not follow) are prefetched while this head's scores are computed, spread
    # over its score tiles: alone at bert-base 8 x 128, operands out of cache, 2.9 -> 2.6 ms.
    line_floats = CACHE_LINE // 4
    row_lines = -(-dim // line_floats)
    score_tiles = (seq // ROWS) * (seq // score_width)
    per_tile = -(-seq * row_lines // score_tiles)

    def prefetch_next_head(operand, offset, rows, bh, line):
        line = T.min(line, seq * row_lines - 1)
        after = T.min(bh + 1, batch * heads - 1)
        return prefetch_to_l2(T.address_of(at(operand, row(rows, after // heads * seq + line // row_lines),
                                              (offset + after % heads * dim + line % row_lines * line_floats) // lanes, 0)))

    def whole(buffer):
        return tvm.tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d) for d in buffer.shape])

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
                acc[i, x] = acc[i, x] + at(q, row(rows, bh // heads * seq + first + i), (q_offset + bh % heads * dim) // lanes + d0, e) \
                    * kt[d0 * lanes + e, c * score_width + x]

    @T.macro
    def score_store(mask, scores, acc, bh, first, c):
        for i in T.unroll(half):
            for x in T.vectorized(score_width):
                if masked:
                    scores[first + i, c * score_width + x] = acc[i, x] * scale_by + mask_at(
                        mask, bh // heads, bh % heads, first + i, c * score_width + x)
                else:
                    scores[first + i, c * score_width + x] = acc[i, x] * scale_by

    @T.macro
    def output_fma(scores, v, vh, acc, bh, first, c, j):
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                if v_in_place:
                    acc[i, x] = acc[i, x] + scores[first + i, j] * v[(v_offset + bh % heads * dim) // panel, bh // heads * seq + j,
                                                                     c * out_width + x]
                else:
                    acc[i, x] = acc[i, x] + scores[first + i, j] * vh[j, c * out_width + x]

    @T.macro
    def output_store(y, totals, acc, bh, first, c):
        for i in T.unroll(half):
            for x in T.vectorized(out_width):
                y[bh // heads, first + i, bh % heads, c * out_width + x] = acc[i, x] / totals[first + i]

    @T.prim_func(s_tir=True)
    def attention(q: T.Buffer(operand_shape(q_columns), "float32"), k: T.Buffer(operand_shape(k_columns), "float32"),
                  v: T.Buffer(operand_shape(v_columns), "float32"), mask: T.Buffer(mask_shape, "float32"),
                  rows: T.Buffer(rows_shape, rows_dtype), y: T.Buffer((batch, seq, heads, dim), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("attention_tiles"):
                T.reads(whole(q), whole(k), whole(v), whole(mask), whole(rows))
                T.writes(whole(y))
                for bh in T.parallel(batch * heads):
                    kt = T.alloc_buffer((dim, seq), "float32")
                    vh = T.alloc_buffer((1, 1) if v_in_place else (seq, dim), "float32")  # (TVM has no empty buffer)
                    scores = T.alloc_buffer((seq, seq), "float32")
                    totals = T.alloc_buffer((seq,), "float32")
                    acc_top = T.alloc_buffer((half, width), "float32")
                    acc_bottom = T.alloc_buffer((half, width), "float32")
                    partial = T.alloc_buffer((lanes,), "float32")
                    block = T.alloc_buffer((lanes, lanes), "float32", scope="local")
                    row_max = T.alloc_buffer((1,), "float32")
                    # this head's K transposed and V (unless read in place), contiguous (rows of the operands are far apart: cache sets)
                    if not v_in_place:
                        for j in range(seq):
                            for d0 in range(dim // lanes):
                                for x in T.vectorized(lanes):
                                    vh[j, d0 * lanes + x] = at(v, row(rows, bh // heads * seq + j), (v_offset + bh % heads * dim) // lanes + d0, x)
                    for j0 in range(seq // lanes):  # in lanes x lanes blocks through registers
                        for d0 in range(dim // lanes):
                            for r in T.unroll(lanes):
                                for x in T.vectorized(lanes):
                                    block[r, x] = at(k, row(rows, bh // heads * seq + j0 * lanes + r), (k_offset + bh % heads * dim) // lanes + d0, x)
                            for c in T.unroll(lanes):
                                for x in T.vectorized(lanes):
                                    kt[d0 * lanes + c, j0 * lanes + x] = block[x, c]
                    # scores = Q K^T * scale + mask, a register tile at a time
                    for t in range(seq // ROWS):
                        for c in range(seq // score_width):
                            zero(acc_top, score_width)
                            zero(acc_bottom, score_width)
                            for n in T.unroll(per_tile):
                                T.evaluate(prefetch_next_head(q, q_offset, rows, bh, (t * (seq // score_width) + c) * per_tile + n))
                                T.evaluate(prefetch_next_head(k, k_offset, rows, bh, (t * (seq // score_width) + c) * per_tile + n))
                                T.evaluate(prefetch_next_head(v, v_offset, rows, bh, (t * (seq // score_width) + c) * per_tile + n))
                            for d0, e in T.grid(dim // lanes, lanes):
                                score_fma(q, kt, rows, acc_top, bh, t * ROWS, c, d0, e)
                                score_fma(q, kt, rows, acc_bottom, bh, t * ROWS + half, c, d0, e)
                            score_store(mask, scores, acc_top, bh, t * ROWS, c)
                            score_store(mask, scores, acc_bottom, bh, t * ROWS + half, c)
                    # softmax's max, exp and sum over each row
                    for i in range(seq):
                        for x in T.vectorized(lanes):
                            partial[x] = scores[i, x]
                        for c in range(1, seq // lanes):
                            for x in T.vectorized(lanes):
                                partial[x] = T.max(partial[x], scores[i, c * lanes + x])
                        row_max[0] = across_lanes(partial, T.max)
                        for x in T.vectorized(lanes):
                            partial[x] = T.float32(0)
                        for c in range(seq // lanes):
                            for x in T.vectorized(lanes):
                                scores[i, c * lanes + x] = exp_float32(scores[i, c * lanes + x] - row_max[0])
                                partial[x] = partial[x] + scores[i, c * lanes + x]
                        totals[i] = across_lanes(partial, lambda a, b: a + b)
                    # y = P V / sum
                    for t in range(seq // ROWS):
                        for c in range(dim // out_width):
                            zero(acc_top, out_width)
                            zero(acc_bottom, out_width)
                            for j in range(seq):
                                output_fma(scores, v, vh, acc_top, bh, t * ROWS, c, j)
                                output_fma(scores, v, vh, acc_bottom, bh, t * ROWS + half, c, j)
                            output_store(y, totals, acc_top, bh, t * ROWS, c)
                            output_store(y, totals, acc_bottom, bh, t * ROWS + half, c)

    assert isinstance(attention, tvm.tirx.PrimFunc)
    return attention


class _Attention(NamedTuple):
    """What the rewrite found for one ``matmul(softmax(Q K^T * scale + mask), V)``."""

    shape: tuple[int, int, int, int]  # (batch, heads, seq, dim)
    sources: tuple  # for Q, K and V: (the value whose columns hold it, its columns, the offset of head 0)
    scale: float | None
    mask: object  # the 4-D float32 mask added to the scores, or None
    rows: object  # a packed build's [batch * seq] rows of the operands (int64), or None
    tokens: int | None  # the operands' rows, in a packed build


def _find(flow, lanes: int) -> tuple[dict, dict]:
    """The attentions the kernel computes in a function of dataflow ``flow``
    (``kernel_calls.dataflow``): the ``P V`` matmul's var -> _Attention, and the head-major
    transposes of their results (var -> the ``P V`` var)."""
    import numpy as np
    import tvm
    from tvm import relax

    from tvmbert.passes.kernel_calls import static_shape as shape_of

    bindings, values, _ = flow

    def op_of(expr):
        value = values.get(expr, expr)
        return getattr(getattr(value, "op", None), "name", None) if isinstance(value, relax.Call) else None

    def axes(expr):
        return [int(a) for a in values[expr].attrs.axes]

    def scalar(expr):
        if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1 and str(expr.value.dtype) == "float32":
            return float(expr.value.numpy().reshape(()))
        return None

    def columns_of(view, rows: int, width: int):
        """(operand, columns, offset): the [rows, width] row-major view ``view`` (through any
        reshapes) is columns offset..offset+width of the operand's [rows, columns]."""
        while op_of(view) == "relax.reshape":
            view = values[view].args[0]
        value = values.get(view)
        if isinstance(value, relax.TupleGetItem) and op_of(value.tuple_value) == "relax.split":
            split = values[value.tuple_value]
            source, shape = split.args[0], shape_of(split.args[0])
            if shape and int(split.attrs.axis) % len(shape) == len(shape) - 1 and np.prod(shape) == rows * shape[-1]:
                sections = split.attrs.indices_or_sections
                if not isinstance(sections, int) and not hasattr(sections, "value"):
                    starts = [0, *(int(s) for s in sections)]
                    ends = [*(int(s) for s in sections), shape[-1]]
                    index = int(value.index)
                    if ends[index] - starts[index] == width:
                        return source, shape[-1], starts[index]
        shape = shape_of(view)
        return (view, width, 0) if shape and np.prod(shape) == rows * width else None

    def heads_of(expr, transposed: bool):
        """(operand, columns, offset, rows, tokens) of a [B, H, S, D] (or, transposed,
        [B, H, D, S]) head-major view of a [B * S, H * D] row-major tensor's columns (rows None),
        or of a packed build's gather of one ([H, T, D] rows ``rows`` of a [T, H * D] tensor's
        columns, made [B, H, S, D]: packing.py's attention)."""
        if op_of(expr) != "relax.permute_dims":
            return None
        if transposed and axes(expr) == [0, 1, 3, 2]:
            expr, transposed = values[expr].args[0], False
            if op_of(expr) != "relax.permute_dims":
                return None
        if not transposed and axes(expr) == [1, 0, 2, 3]:
            return gathered_heads(values[expr].args[0])
        source = values[expr].args[0]
        shape = shape_of(source)
        if axes(expr) != ([0, 2, 3, 1] if transposed else [0, 2, 1, 3]) or shape is None or len(shape) != 4:
            return None
        batch, seq, heads, dim = shape
        columns = columns_of(source, batch * seq, heads * dim)
        return None if columns is None else (*columns, None, None)

    def gathered_heads(view):
        """The packed build's ``reshape(take(take(X, 0, axis=0), rows, axis=1), [H, B, S, D])``
        of a [1, H, T, D] head-major view X."""
        while op_of(view) == "relax.reshape":
            view = values[view].args[0]
        if op_of(view) != "relax.take" or int(values[view].attrs.axis) != 1:
            return None
        per_head, rows = values[view].args
        if op_of(per_head) != "relax.take" or int(values[per_head].attrs.axis) != 0:
            return None
        heads_view, first = values[per_head].args
        if not isinstance(first, tvm.ir.expr.Constant) or first.value.numpy().size != 1 or int(first.value.numpy()) != 0:
            return None
        found = heads_of(heads_view, False)
        if found is None or found[3] is not None or shape_of(heads_view)[0] != 1 or rows.ty.dtype != "int64":
            return None
        tokens = shape_of(heads_view)[2]
        return (*found[:3], rows, tokens)

    found, outputs = {}, {}
    for binding in bindings:
        if op_of(binding.value) != "relax.matmul" or binding.value.ty.dtype != "float32":
            continue
        probabilities, v = binding.value.args
        shape = shape_of(binding.var)
        if shape is None or len(shape) != 4 or op_of(probabilities) != "relax.nn.softmax":
            continue
        batch, heads, seq, dim = shape
        softmax = values[probabilities]
        if int(softmax.attrs.axis) % 4 != 3 or not fits(seq, dim, lanes):
            continue
        scores, scale, mask = softmax.args[0], None, None
        if op_of(scores) == "relax.add":
            for summand, other in (values[scores].args, values[scores].args[::-1]):
                other_shape = shape_of(other)
                if (op_of(summand) in ("relax.multiply", "relax.divide", "relax.matmul") and other.ty.dtype == "float32"
                        and other_shape and len(other_shape) == 4 and other_shape[3] == seq
                        and all(o in (1, f) for o, f in zip(other_shape[:3], (batch, heads, seq)))):
                    scores, mask = summand, other
                    break
            else:
                continue
        if op_of(scores) in ("relax.multiply", "relax.divide"):
            left, right = values[scores].args
            factor = scalar(right) if scalar(right) is not None else (scalar(left) if op_of(scores) == "relax.multiply" else None)
            if factor is None:
                continue
            scale = factor if op_of(scores) == "relax.multiply" else 1.0 / factor
            scores = left if scalar(right) is not None else right
        if op_of(scores) != "relax.matmul" or shape_of(scores) != (batch, heads, seq, seq):
            continue
        q, kt = values[scores].args
        sources = (heads_of(q, False), heads_of(kt, True), heads_of(v, False))
        if any(s is None for s in sources) or any(s[0].ty.dtype != "float32" for s in sources):
            continue
        rows = {s[3] for s in sources}
        if len(rows) != 1 or (None not in rows and shape_of(sources[0][3]) != (batch * seq,)):
            continue  # Q, K and V gathered alike, or not at all
        found[binding.var] = _Attention(shape, tuple(s[:3] for s in sources), scale, mask, sources[0][3], sources[0][4])
    for binding in bindings:
        if op_of(binding.value) == "relax.permute_dims" and binding.value.args[0] in found and axes(binding.var) == [0, 2, 1, 3]:
            outputs[binding.var] = binding.value.args[0]
    return found, outputs


def _panel_sources(module, function, flow, found: dict, outputs: dict, lanes: int) -> dict:
    """The operands to read panel-major: var -> ``(kernel, shape)`` (``fma.panel_major_variant``)
    for each value an FMA kernel computes that, once the attentions are rewritten, nothing but
    the kernel reads, and whose every attention reads all three of Q, K and V from such values
    of one width (bert-base's fused Q/K/V projection)."""
    from tvm import relax

    from tvmbert.kernels import fma

    bindings, values, _ = flow
    reads = {}  # each binding's operands once the attentions are rewritten
    for binding in bindings:
        if binding.var in found:
            attention = found[binding.var]
            reads[binding.var] = {source for source, _, _ in attention.sources} | {
                var for var in (attention.mask, attention.rows) if isinstance(var, relax.Var)}
        elif binding.var in outputs:
            reads[binding.var] = {outputs[binding.var]}
        else:
            reads[binding.var] = set(relax.analysis.free_vars(binding.value))
    live, pending = set(), list(relax.analysis.free_vars(function.body.body))
    while pending:
        var = pending.pop()
        if var not in live:
            live.add(var)
            pending.extend(reads.get(var, ()))

    candidates = {}
    for source in {source for attention in found.values() for source, _, _ in attention.sources}:
        value = values.get(source)
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", None) == "relax.call_tir"):
            continue
        callee = module[value.args[0]]
        if not callee.attrs or fma.KERNEL_ATTR not in callee.attrs:
            continue
        if all(var in found for var in live if source in reads.get(var, ())):
            variant = fma.panel_major_variant(value, callee, lanes)
            if variant is not None:
                candidates[source] = variant
    mixed = True
    while mixed:  # an attention reads its three operands panel-major, of one width, or none so
        mixed = [attention for attention in found.values()
                 if len({candidates[source][1][2] if source in candidates else None for source, _, _ in attention.sources}) > 1]
        for attention in mixed:
            for source, _, _ in attention.sources:
                candidates.pop(source, None)
    return candidates


def attention_rewrite(lanes: int):
    """The module pass: each fp32 ``matmul(softmax(matmul(Q, K^T) [* or / scale] [+ mask]), V)``
    whose Q, K and V are head-major views of row-major [tokens, heads x dim] values (reshapes,
    transposes, the split of a fused projection; in a packed build, their gather into the
    [batch, seq] grid) becomes one call of the kernel on those values;
    the transpose of its result back to [batch, seq, heads, dim] becomes the kernel's output.
    What else uses the views or the scores keeps them (dead code goes)."""
    from tvm import relax

    from tvmbert.passes.kernel_calls import dataflow, function_pass, unread

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module = module
            self.kernels, self.variants = {}, {}
            self.found, self.outputs, self.results, self.panel_sources, self.panels = {}, {}, {}, {}, {}

        def start(self, function):
            flow = dataflow(function)
            self.found, self.outputs = _find(flow, lanes)
            self.panel_sources = _panel_sources(self.module, function, flow, self.found, self.outputs, lanes)
            self.results, self.panels = {}, {}

        def kernel_for(self, found: _Attention, panel: int):
            batch, heads, seq, dim = found.shape
            columns = tuple((c, o) for _, c, o in found.sources)
            mask_shape = tuple(int(d) for d in found.mask.ty.shape) if found.mask is not None else None
            key = (found.shape, columns, mask_shape, found.scale, found.tokens, panel)
            if key not in self.kernels:
                function = kernel(batch, heads, seq, dim, lanes, columns, mask_shape, found.scale, found.tokens, panel)
                name = f"attention_{batch}x{heads}x{seq}x{dim}" + ("_masked" if mask_shape else "") \
                    + (f"_packed{found.tokens}" if found.tokens is not None else "") + (f"_panels{panel}" if panel else "")
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return self.kernels[key]

        def emit_panel_major(self, binding):
            """Next to the FMA kernel call of ``binding`` (dead once the attentions read this, dce
            drops it), its panel-major variant."""
            super().visit_var_binding_(binding)
            function, shape = self.panel_sources[binding.var]
            callee = binding.value.args[0]
            if callee not in self.variants:
                self.variants[callee] = self.builder_.add_func(function.without_attr("global_symbol"), callee.name_hint + "_panels")
            self.panels[binding.var] = self.builder_.emit(relax.call_tir(
                self.variants[callee], [self.visit_expr(arg) for arg in binding.value.args[1].fields], relax.TensorType(shape, "float32")))

        def visit_var_binding_(self, binding):
            if binding.var in self.panel_sources:
                self.emit_panel_major(binding)
            elif binding.var in self.found:
                found = self.found[binding.var]
                batch, heads, seq, dim = found.shape
                operands = []
                operand_rows = found.tokens if found.tokens is not None else batch * seq
                first = found.sources[0][0]  # all three panel-major, of one width, or none (_panel_sources)
                panel = self.panel_sources[first][1][2] if first in self.panel_sources else 0  # [n / width, m, width][2]
                for source, columns, _ in found.sources:
                    if panel:
                        operands.append(self.panels[source])
                        continue
                    source = self.visit_expr(source)
                    if [int(d) for d in source.ty.shape] != [operand_rows, columns]:
                        source = self.builder_.emit(relax.op.reshape(source, (operand_rows, columns)))
                    operands.append(source)
                mask = self.visit_expr(found.mask) if found.mask is not None else unread()
                rows = self.visit_expr(found.rows) if found.rows is not None else unread("int32")
                result = self.builder_.emit(relax.call_tir(self.kernel_for(found, panel), [*operands, mask, rows],
                                                           relax.TensorType((batch, seq, heads, dim), "float32")))
                self.results[binding.var] = result
                self.set_var_remap(binding.var, self.builder_.emit(relax.op.permute_dims(result, [0, 2, 1, 3])))
            elif binding.var in self.outputs and self.outputs[binding.var] in self.results:
                self.set_var_remap(binding.var, self.results[self.outputs[binding.var]])
            else:
                super().visit_var_binding_(binding)

    return function_pass("AttentionFp32", Rewriter)

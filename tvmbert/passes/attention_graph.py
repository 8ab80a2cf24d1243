"""What the passes that replace a layer's attention by one kernel call (``attention-fp32`` on CPUs,
``flash-attention`` on GPUs) share: finding each fp32 ``matmul(softmax(Q K^T * scale + mask), V)``
and where its Q, K and V live (columns of the projections' outputs)."""

from __future__ import annotations

from typing import NamedTuple

MASKED = -3.4028234663852886e38  # float32's minimum: what the graphs' masks put in a masked score


class PositionTerm(NamedTuple):
    """One of DeBERTa's position terms as the kernel reads it (``kernels/attention.Positions``):
    ``product`` [B * H, S, R], gathered at column ``table[a - b + S - 1]`` of row a for query
    row a and key b (``by_key`` False: its c2p) or key row a and query b (True: its p2c), times ``factor``."""

    product: object
    by_key: bool
    factor: float
    table: object  # numpy, 2 S - 1 columns
    # The product's right side [B * H, D, R] where it is ``matmul(Q, this)`` (``matmul(K, this)``
    # by key rows) of the Q (K) the scores read, and alike for every sequence (its head's values
    # tiled over the batch): the kernel can compute the product itself from its first H rows.
    weights: object = None


class Rotary(NamedTuple):
    """Rotary positions applied in the graph to a head-major view of a projection's columns (ModernBERT's Q and K),
    ``x * cos + rotate_half(x) * sin``, rotate_half(x) = ``[-x[..., D / 2:], x[..., :D / 2]]``."""

    source: tuple  # x: (the value whose columns hold it, its columns, the offset of head 0)
    cos: object  # [B or 1, 1, S, D]
    sin: object


class Attention(NamedTuple):
    """What the rewrite found for one ``matmul(softmax(Q K^T * scale + mask), V)``."""

    shape: tuple[int, int, int, int]  # (batch, heads, seq, dim)
    sources: tuple  # for Q, K and V: (the value whose columns hold it, its columns, the offset of head 0)
    scale: float | None
    mask: object  # the 4-D float32 mask added to the scores, or None
    rows: object  # a packed build's [batch * seq] rows of the operands (int64), or None
    tokens: int | None  # the operands' rows, in a packed build
    # Which of Q, K and V are head-major values [B, H, S, D] computed in the graph (ModernBERT's
    # rotary positions on Q and K), not views of a projection's columns: made row-major first.
    head_major: tuple[bool, bool, bool] = (False, False, False)
    # A mask made of key padding alone, or of key padding and a window (ModernBERT's
    # ``where(|i - j| <= window & padding[j], 0, min)``): the [B, 1, 1, S] bool of the keys that
    # count (``mask`` is then None) and the window's half width, or None. The kernel computes the
    # window itself, only its blocks of scores, and no [B, 1, S, S] mask is made.
    padding: object = None
    window: int | None = None
    # DeBERTa's: a [B * H, S, S] float32 term added to the flat scores (its content-to-position
    # and position-to-content scores, gathered by the graph), and the bool whose True scores are
    # replaced by the float32 minimum (``where(~mask, min, scores)``). The kernel reads the term's
    # parts (``positions``) where it finds them, else the term whole, with the bool, as one mask.
    bias: object = None
    excluded: object = None
    # ``bias`` as its gathered terms, one by query rows and one by key rows at most, where its
    # gathers' indices are a relative position's (``Dataflow.position_terms``); else empty.
    positions: tuple = ()
    # For Q, K and V: the Rotary a head-major source is, where it is one, else None: the
    # projection's kernel can then rotate them as it stores them (``attention_fp32``).
    rotary: tuple = (None, None, None)


class Dataflow:
    """What the matching asks of one function's dataflow (``ir/dataflow.dataflow``): ops, axes,
    scalar constants, and where a head-major view's values live."""

    def __init__(self, flow):
        self.bindings, self.values, _ = flow

    def op_of(self, expr):
        from tvm import relax

        value = self.values.get(expr, expr)
        return getattr(getattr(value, "op", None), "name", None) if isinstance(value, relax.Call) else None

    def axes(self, expr):
        return [int(a) for a in self.values[expr].attrs.axes]

    @staticmethod
    def scalar(expr):
        import tvm

        if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1 and str(expr.value.dtype) == "float32":
            return float(expr.value.numpy().reshape(()))
        return None

    def one_axis_slice(self, expr):
        """(x, x's shape, axis, begin, end) of a step-1 ``strided_slice`` of x along one axis (end
        at most its size), or None."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        if self.op_of(expr) != "relax.strided_slice":
            return None
        call = self.values[expr]
        source, shape = call.args[0], shape_of(call.args[0])
        if shape is None or len(call.args[1].fields) != 1 or (len(call.args) > 4 and any(int(f) != 1 for f in call.args[4].fields)):
            return None
        axis = int(call.args[1].fields[0]) % len(shape)
        return source, shape, axis, int(call.args[2].fields[0]), min(int(call.args[3].fields[0]), shape[axis])

    def column_slice(self, view, rows: int):
        """(source, offset) where ``view`` is a slice of ``source`` [*rows, a, ...] along its first
        axis past the rows (ModernBERT's ``qkv[:, :, i]`` of its [rows, 3, heads, dim] projection):
        the columns from ``offset`` of the source's [rows, columns]; None for anything else."""
        import numpy as np

        sliced = self.one_axis_slice(view)
        if sliced is None:
            return None
        source, shape, axis, begin, _ = sliced
        if int(np.prod(shape[:axis])) != rows:
            return None
        return (source, begin * int(np.prod(shape[axis + 1:]))) if 0 <= begin < shape[axis] else None

    def columns_of(self, view, rows: int, width: int):
        """(operand, columns, offset): the [rows, width] row-major view ``view`` (through any
        reshapes, and slices of a projection's columns with the axes they leave squeezed) is
        columns offset..offset+width of the operand's [rows, columns]."""
        import numpy as np
        from tvm import relax

        from tvmbert.ir.dataflow import static_shape as shape_of

        values = self.values
        offset, sliced = 0, False
        while True:
            while self.op_of(view) in ("relax.reshape", "relax.squeeze"):
                view = values[view].args[0]
            if (columns := self.column_slice(view, rows)) is None:
                break
            view, offset, sliced = columns[0], offset + columns[1], True
        if sliced:
            shape = shape_of(view)
            columns = int(np.prod(shape)) // rows
            return (view, columns, offset) if offset + width <= columns else None
        value = values.get(view)
        if isinstance(value, relax.TupleGetItem) and self.op_of(value.tuple_value) == "relax.split":
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

    @staticmethod
    def constant(expr):
        """A constant's values (numpy), or None."""
        import tvm

        return expr.value.numpy() if isinstance(expr, tvm.ir.expr.Constant) else None

    def conjunction(self, condition) -> list:
        """The factors of a bool tensor made by ``bitwise_and``/``logical_and`` and broadcasts."""
        if self.op_of(condition) in ("relax.bitwise_and", "relax.logical_and"):
            return [f for arg in self.values[condition].args for f in self.conjunction(arg)]
        if self.op_of(condition) == "relax.broadcast_to":
            return self.conjunction(self.values[condition].args[0])
        return [condition]

    def position_axis(self, expr, seq: int):
        """The axis along which ``expr`` holds the positions 0 .. seq - 1 (an ``arange(0, seq)``
        through expand_dims, reshapes and adds of 0), every other axis of size 1; or None."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        shape, value = shape_of(expr), expr
        while self.op_of(value) in ("relax.expand_dims", "relax.reshape", "relax.add"):
            call = self.values[value]
            if self.op_of(value) == "relax.add":
                zero = self.constant(call.args[1])
                if zero is None or zero.size != 1 or int(zero.reshape(())) != 0:
                    return None
            value = call.args[0]
        if self.op_of(value) != "relax.arange" or shape is None:
            return None
        start, end, step = (int(getattr(a, "value", -1)) for a in self.values[value].args)
        axes = [axis for axis, size in enumerate(shape) if size != 1]
        return axes[0] if (start, end, step) == (0, seq, 1) and len(axes) == 1 and shape[axes[0]] == seq else None

    def window_of(self, factor, seq: int):
        """w for ``|i - j| <= w`` over query positions i and key positions j; None for another factor."""
        if self.op_of(factor) != "relax.less_equal" or self.op_of(self.values[factor].args[0]) != "relax.abs":
            return None
        difference, bound = self.values[self.values[factor].args[0]].args[0], self.constant(self.values[factor].args[1])
        if self.op_of(difference) != "relax.subtract" or bound is None or bound.size != 1:
            return None
        axes = {self.position_axis(arg, seq) for arg in self.values[difference].args}
        return int(bound.reshape(())) if axes == {2, 3} else None

    def padding_and_window(self, mask, batch: int, seq: int):
        """(padding, window) of a mask ``where(padding & [|i - j| <= window], 0, min)``, the rest
        of its condition always true (constants, ``position >= 0``): padding the [B or 1, 1, 1, S]
        bool of the keys that count, window w or None. None for any other mask."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        if self.op_of(mask) != "relax.where":
            return None
        condition, kept, masked = self.values[mask].args
        if self.scalar(kept) != 0.0 or (self.scalar(masked) or 0.0) > -1e38:
            return None
        padding, window = None, None
        for factor in self.conjunction(condition):
            constant = self.constant(factor)
            if constant is not None and constant.dtype == bool and constant.all():
                continue
            if (width := self.window_of(factor, seq)) is not None and window is None:
                window = width
                continue
            if self.op_of(factor) == "relax.greater_equal":
                bound = self.constant(self.values[factor].args[1])
                if (bound is not None and bound.size == 1 and int(bound.reshape(())) == 0
                        and self.position_axis(self.values[factor].args[0], seq) is not None):
                    continue  # a position is never negative
            if (padding is None and factor.ty.dtype == "bool" and shape_of(factor) in ((batch, 1, 1, seq), (1, 1, 1, seq))
                    and self.constant(factor) is None):
                padding = factor
                continue
            return None
        return (padding, window) if padding is not None else None

    def broadcasts(self, expr, shape: tuple, dtype: str) -> bool:
        """Whether ``expr`` is a 4-D ``dtype`` tensor that broadcasts to ``shape``."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        own = shape_of(expr)
        return (expr.ty.dtype == dtype and own is not None and len(own) == 4
                and all(o in (1, f) for o, f in zip(own, shape)))

    def scaled(self, expr):
        """(x, factor) of ``x * c``, ``c * x`` or ``x / c`` with c a scalar constant; (expr, None) otherwise."""
        if self.op_of(expr) in ("relax.multiply", "relax.divide"):
            left, right = self.values[expr].args
            if self.scalar(right) is not None:
                return left, self.scalar(right) if self.op_of(expr) == "relax.multiply" else 1.0 / self.scalar(right)
            if self.op_of(expr) == "relax.multiply" and self.scalar(left) is not None:
                return right, self.scalar(left)
        return expr, None

    def flat_scores(self, flat, batch: int, heads: int, seq: int):
        """(Q view, K view, scale or None, bias or None) of DeBERTa's flat scores
        ``matmul(Q3, K3^T [/ c]) [+ bias]``, Q3 and K3 [B * H, S, D] reshapes of head-major views
        and bias [B * H, S, S]; None for anything else."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        bias = None
        if self.op_of(flat) == "relax.add":
            for product, other in (self.values[flat].args, self.values[flat].args[::-1]):
                if (self.op_of(product) == "relax.matmul" and other.ty.dtype == "float32"
                        and shape_of(other) == (batch * heads, seq, seq)):
                    flat, bias = product, other
                    break
            else:
                return None
        if self.op_of(flat) != "relax.matmul":
            return None
        q3, kt3 = self.values[flat].args
        kt3, scale = self.scaled(kt3)
        if self.op_of(kt3) != "relax.permute_dims" or self.axes(kt3) != [0, 2, 1]:
            return None
        views = []
        for flat_view in (q3, self.values[kt3].args[0]):
            view = self.values[flat_view].args[0] if self.op_of(flat_view) == "relax.reshape" else None
            if view is None or shape_of(view) is None or len(shape_of(view)) != 4 or shape_of(view)[:3] != (batch, heads, seq):
                return None
            views.append(view)
        return views[0], views[1], scale, bias

    def position_terms(self, bias, batch: int, heads: int, seq: int, views: tuple) -> tuple:
        """DeBERTa's position scores ``bias`` [B * H, S, S] as PositionTerms: a sum of scaled
        ``gather_elements(P, index, axis=-1)`` (transposed, for its p2c), P [B * H, S, R] and the
        constant index alike for every row of P's first axis and a function of the difference
        of its two positions alone. Empty for anything else (the kernel then reads ``bias`` whole).
        ``views``: the scores' Q and K, head-major [B, H, S, D] (``PositionTerm.weights``)."""
        import numpy as np

        from tvmbert.ir.dataflow import static_shape as shape_of

        terms = []

        def collect(expr, factor: float, transposed: bool) -> bool:
            op = self.op_of(expr)
            if op == "relax.add":
                return all(self.scalar(arg) == 0.0 or collect(arg, factor, transposed) for arg in self.values[expr].args)
            if op in ("relax.multiply", "relax.divide"):
                inner, by = self.scaled(expr)
                return by is not None and collect(inner, factor * by, transposed)
            if op == "relax.permute_dims" and self.axes(expr) == [0, 2, 1]:
                return collect(self.values[expr].args[0], factor, not transposed)
            if op != "relax.gather_elements" or int(self.values[expr].attrs.axis) not in (-1, 2):
                return False
            product, index = self.values[expr].args
            index, shape = self.constant(index), shape_of(product)
            if (index is None or shape is None or len(shape) != 3 or shape[:2] != (batch * heads, seq) or product.ty.dtype != "float32"
                    or index.shape != (batch * heads, seq, seq) or not (index == index[:1]).all()
                    or index.min() < 0 or index.max() >= shape[2]):
                return False  # (an index of one row would gather P's first row alone, for every head)
            index = index[0]
            table = np.concatenate([index[0, ::-1], index[1:, 0]])  # at a - b + S - 1, from row 0 and column 0
            a, b = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
            if not np.array_equal(table[a - b + seq - 1], index):
                return False
            weights = None
            if self.op_of(product) == "relax.matmul":
                left, right = self.values[product].args
                view = views[1 if transposed else 0]
                if (self.op_of(left) == "relax.reshape" and self.values[left].args[0].same_as(view) and right.ty.dtype == "float32"
                        and shape_of(right) == (batch * heads, shape_of(view)[3], shape[2]) and self.tiled_over_batch(right, batch, heads)):
                    weights = right
            terms.append(PositionTerm(product, transposed, factor, table, weights))
            return True

        if not collect(bias, 1.0, False) or sorted(term.by_key for term in terms) not in ([False], [True], [False, True]):
            return ()
        return tuple(sorted(terms, key=lambda term: term.by_key))

    def tiled_over_batch(self, expr, batch: int, heads: int) -> bool:
        """Whether [B * H, ...] ``expr`` is ``tile(X, [B, 1, ...])`` of an [H, ...] X, through
        transposes and slices that keep its first axis (DeBERTa's position keys and queries,
        ``repeat``ed for every sequence): row bh is row bh % H."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        if batch == 1:
            return True
        while self.op_of(expr) in ("relax.permute_dims", "relax.strided_slice"):
            call = self.values[expr]
            if self.op_of(expr) == "relax.permute_dims" and self.axes(expr)[0] != 0:
                return False
            if self.op_of(expr) == "relax.strided_slice" and 0 in [int(axis.value) % len(shape_of(expr)) for axis in call.args[1].fields]:
                return False
            expr = call.args[0]
        if self.op_of(expr) != "relax.tile":
            return False
        repeats = [int(r) for r in self.values[expr].attrs.repeats]
        return repeats == [batch] + [1] * (len(repeats) - 1) and shape_of(self.values[expr].args[0])[0] == heads

    def heads_of(self, expr, transposed: bool):
        """(operand, columns, offset, rows, tokens) of a [B, H, S, D] (or, transposed,
        [B, H, D, S]) head-major view of a [B * S, H * D] row-major tensor's columns (rows None),
        or of a packed build's gather of one ([H, T, D] rows ``rows`` of a [T, H * D] tensor's
        columns, made [B, H, S, D]: packing.py's attention)."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        values = self.values
        if self.op_of(expr) != "relax.permute_dims":
            return None if transposed else self.computed_heads(expr)
        if transposed and self.axes(expr) == [0, 1, 3, 2]:
            expr, transposed = values[expr].args[0], False
            if self.op_of(expr) != "relax.permute_dims":
                return self.computed_heads(expr)
        if not transposed and self.axes(expr) == [1, 0, 2, 3]:
            return self.gathered_heads(values[expr].args[0])
        source = values[expr].args[0]
        shape = shape_of(source)
        if self.axes(expr) != ([0, 2, 3, 1] if transposed else [0, 2, 1, 3]) or shape is None or len(shape) != 4:
            return None
        batch, seq, heads, dim = shape
        columns = self.columns_of(source, batch * seq, heads * dim)
        return None if columns is None else (*columns, None, None)

    def computed_heads(self, expr):
        """(value, H * D, 0, None, None, head-major, Rotary or None) of a [B, H, S, D] float32
        value the graph computes head-major (rotary positions applied to Q or K), or None."""
        from tvm import relax

        from tvmbert.ir.dataflow import static_shape as shape_of

        shape = shape_of(expr)
        if not isinstance(self.values.get(expr), relax.Call) or shape is None or len(shape) != 4 or expr.ty.dtype != "float32":
            return None
        return expr, shape[1] * shape[3], 0, None, None, True, self.rotary_of(expr)

    def rotary_of(self, expr):
        """The Rotary that [B, H, S, D] ``expr`` is (either order of its sum and products), x a
        head-major view of a projection's columns and cos and sin [B or 1, 1, S, D] float32; None otherwise."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        shape = shape_of(expr)
        if self.op_of(expr) != "relax.add" or shape is None or shape[3] % 2:
            return None

        def factors(product):
            if self.op_of(product) != "relax.multiply":
                return []
            left, right = self.values[product].args
            return [(left, right), (right, left)]

        def table(expr):
            own = shape_of(expr)
            return expr.ty.dtype == "float32" and own is not None and len(own) == 4 and own[0] in (1, shape[0]) \
                and own[1:] == (1, *shape[2:])

        for straight, turned in (self.values[expr].args, self.values[expr].args[::-1]):
            for x, cos in factors(straight):
                for half_turn, sin in factors(turned):
                    source = self.half_turn_of(half_turn)
                    if source is None or not source.same_as(x) or not (table(cos) and table(sin)):
                        continue
                    found = self.heads_of(x, False)
                    if found is not None and len(found) == 5 and found[3] is None:
                        return Rotary(found[:3], cos, sin)
        return None

    def half_turn_of(self, expr):
        """x of ``concat([-x[..., D / 2:], x[..., :D / 2]], axis=-1)``, or None."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        shape = shape_of(expr)
        if self.op_of(expr) != "relax.concat" or shape is None or int(self.values[expr].attrs.axis) % len(shape) != len(shape) - 1:
            return None
        parts = getattr(self.values[expr].args[0], "fields", ())
        if len(parts) != 2 or self.op_of(parts[0]) != "relax.negative":
            return None
        upper, lower = self.one_axis_slice(self.values[parts[0]].args[0]), self.one_axis_slice(parts[1])
        half = shape[-1] // 2
        if (upper and lower and upper[0].same_as(lower[0]) and upper[2] == lower[2] == len(shape) - 1
                and upper[3:] == (half, shape[-1]) and lower[3:] == (0, half)):
            return upper[0]
        return None

    def gathered_heads(self, view):
        """The packed build's ``reshape(take(take(X, 0, axis=0), rows, axis=1), [H, B, S, D])``
        of a [1, H, T, D] head-major view X, or of such a value the graph computes (ModernBERT's
        rotary Q and K)."""
        import tvm

        from tvmbert.ir.dataflow import static_shape as shape_of

        values = self.values
        while self.op_of(view) == "relax.reshape":
            view = values[view].args[0]
        if self.op_of(view) != "relax.take" or int(values[view].attrs.axis) != 1:
            return None
        per_head, rows = values[view].args
        if self.op_of(per_head) != "relax.take" or int(values[per_head].attrs.axis) != 0:
            return None
        heads_view, first = values[per_head].args
        if not isinstance(first, tvm.ir.expr.Constant) or first.value.numpy().size != 1 or int(first.value.numpy()) != 0:
            return None
        found = self.heads_of(heads_view, False)
        if found is None or found[3] is not None or shape_of(heads_view)[0] != 1 or rows.ty.dtype != "int64":
            return None
        tokens = shape_of(heads_view)[2]
        return (*found[:3], rows, tokens, *found[5:])


def attention_at(graph: Dataflow, binding, fits) -> Attention | None:
    """The attention whose ``P V`` matmul ``binding`` is, if ``fits(seq, dim)`` (the kernel computes it)."""
    from tvmbert.ir.dataflow import static_shape as shape_of

    op_of, values = graph.op_of, graph.values
    if op_of(binding.value) != "relax.matmul" or binding.value.ty.dtype != "float32":
        return None
    probabilities, v = binding.value.args
    shape = shape_of(binding.var)
    if shape is None or len(shape) != 4 or op_of(probabilities) != "relax.nn.softmax":
        return None
    batch, heads, seq, dim = shape
    softmax = values[probabilities]
    if int(softmax.attrs.axis) % 4 != 3 or not fits(seq, dim):
        return None
    scores, scale, mask, bias, excluded = softmax.args[0], None, None, None, None
    if op_of(scores) == "relax.where":  # DeBERTa: where(~mask, min, scores)
        condition, masked, kept = values[scores].args
        if (graph.scalar(masked) or 0.0) > -1e38 or not graph.broadcasts(condition, (batch, heads, seq, seq), "bool"):
            return None
        scores, excluded = kept, condition
    if op_of(scores) == "relax.add":
        for summand, other in (values[scores].args, values[scores].args[::-1]):
            other_shape = shape_of(other)
            if (op_of(summand) in ("relax.multiply", "relax.divide", "relax.matmul") and other.ty.dtype == "float32"
                    and other_shape and len(other_shape) == 4 and other_shape[3] == seq
                    and all(o in (1, f) for o, f in zip(other_shape[:3], (batch, heads, seq)))):
                scores, mask = summand, other
                break
        else:
            return None
    scores, scale = graph.scaled(scores)
    if op_of(scores) == "relax.reshape" and shape_of(values[scores].args[0]) == (batch * heads, seq, seq):
        found = graph.flat_scores(values[scores].args[0], batch, heads, seq)  # DeBERTa's [B * H, S, S]
        if found is None or (found[2] is not None and scale is not None) or (scale is not None and found[3] is not None):
            return None  # (a scale outside the flat scores scales DeBERTa's position scores too: not the kernel's sum)
        q_view, k_view, scale, bias = found[0], found[1], found[2] if found[2] is not None else scale, found[3]
        sources = (graph.heads_of(q_view, False), graph.heads_of(k_view, False), graph.heads_of(v, False))
    elif op_of(scores) == "relax.matmul" and shape_of(scores) == (batch, heads, seq, seq):
        q, kt = values[scores].args
        sources = (graph.heads_of(q, False), graph.heads_of(kt, True), graph.heads_of(v, False))
    else:
        return None
    if any(s is None for s in sources) or any(s[0].ty.dtype != "float32" for s in sources):
        return None
    rows = {s[3] for s in sources}
    if len(rows) != 1 or (None not in rows and shape_of(sources[0][3]) != (batch * seq,)):
        return None  # Q, K and V gathered alike, or not at all
    head_major = tuple(len(s) > 5 for s in sources)
    rotary = tuple(s[6] if len(s) > 6 else None for s in sources)
    padding, window = (graph.padding_and_window(mask, batch, seq) or (None, None)) if mask is not None else (None, None)
    if padding is not None:
        mask = None
    positions = graph.position_terms(bias, batch, heads, seq, (q_view, k_view)) if bias is not None else ()
    return Attention(shape, tuple(s[:3] for s in sources), scale, mask, sources[0][3], sources[0][4], head_major, padding,
                     window, bias, excluded, positions, rotary)


def row_major(builder, source, head_major: bool, rows: int, columns: int):
    """An operand as the kernels read it, [rows, columns]: a head-major [B, H, S, D] value
    transposed to [B, S, H, D] first (ModernBERT's rotary Q and K: TVM fuses the transpose into
    the kernel that computes them)."""
    from tvm import relax

    if head_major:
        source = builder.emit(relax.op.permute_dims(source, [0, 2, 1, 3]))
    if [int(d) for d in source.ty.shape] != [rows, columns]:
        source = builder.emit(relax.op.reshape(source, (rows, columns)))
    return source


def mask_operand(builder, found: Attention, visit, padding_masks: dict, positions_read: bool = False):
    """The one additive mask the kernels read for ``found`` (broadcasting to [B, H, S, S]), or
    None: its mask, or the key padding's (made once per padding, ``padding_masks`` holding those
    made: every layer reads the same); DeBERTa's position scores added, unless the kernel reads
    them (``positions_read``); its excluded scores replaced by the float32 minimum (with no other
    term, the [B, 1, S, S] mask of them alone, made once as a padding's)."""
    from tvm import relax

    batch, heads, seq, _ = found.shape

    def made_once(var, make):  # the additive mask of a bool every layer reads, made for the first
        if var not in padding_masks:
            padding_masks[var] = make(visit(var))
        return padding_masks[var]

    term = None
    if found.padding is not None:
        term = made_once(found.padding, lambda padding: padding_mask(builder, padding))
    elif found.mask is not None:
        term = visit(found.mask)
    if found.bias is not None and not positions_read:
        bias = builder.emit(relax.op.reshape(visit(found.bias), (batch, heads, seq, seq)))
        term = bias if term is None else builder.emit(relax.op.add(bias, term))
    if found.excluded is not None and term is None:
        term = made_once(found.excluded, lambda excluded: builder.emit(relax.op.where(excluded, relax.const(MASKED, "float32"),
                                                                                      relax.const(0.0, "float32"))))
    elif found.excluded is not None:
        term = builder.emit(relax.op.where(visit(found.excluded), relax.const(MASKED, "float32"), term))
    return term


def padding_mask(builder, padding):
    """The additive [B, 1, 1, S] mask of a key padding bool: 0 where a key counts, the float32
    minimum where not (the graph's ``where``, without its [B, 1, S, S] broadcast)."""
    from tvm import relax

    return builder.emit(relax.op.where(padding, relax.const(0.0, "float32"), relax.const(MASKED, "float32")))


def find(flow, fits) -> tuple[dict, dict]:
    """The attentions a kernel computes (``fits(seq, dim)``) in a function of dataflow ``flow``
    (``ir/dataflow.dataflow``): the ``P V`` matmul's var -> Attention, and the head-major
    transposes of their results (var -> the ``P V`` var)."""
    graph = Dataflow(flow)
    found = {}
    for binding in graph.bindings:
        if (attention := attention_at(graph, binding, fits)) is not None:
            found[binding.var] = attention
    outputs = {binding.var: binding.value.args[0] for binding in graph.bindings
               if graph.op_of(binding.value) == "relax.permute_dims" and binding.value.args[0] in found
               and graph.axes(binding.var) == [0, 2, 1, 3]}
    return found, outputs

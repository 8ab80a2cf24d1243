"""What the passes that replace a layer's attention by one kernel call (``attention-fp32`` on CPUs,
``flash-attention`` on GPUs) share: finding each fp32 ``matmul(softmax(Q K^T * scale + mask), V)``
and where its Q, K and V live (columns of the projections' outputs)."""

from __future__ import annotations

from typing import NamedTuple


class Attention(NamedTuple):
    """What the rewrite found for one ``matmul(softmax(Q K^T * scale + mask), V)``."""

    shape: tuple[int, int, int, int]  # (batch, heads, seq, dim)
    sources: tuple  # for Q, K and V: (the value whose columns hold it, its columns, the offset of head 0)
    scale: float | None
    mask: object  # the 4-D float32 mask added to the scores, or None
    rows: object  # a packed build's [batch * seq] rows of the operands (int64), or None
    tokens: int | None  # the operands' rows, in a packed build


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

    def columns_of(self, view, rows: int, width: int):
        """(operand, columns, offset): the [rows, width] row-major view ``view`` (through any
        reshapes) is columns offset..offset+width of the operand's [rows, columns]."""
        import numpy as np
        from tvm import relax

        from tvmbert.ir.dataflow import static_shape as shape_of

        values = self.values
        while self.op_of(view) == "relax.reshape":
            view = values[view].args[0]
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

    def heads_of(self, expr, transposed: bool):
        """(operand, columns, offset, rows, tokens) of a [B, H, S, D] (or, transposed,
        [B, H, D, S]) head-major view of a [B * S, H * D] row-major tensor's columns (rows None),
        or of a packed build's gather of one ([H, T, D] rows ``rows`` of a [T, H * D] tensor's
        columns, made [B, H, S, D]: packing.py's attention)."""
        from tvmbert.ir.dataflow import static_shape as shape_of

        values = self.values
        if self.op_of(expr) != "relax.permute_dims":
            return None
        if transposed and self.axes(expr) == [0, 1, 3, 2]:
            expr, transposed = values[expr].args[0], False
            if self.op_of(expr) != "relax.permute_dims":
                return None
        if not transposed and self.axes(expr) == [1, 0, 2, 3]:
            return self.gathered_heads(values[expr].args[0])
        source = values[expr].args[0]
        shape = shape_of(source)
        if self.axes(expr) != ([0, 2, 3, 1] if transposed else [0, 2, 1, 3]) or shape is None or len(shape) != 4:
            return None
        batch, seq, heads, dim = shape
        columns = self.columns_of(source, batch * seq, heads * dim)
        return None if columns is None else (*columns, None, None)

    def gathered_heads(self, view):
        """The packed build's ``reshape(take(take(X, 0, axis=0), rows, axis=1), [H, B, S, D])``
        of a [1, H, T, D] head-major view X."""
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
        return (*found[:3], rows, tokens)


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
            return None
    if op_of(scores) in ("relax.multiply", "relax.divide"):
        left, right = values[scores].args
        scalar = graph.scalar
        factor = scalar(right) if scalar(right) is not None else (scalar(left) if op_of(scores) == "relax.multiply" else None)
        if factor is None:
            return None
        scale = factor if op_of(scores) == "relax.multiply" else 1.0 / factor
        scores = left if scalar(right) is not None else right
    if op_of(scores) != "relax.matmul" or shape_of(scores) != (batch, heads, seq, seq):
        return None
    q, kt = values[scores].args
    sources = (graph.heads_of(q, False), graph.heads_of(kt, True), graph.heads_of(v, False))
    if any(s is None for s in sources) or any(s[0].ty.dtype != "float32" for s in sources):
        return None
    rows = {s[3] for s in sources}
    if len(rows) != 1 or (None not in rows and shape_of(sources[0][3]) != (batch * seq,)):
        return None  # Q, K and V gathered alike, or not at all
    return Attention(shape, tuple(s[:3] for s in sources), scale, mask, sources[0][3], sources[0][4])


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

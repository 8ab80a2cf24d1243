"""The ``attention-fp32`` pass: each layer's attention (Q K^T, scale, mask, softmax, P V and the
head transposes around them) found in the graph and replaced by one call of the attention kernel
(``kernels/attention.py``), reading Q, K and V where the projection wrote them."""

from __future__ import annotations

from typing import NamedTuple

from tvmbert.kernels.attention import amx_bf16_fits, amx_bf16_kernel, fits, kernel


class _Attention(NamedTuple):
    """What the rewrite found for one ``matmul(softmax(Q K^T * scale + mask), V)``."""

    shape: tuple[int, int, int, int]  # (batch, heads, seq, dim)
    sources: tuple  # for Q, K and V: (the value whose columns hold it, its columns, the offset of head 0)
    scale: float | None
    mask: object  # the 4-D float32 mask added to the scores, or None
    rows: object  # a packed build's [batch * seq] rows of the operands (int64), or None
    tokens: int | None  # the operands' rows, in a packed build


class _Dataflow:
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


def _attention_at(graph: _Dataflow, binding, lanes: int) -> _Attention | None:
    """The attention whose ``P V`` matmul ``binding`` is, if the kernel computes it."""
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
    if int(softmax.attrs.axis) % 4 != 3 or not fits(seq, dim, lanes):
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
    return _Attention(shape, tuple(s[:3] for s in sources), scale, mask, sources[0][3], sources[0][4])


def _find(flow, lanes: int) -> tuple[dict, dict]:
    """The attentions the kernel computes in a function of dataflow ``flow``
    (``ir/dataflow.dataflow``): the ``P V`` matmul's var -> _Attention, and the head-major
    transposes of their results (var -> the ``P V`` var)."""
    graph = _Dataflow(flow)
    found = {}
    for binding in graph.bindings:
        if (attention := _attention_at(graph, binding, lanes)) is not None:
            found[binding.var] = attention
    outputs = {binding.var: binding.value.args[0] for binding in graph.bindings
               if graph.op_of(binding.value) == "relax.permute_dims" and binding.value.args[0] in found
               and graph.axes(binding.var) == [0, 2, 1, 3]}
    return found, outputs


def _panel_sources(module, function, flow, found: dict, outputs: dict, lanes: int) -> dict:
    """The operands to read panel-major: var -> ``(kernel, shape)`` (``fma_fp32.panel_major_variant``)
    for each value an FMA kernel computes that, once the attentions are rewritten, nothing but
    the kernel reads, and whose every attention reads all three of Q, K and V from such values
    of one width (bert-base's fused Q/K/V projection)."""
    from tvm import relax

    from tvmbert.kernels import fma
    from tvmbert.passes.fma_fp32 import panel_major_variant

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
            variant = panel_major_variant(value, callee, lanes)
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


def attention_rewrite(lanes: int, amx_bf16: bool = False):
    """The module pass: each fp32 ``matmul(softmax(matmul(Q, K^T) [* or / scale] [+ mask]), V)``
    whose Q, K and V are head-major views of row-major [tokens, heads x dim] values (reshapes,
    transposes, the split of a fused projection; in a packed build, their gather into the
    [batch, seq] grid) becomes one call of the kernel on those values;
    the transpose of its result back to [batch, seq, heads, dim] becomes the kernel's output.
    What else uses the views or the scores keeps them (dead code goes). With ``amx_bf16``, the
    kernel's matmuls run on AMX-BF16 where its tiles fit (``kernels/attention.amx_bf16_kernel``)."""
    from tvm import relax

    from tvmbert.ir.dataflow import dataflow, unread
    from tvmbert.passes.rewriters import function_pass

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
                on_amx = amx_bf16 and amx_bf16_fits(seq, dim, lanes)
                function = (amx_bf16_kernel if on_amx else kernel)(batch, heads, seq, dim, lanes, columns, mask_shape, found.scale,
                                                                     found.tokens, panel)
                name = f"attention_{batch}x{heads}x{seq}x{dim}" + ("_masked" if mask_shape else "") \
                    + (f"_packed{found.tokens}" if found.tokens is not None else "") + (f"_panels{panel}" if panel else "") \
                    + ("_amx" if on_amx else "")
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

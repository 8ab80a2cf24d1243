"""The ``attention-fp32`` pass: each layer's attention (Q K^T, scale, mask, softmax, P V and the
head transposes around them) found in the graph and replaced by one call of the attention kernel
(``kernels/attention.py``), reading Q, K and V where the projection wrote them."""

from __future__ import annotations

from tvmbert.kernels.attention import Positions, amx_bf16_fits, amx_bf16_kernel, fits, kernel
from tvmbert.passes.attention_graph import Attention, find, mask_operand, row_major


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
                var for var in (attention.mask, attention.rows, attention.padding, attention.bias, attention.excluded)
                if isinstance(var, relax.Var)}
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
    What else uses the views or the scores keeps them (dead code goes). DeBERTa's position
    scores are gathered by the kernel from their two products (``kernels/attention.Positions``),
    with no [batch x heads, seq, seq] tensor of them. With ``amx_bf16``, the
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
            self.found, self.outputs, self.results, self.panel_sources, self.panels, self.padding_masks = {}, {}, {}, {}, {}, {}

        def start(self, function):
            flow = dataflow(function)
            self.found, self.outputs = find(flow, lambda seq, dim: fits(seq, dim, lanes))
            self.panel_sources = _panel_sources(self.module, function, flow, self.found, self.outputs, lanes)
            self.results, self.panels, self.padding_masks = {}, {}, {}

        def kernel_for(self, found: Attention, panel: int, mask, on_amx: bool, positions: Positions | None):
            batch, heads, seq, dim = found.shape
            columns = tuple((c, o) for _, c, o in found.sources)
            mask_shape = tuple(int(d) for d in mask.ty.shape) if mask is not None else None
            key = (found.shape, columns, mask_shape, found.scale, found.tokens, panel, found.window, positions)
            if key not in self.kernels:
                function = (amx_bf16_kernel if on_amx else kernel)(batch, heads, seq, dim, lanes, columns, mask_shape, found.scale,
                                                                     found.tokens, panel, found.window, positions)
                name = f"attention_{batch}x{heads}x{seq}x{dim}" + ("_masked" if mask_shape else "") \
                    + (f"_window{found.window}" if found.window is not None else "") \
                    + (f"_packed{found.tokens}" if found.tokens is not None else "") + (f"_panels{panel}" if panel else "") \
                    + ("_positions" if positions is not None else "") \
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

        def position_operands(self, terms, batch: int, seq: int, compute: bool):
            """(Positions, its operands) for the kernel to gather DeBERTa's position terms, (None, [])
            without any: the products, or with ``compute`` (the fp32 kernel) and the terms' weights
            found, those of one sequence (its heads), their columns padded with zeros to whole
            vectors, for the kernel to compute the products (bind-params slices and pads them once)."""
            import numpy as np

            if not terms:
                return None, []
            by = {term.by_key: term for term in terms}
            weights = compute and all(term.weights is not None for term in terms)
            operands = []
            for side in (False, True):
                if side not in by:
                    operands.append(unread())
                elif not weights:
                    operands.append(self.visit_expr(by[side].product))
                else:
                    operand = self.visit_expr(by[side].weights)
                    heads = int(operand.ty.shape[0]) // batch
                    if batch > 1:
                        operand = self.builder_.emit(relax.op.strided_slice(operand, axes=[0], begin=[0], end=[heads]))
                    columns = int(operand.ty.shape[2])
                    if columns % lanes:
                        operand = self.builder_.emit(relax.op.nn.pad(operand, [0, 0, 0, 0, 0, -columns % lanes]))
                    operands.append(operand)
            widths = [int(operand.ty.shape[2]) if side in by else 1 for side, operand in zip((False, True), operands)]
            positions = Positions(*(by[side].factor if side in by else None for side in (False, True)), *widths, weights)
            none = np.zeros(2 * seq - 1, "int32")
            index = Positions.index(*(by[side].table if side in by else none for side in (False, True)))
            return positions, [*operands, relax.const(index)]

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
                for (source, columns, _), head_major in zip(found.sources, found.head_major):
                    if panel:
                        operands.append(self.panels[source])
                        continue
                    operands.append(row_major(self.builder_, self.visit_expr(source), head_major, operand_rows, columns))
                on_amx = amx_bf16 and amx_bf16_fits(seq, dim, lanes)
                mask = mask_operand(self.builder_, found, self.visit_expr, self.padding_masks, positions_read=bool(found.positions))
                rows = self.visit_expr(found.rows) if found.rows is not None else unread("int32")
                positions, position_operands = self.position_operands(found.positions, batch, seq, not on_amx)
                result = self.builder_.emit(relax.call_tir(self.kernel_for(found, panel, mask, on_amx, positions),
                                                           [*operands, mask if mask is not None else unread(), rows, *position_operands],
                                                           relax.TensorType((batch, seq, heads, dim), "float32")))
                self.results[binding.var] = result
                self.set_var_remap(binding.var, self.builder_.emit(relax.op.permute_dims(result, [0, 2, 1, 3])))
            elif binding.var in self.outputs and self.outputs[binding.var] in self.results:
                self.set_var_remap(binding.var, self.results[self.outputs[binding.var]])
            else:
                super().visit_var_binding_(binding)

    return function_pass("AttentionFp32", Rewriter)

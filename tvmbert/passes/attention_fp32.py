"""The ``attention-fp32`` pass: each layer's attention (Q K^T, scale, mask, softmax, P V and the
head transposes around them) found in the graph and replaced by one call of the attention kernel
(``kernels/attention.py``), reading Q, K and V where the projection wrote them."""

from __future__ import annotations

from tvmbert.kernels import int8 as int8_kernels
from tvmbert.kernels.attention import Positions, amx_bf16_fits, amx_bf16_kernel, fits, kernel, vnni_int8_fits, vnni_int8_kernel
from tvmbert.passes import fma_fp32, int8_matmuls
from tvmbert.passes.attention_graph import Attention, find, mask_operand, row_major

# The projections' kernels the attention kernel reads Q, K and V from panel-major, rotating them there
PANEL_MAJOR_KERNELS = (fma_fp32.PANEL_MAJOR, int8_matmuls.PANEL_MAJOR)


def _rotated_in_projection(attention: Attention) -> Attention | None:
    """``attention`` reading Q and K unrotated from the projection's columns, as they are where
    the projection's kernel rotates them as it stores them (ModernBERT's rotary positions): Q and
    K rotated with one pair of tables, V not, all three columns of one value; None otherwise."""
    q, k, v = attention.rotary
    if q is None or k is None or v is not None or not (q.cos.same_as(k.cos) and q.sin.same_as(k.sin)):
        return None
    sources = (q.source, k.source, attention.sources[2])
    if not all(source[0].same_as(sources[0][0]) for source in sources):
        return None
    return attention._replace(sources=sources, head_major=(False, False, False))


def _rotary_panels(attention: Attention, width: int) -> tuple[int, int, int] | None:
    """(first panel, end panel, table rows) of the projection's kernel rotating ``attention``'s Q
    and K (``kernels/fma.kernel``'s ``rotary``): each panel one head, K's right after Q's; or None."""
    _, heads, _, dim = attention.shape
    (_, _, q_offset), (_, _, k_offset), (_, _, v_offset) = attention.sources
    if width != dim or q_offset % width or k_offset != q_offset + heads * dim or q_offset <= v_offset < k_offset + heads * dim:
        return None
    cos_shape = [int(d) for d in attention.rotary[0].cos.ty.shape]
    return q_offset // width, q_offset // width + 2 * heads, cos_shape[0] * cos_shape[2]


def _panel_sources(module, function, flow, found: dict, outputs: dict, lanes: int) -> tuple[dict, dict]:
    """The operands to read panel-major: var -> ``(kernel, shape, Rotary, panels, table operand)``
    (a ``PANEL_MAJOR_KERNELS`` variant; the Rotary and its panels, ``_rotary_panels``, or None)
    for each value an FMA or int8 kernel computes that, once the attentions are rewritten, nothing but
    the kernel reads, and whose every attention reads all three of Q, K and V from such values
    of one width (bert-base's fused Q/K/V projection); and the attentions that read Q and K
    unrotated from such a value, its kernel rotating them (var -> their Attention, with rotary
    the Rotary of their Q: ``_rotated_in_projection``)."""
    from tvm import relax

    bindings, values, _ = flow
    rotated = {var: fused for var, attention in found.items() if (fused := _rotated_in_projection(attention)) is not None}
    found = {**found, **rotated}
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

    rotations = {}  # a projection -> what its kernel rotates (every attention reading it agreeing)
    for var, attention in found.items():
        for source, _, _ in attention.sources:
            rotations.setdefault(source, set()).add((attention.rotary[0].cos, attention.rotary[0].sin) if var in rotated else None)
    candidates = {}
    for source in {source for attention in found.values() for source, _, _ in attention.sources}:
        value = values.get(source)
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", None) == "relax.call_tir") or len(rotations[source]) > 1:
            continue
        callee = module[value.args[0]]
        producer = next((entry for entry in PANEL_MAJOR_KERNELS if callee.attrs and entry.kernel_attr in callee.attrs), None)
        if producer is None:
            continue
        if all(var in found for var in live if source in reads.get(var, ())):
            readers = [attention for var, attention in rotated.items() if attention.sources[0][0].same_as(source)]
            panels = _rotary_panels(readers[0], producer.width(value)) if readers else None
            variant = producer.variant(value, callee, lanes, panels) if panels or not readers else None
            if variant is not None:
                candidates[source] = (*variant, readers[0].rotary[0] if readers else None, panels, producer.tables)
    mixed = True
    while mixed:  # an attention reads its three operands panel-major, of one width, or none so
        mixed = [attention for attention in found.values()
                 if len({candidates[source][1][2] if source in candidates else None for source, _, _ in attention.sources}) > 1]
        for attention in mixed:
            for source, _, _ in attention.sources:
                candidates.pop(source, None)
    return candidates, {var: attention for var, attention in rotated.items() if attention.sources[0][0] in candidates}


def attention_rewrite(lanes: int, amx_bf16: bool = False, bf16_scores: bool = False, int8: bool = False):
    """The module pass: each fp32 ``matmul(softmax(matmul(Q, K^T) [* or / scale] [+ mask]), V)``
    whose Q, K and V are head-major views of row-major [tokens, heads x dim] values (reshapes,
    transposes, the split or slices of a fused projection; in a packed build, their gather into
    the [batch, seq] grid), or such views with rotary positions applied (ModernBERT's Q and K),
    becomes one call of the kernel on those values (on the projection's panel-major variant where
    ``_panel_sources`` says so, which then applies the rotary positions, emitted where the
    first attention reading it is); the transpose of its result back to [batch, seq, heads, dim]
    becomes the kernel's output.
    What else uses the views or the scores keeps them (dead code goes). DeBERTa's position
    scores are gathered by the kernel from their two products (``kernels/attention.Positions``),
    with no [batch x heads, seq, seq] tensor of them. With ``amx_bf16``, the
    kernel's matmuls run on AMX-BF16 where its tiles fit (``kernels/attention.amx_bf16_kernel``),
    its scores from one bf16 product with ``bf16_scores`` (bf16 builds), else three; and where
    only a cast to bf16 reads its result (``casts_to_bf16``), it writes bf16. With ``int8``, on
    ``vpdpbusd`` in int8 where its tiles fit and there are no position scores
    (``kernels/attention.vnni_int8_kernel``)."""
    from tvm import relax

    from tvmbert.ir.dataflow import cast_through_reshapes, dataflow, readers, unread
    from tvmbert.passes.rewriters import function_pass

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module = module
            self.kernels, self.variants = {}, {}
            self.found, self.outputs, self.results, self.panel_sources, self.panels, self.padding_masks = {}, {}, {}, {}, {}, {}
            self.tables = {}  # (cos, sin) -> the [2, P, D] tables a rotating projection kernel reads
            self.values = {}

        def start(self, function):
            flow = dataflow(function)
            self.found, self.outputs = find(flow, lambda seq, dim: fits(seq, dim, lanes))
            self.panel_sources, rotated = _panel_sources(self.module, function, flow, self.found, self.outputs, lanes)
            self.values = flow[1]
            self.found.update(rotated)
            self.results, self.panels, self.padding_masks, self.tables = {}, {}, {}, {}
            self.bf16_results = self.casts_to_bf16(flow)

        @staticmethod
        def on_amx(found: Attention) -> bool:
            """Whether the attention runs on the AMX kernel (its tiles fit the head)."""
            _, _, seq, dim = found.shape
            return amx_bf16 and amx_bf16_fits(seq, dim, lanes)

        @staticmethod
        def in_int8(found: Attention) -> bool:
            """Whether the attention runs on the int8 kernel."""
            _, _, seq, dim = found.shape
            return int8 and not found.positions and vnni_int8_fits(seq, dim, lanes)

        def casts_to_bf16(self, flow) -> dict:
            """The attentions on AMX whose result only a cast to bf16 reads (through reshapes to
            [tokens, heads x dim]: a bf16 build's next projection), P V var -> that cast's var:
            the kernel writes bf16 itself, and no kernel casts its rows."""
            bindings, values, uses = flow
            read_by = readers(bindings)
            casts = {}
            for view, product in self.outputs.items():
                if not self.on_amx(self.found[product]) or uses.get(product) != 1 or uses.get(view) != 1:
                    continue
                if view in read_by and (cast := cast_through_reshapes(read_by[view][0], values, uses, read_by, "bfloat16")) is not None:
                    casts[product] = cast
            return casts

        def kernel_for(self, found: Attention, panel: int, mask, on_amx: bool, positions: Positions | None, out_dtype: str):
            batch, heads, seq, dim = found.shape
            columns = tuple((c, o) for _, c, o in found.sources)
            mask_shape = tuple(int(d) for d in mask.ty.shape) if mask is not None else None
            in_int8 = not on_amx and self.in_int8(found)
            key = (found.shape, columns, mask_shape, found.scale, found.tokens, panel, found.window, positions, out_dtype)
            if key not in self.kernels:
                scores = {"bf16_scores": bf16_scores, "out_dtype": out_dtype} if on_amx else {}
                if in_int8:
                    function = vnni_int8_kernel(batch, heads, seq, dim, lanes, columns, mask_shape, found.scale, found.tokens, panel,
                                                found.window, dot=int8_kernels.DOT_PRODUCTS["vpdpbusd"])
                else:
                    function = (amx_bf16_kernel if on_amx else kernel)(batch, heads, seq, dim, lanes, columns, mask_shape, found.scale,
                                                                         found.tokens, panel, found.window, positions, **scores)
                name = f"attention_{batch}x{heads}x{seq}x{dim}" + ("_masked" if mask_shape else "") \
                    + (f"_window{found.window}" if found.window is not None else "") \
                    + (f"_packed{found.tokens}" if found.tokens is not None else "") + (f"_panels{panel}" if panel else "") \
                    + ("_positions" if positions is not None else "") \
                    + ("_amx" if on_amx else "") + ("_bf16_scores" if on_amx and bf16_scores else "") + ("_int8" if in_int8 else "") \
                    + (f"_to_{out_dtype}" if out_dtype != "float32" else "")
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return self.kernels[key]

        def panel_major(self, source):
            """The panel-major variant of the FMA or int8 kernel call that computes ``source`` (that call
            is dead once the attentions read this, and dce drops it), rotating Q and K where its
            attention's are; emitted where the first attention reads it, after the rotary tables."""
            if source in self.panels:
                return self.panels[source]
            function, shape, rotary, panels, tables = self.panel_sources[source]
            call = self.values[source]
            callee = call.args[0]
            key = (callee, panels)
            if key not in self.variants:
                name = callee.name_hint + "_panels" + ("_rotary" if rotary is not None else "")
                self.variants[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            operands = [self.visit_expr(arg) for arg in call.args[1].fields]
            if rotary is not None:
                operands[tables] = self.rotary_tables(rotary)
            self.panels[source] = self.builder_.emit(relax.call_tir(self.variants[key], operands, relax.TensorType(shape, "float32")))
            return self.panels[source]

        def rotary_tables(self, rotary):
            """The [2, P, D] cos and sin tables of ``rotary`` (made once for every layer that reads them)."""
            key = (rotary.cos, rotary.sin)
            if key not in self.tables:
                shape = [int(d) for d in rotary.cos.ty.shape]
                rows = (1, shape[0] * shape[2], shape[3])
                self.tables[key] = self.builder_.emit(relax.op.concat(
                    [self.builder_.emit(relax.op.reshape(self.visit_expr(table), rows)) for table in key], axis=0))
            return self.tables[key]

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
            if binding.var in self.found:
                found = self.found[binding.var]
                batch, heads, seq, dim = found.shape
                operands = []
                operand_rows = found.tokens if found.tokens is not None else batch * seq
                first = found.sources[0][0]  # all three panel-major, of one width, or none (_panel_sources)
                panel = self.panel_sources[first][1][2] if first in self.panel_sources else 0  # [n / width, m, width][2]
                for (source, columns, _), head_major in zip(found.sources, found.head_major):
                    if panel:
                        operands.append(self.panel_major(source))
                        continue
                    operands.append(row_major(self.builder_, self.visit_expr(source), head_major, operand_rows, columns))
                on_amx = self.on_amx(found)
                mask = mask_operand(self.builder_, found, self.visit_expr, self.padding_masks, positions_read=bool(found.positions))
                rows = self.visit_expr(found.rows) if found.rows is not None else unread("int32")
                positions, position_operands = self.position_operands(found.positions, batch, seq, not on_amx)
                out_dtype = "bfloat16" if binding.var in self.bf16_results else "float32"
                result = self.builder_.emit(relax.call_tir(self.kernel_for(found, panel, mask, on_amx, positions, out_dtype),
                                                           [*operands, mask if mask is not None else unread(), rows, *position_operands],
                                                           relax.TensorType((batch, seq, heads, dim), out_dtype)))
                self.results[binding.var] = result
                self.set_var_remap(binding.var, self.builder_.emit(relax.op.permute_dims(result, [0, 2, 1, 3])))
            elif binding.var in self.outputs and self.outputs[binding.var] in self.results:
                self.set_var_remap(binding.var, self.results[self.outputs[binding.var]])
            elif binding.var in self.bf16_results.values():  # the kernel's result is bf16 already
                self.set_var_remap(binding.var, self.visit_expr(binding.value.args[0]))
            else:
                super().visit_var_binding_(binding)

    return function_pass("AttentionFp32", Rewriter)

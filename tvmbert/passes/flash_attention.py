"""The ``flash-attention`` pass (GPU targets): each layer's attention (Q K^T, scale, mask, softmax,
P V and the head transposes around them) found in the fp32 graph and replaced by one call of the
flash-attention kernel (``kernels/flash_attention.py``), reading Q, K and V where the projection
wrote them and writing its result where the output projection reads it. It runs before
mixed-precision, which leaves the call alone. In fp16 builds the kernel reads Q, K and V in fp16
(the projection's kernel casts them as it stores them) and writes fp16 (the output projection's input)."""

from __future__ import annotations

from tvmbert.kernels.flash_attention import fits, kernel
from tvmbert.passes.attention_graph import Attention, find, mask_operand


def flash_attention(target, dtype: str):
    """The module pass for a TVM GPU ``target``: Q, K and V in shared memory as float16 for
    ``--dtype float16``, else float32. A packed build's attentions (their rows gathered) keep the graph."""
    from tvm import relax

    from tvmbert.ir.dataflow import dataflow
    from tvmbert.passes.rewriters import function_pass

    kernel_dtype = "float16" if dtype == "float16" else "float32"

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = {}
            self.found, self.outputs, self.results, self.narrowed, self.padding_masks = {}, {}, {}, {}, {}

        def start(self, function):
            found, outputs = find(dataflow(function), lambda _seq, dim: fits(dim, kernel_dtype, target))
            # (ModernBERT's rotary Q and K and windowed masks, and DeBERTa's position scores, keep
            # the graph here: the kernel reads a projection's columns and a mask, not a window)
            self.found = {var: attention for var, attention in found.items()
                          if attention.rows is None and attention.window is None and not any(attention.head_major)
                          and attention.bias is None and attention.excluded is None}
            self.outputs = {var: product for var, product in outputs.items() if product in self.found}
            self.results, self.narrowed, self.padding_masks = {}, {}, {}

        def kernel_for(self, found: Attention, mask):
            batch, heads, seq, dim = found.shape
            columns = tuple((c, o) for _, c, o in found.sources)
            mask_shape = tuple(int(d) for d in mask.ty.shape) if mask is not None else None
            key = (found.shape, columns, mask_shape, found.scale)
            if key not in self.kernels:
                function = kernel(batch, heads, seq, dim, columns, mask_shape, found.scale if found.scale is not None else 1.0,
                                  kernel_dtype, target, kernel_dtype)
                name = f"flash_attention_{batch}x{heads}x{seq}x{dim}" + ("_masked" if mask_shape else "")
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return self.kernels[key]

        def in_kernel_dtype(self, source):
            """``source`` cast to the kernel's dtype, once for the Q, K and V it holds."""
            if kernel_dtype == "float32":
                return source
            if source not in self.narrowed:
                self.narrowed[source] = self.builder_.emit(relax.op.astype(source, kernel_dtype))
            return self.narrowed[source]

        def visit_var_binding_(self, binding):
            if binding.var in self.found:
                found = self.found[binding.var]
                batch, heads, seq, dim = found.shape
                operands = []
                for source, columns, _ in found.sources:
                    source = self.in_kernel_dtype(self.visit_expr(source))
                    if [int(d) for d in source.ty.shape] != [batch * seq, columns]:
                        source = self.builder_.emit(relax.op.reshape(source, (batch * seq, columns)))
                    operands.append(source)
                mask = mask_operand(self.builder_, found, self.visit_expr, self.padding_masks)
                kernel_for_mask = self.kernel_for(found, mask)
                if mask is None:
                    mask = self.builder_.emit(relax.op.reshape(relax.const(0.0, "float32"), (1, 1, 1, 1)))
                outputs = self.builder_.emit(relax.call_tir(
                    kernel_for_mask, [*operands, mask],
                    [relax.TensorType((batch, seq, heads, dim), kernel_dtype), relax.TensorType((batch, seq, heads), "float32")]))
                result = self.builder_.emit(relax.TupleGetItem(outputs, 0))
                if kernel_dtype != "float32":  # flat-epilogues drops this cast and mixed-precision's back
                    result = self.builder_.emit(relax.op.astype(result, "float32"))
                self.results[binding.var] = result
                self.set_var_remap(binding.var, self.builder_.emit(relax.op.permute_dims(result, [0, 2, 1, 3])))
            elif binding.var in self.outputs:
                self.set_var_remap(binding.var, self.results[self.outputs[binding.var]])
            else:
                super().visit_var_binding_(binding)

    return function_pass("FlashAttention", Rewriter)

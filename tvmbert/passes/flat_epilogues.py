"""The ``flat-epilogues`` pass (GPU targets): the elementwise work after each weight matmul runs
on the matmul's own [rows, columns] result, so that FuseOps folds it into the matmul's kernel.

The exporter computes a linear layer as ``reshape(add(bias, matmul(x2d, W)), [batch, seq, n])``
and applies GELU, the residual add and layer norm to that 3-D view: the reshape between them is
an injective op FuseOps does not fuse after a matmul, so bias + GELU and bias + residual were
kernels of their own, and so were the casts to fp16 after each layer norm. Here such a view
(a reshape that keeps the last axis) is carried down through elementwise ops and layer norms over
the last axis, which then run on the flat rows, and a flatten of it is the flat value itself:
the remaining reshapes are views, no kernel. And a cast of an fp16 value to fp32 cast back to
fp16 (the flash-attention kernel's result before the output projection) is the value itself.

A layer norm that a matmul reads in fp16 is rounded to fp16 for its every reader, the next
residual add too (as PyTorch's fp16 model holds it): its kernel then writes fp16 alone, where an
fp32 result read twice kept the cast to fp16 a kernel of its own. That leaves 7 kernels a BERT
layer: the Q/K/V matmul, flash attention, the output projection with its bias and residual, layer
norm, the FFN's two matmuls (bias + GELU, bias + residual), layer norm."""

from __future__ import annotations

import math

# Ops that act element by element (their other operands broadcast along the last axis at most).
ELEMENTWISE = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.astype",
                         "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.tanh", "relax.sigmoid", "relax.nn.silu"})


def flat_epilogues():
    from tvm import relax

    from tvmbert.ir.dataflow import static_shape
    from tvmbert.passes.rewriters import function_pass

    def op_of(value):
        return getattr(getattr(value, "op", None), "name", None) if isinstance(value, relax.Call) else None

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.flat = {}  # a view's var -> (its flat [rows, n] value, the view's shape)

        def start(self, function):
            self.flat = {}
            self.narrowed = narrowed_layer_norms(function)

        def flat_operand(self, arg, shape, rows: int):
            """``arg`` (already visited) as an operand of the op on the flat rows, or None."""
            if arg in self.flat and self.flat[arg][1] == shape:
                return self.flat[arg][0]
            arg_shape = static_shape(arg)
            if arg_shape is None:
                return None
            if len(arg_shape) <= 1 and (not arg_shape or arg_shape[0] in (1, shape[-1])):
                return arg  # a scalar or a per-column vector broadcasts alike over the flat rows
            if arg_shape == shape:
                return self.builder_.emit(relax.op.reshape(arg, (rows, shape[-1])))
            return None

        def on_flat_rows(self, value):
            """``value`` computed on the flat rows of the views it reads: (flat value, view shape), or None."""
            op = op_of(value)
            views = [self.flat[arg][1] for arg in value.args if arg in self.flat]
            if not views or not (op in ELEMENTWISE or (op == "relax.nn.layer_norm" and [int(a) for a in value.attrs.axes] in ([-1], [len(views[0]) - 1]))):
                return None
            shape = views[0]
            rows = math.prod(shape[:-1])
            operands = [self.flat_operand(arg, shape, rows) for arg in value.args]
            if any(operand is None for operand in operands):
                return None
            return self.builder_.normalize(relax.Call(value.op, operands, value.attrs, value.ty_args)), shape

        def visit_var_binding_(self, binding):
            if not isinstance(binding.var, relax.DataflowVar):  # a block's output keeps its binding
                super().visit_var_binding_(binding)
                return
            value = self.visit_expr(binding.value)
            op = op_of(value)
            if op == "relax.astype" and (found := self.round_trip(value)) is not None:
                self.set_var_remap(binding.var, found)
            elif op == "relax.reshape" and value.args[0] in self.flat and static_shape(value) == static_shape(self.flat[value.args[0]][0]):
                self.set_var_remap(binding.var, self.flat[value.args[0]][0])  # the flatten of a view: the flat value
            elif op == "relax.reshape" and self.is_view(value):
                var = self.builder_.emit(value)
                self.set_var_remap(binding.var, var)
                self.flat[var] = (value.args[0], static_shape(value))
            elif isinstance(value, relax.Call) and (computed := self.on_flat_rows(value)) is not None:
                flat, shape = computed
                flat = self.rounded(binding.var, self.builder_.emit(flat))
                var = self.builder_.emit(relax.op.reshape(flat, shape))
                self.set_var_remap(binding.var, var)
                self.flat[var] = (flat, shape)
            elif binding.var in self.narrowed:
                self.set_var_remap(binding.var, self.rounded(binding.var, self.builder_.emit(value)))
            else:
                super().visit_var_binding_(binding)

        def rounded(self, original, var):
            """``var``, rounded to the dtype a matmul reads it in where ``original`` is a layer norm
            in ``narrowed``, so that its kernel writes that alone (the cast back fuses into its readers)."""
            if original not in self.narrowed:
                return var
            narrow = self.builder_.emit(relax.op.astype(var, self.narrowed[original]))
            return self.builder_.emit(relax.op.astype(narrow, "float32"))

        @staticmethod
        def is_view(reshape) -> bool:
            """A reshape of [rows, n] that splits the rows and keeps the last axis."""
            shape, source_shape = static_shape(reshape), static_shape(reshape.args[0])
            return bool(shape and source_shape and len(source_shape) == 2 and len(shape) > 2
                        and shape[-1] == source_shape[1] and math.prod(shape[:-1]) == source_shape[0])

        def round_trip(self, value):
            """x for ``astype(astype(x, float32), dtype)`` (through reshapes) where x is of ``dtype``
            and at most 16 bits wide: exact both ways."""
            inner, reshaped = value.args[0], None
            bound = self.lookup_binding(inner) if isinstance(inner, relax.Var) else None
            while op_of(bound) == "relax.reshape":
                reshaped, inner = reshaped or static_shape(value.args[0]), bound.args[0]
                bound = self.lookup_binding(inner) if isinstance(inner, relax.Var) else None
            if op_of(bound) != "relax.astype" or str(bound.attrs.dtype) != "float32":
                return None
            narrow = bound.args[0]
            if narrow.ty.dtype != str(value.attrs.dtype) or narrow.ty.dtype not in ("float16", "bfloat16"):
                return None
            return self.builder_.emit(relax.op.reshape(narrow, reshaped)) if reshaped else narrow

    def narrowed_layer_norms(function) -> dict:
        """The fp32 layer norms cast to fp16 or bf16 (through reshapes) for a matmul: var -> that dtype."""
        from tvmbert.ir.dataflow import dataflow

        bindings, values, _ = dataflow(function)
        found = {}
        for binding in bindings:
            if op_of(binding.value) != "relax.astype" or str(binding.value.attrs.dtype) not in ("float16", "bfloat16"):
                continue
            source = binding.value.args[0]
            while op_of(values.get(source)) == "relax.reshape":
                source = values[source].args[0]
            if op_of(values.get(source)) == "relax.nn.layer_norm" and source.ty.dtype == "float32":
                found[source] = str(binding.value.attrs.dtype)
        return found

    return function_pass("FlatEpilogues", Rewriter)

"""The ``gather-columns`` pass: a matmul whose result is only gathered from along its last axis,
at constant indices, computes only the columns they name."""

from __future__ import annotations


def gathered_columns():
    """DeBERTa's position scores are ``gather_elements(matmul(Q, P^T), index, axis=-1)``: P the
    projections of every relative position the model knows (2 x 256 in v3), the index a constant
    made from the text's length. At 128 tokens the index names 255 of the 512 columns: the matmul
    (15% of deberta-v3-base's time at 1 x 128) computes those alone, from the lowest index to the
    highest, with P^T sliced (a value of the weights alone: bind-params lifts the slice out of the
    call) and the index less the lowest. Where anything else reads the product it stays whole."""
    import numpy as np
    import tvm
    from tvm import relax

    from tvmbert.ir.dataflow import dataflow, is_call, static_shape
    from tvmbert.passes.rewriters import function_pass

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.uses = {}

        def start(self, function):
            self.uses = dataflow(function)[2]

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not (is_call(call, "relax.gather_elements") and isinstance(call.args[1], tvm.ir.expr.Constant)
                    and isinstance(call.args[0], relax.Var) and self.uses.get(call.args[0], 0) == 1):
                return call
            product = self.lookup_binding(call.args[0])
            shape = static_shape(call.args[0])
            if not is_call(product, "relax.matmul") or shape is None or int(call.attrs.axis) % len(shape) != len(shape) - 1:
                return call
            index = call.args[1].value.numpy()
            first, last = int(index.min()), int(index.max())
            if last - first + 1 >= shape[-1]:
                return call
            left, right = product.args
            right_shape = static_shape(right)
            if right_shape is None:
                return call
            columns = relax.op.strided_slice(right, axes=[len(right_shape) - 1], begin=[first], end=[last + 1])
            narrow = self.builder_.emit(relax.op.matmul(left, self.builder_.emit(columns), out_dtype=product.attrs.out_dtype))
            return relax.op.gather_elements(narrow, relax.const(index - np.asarray(first, index.dtype)), axis=call.attrs.axis)

    return function_pass("GatheredColumns", Rewriter)

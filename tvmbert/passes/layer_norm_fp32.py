"""The ``layer-norm-fp32`` pass: fp32 layer norms (with the residual add before them) become calls
of the layer-norm kernel (``kernels/layer_norm.py``)."""

from __future__ import annotations

from tvmbert.kernels.layer_norm import fits, kernel


def layer_norm_rewrite(lanes: int, min_rows: int):
    """The module pass: each fp32 ``layer_norm`` over the last axis of a static shape, with its
    scale and shift, whose size is a multiple of the vector lanes, over as many rows as the FMA
    kernel takes (``min_rows``), becomes one call of the kernel, together with the residual
    add before it where nothing else uses the sum (it runs before ``fma-fp32``, whose kernel
    would otherwise add the residual as it stores, at a higher cost than here, where the row is
    read anyway: CHANGELOG.md, 2026-11-22)."""
    from tvm import relax

    from tvmbert.ir.dataflow import dataflow, row_count, static_shape, unread
    from tvmbert.passes.rewriters import function_pass

    def sizes(call):
        if getattr(call.op, "name", None) != "relax.nn.layer_norm" or call.args[0].ty.dtype != "float32":
            return None
        shape = static_shape(call.args[0])
        if shape is None:
            return None
        axes = [int(a) % len(shape) for a in call.attrs.axes]
        if axes != [len(shape) - 1] or not (call.attrs.center and call.attrs.scale) or not fits(shape[-1], lanes):
            return None
        if row_count(shape[:-1]) < min_rows:  # a few rows: this CPU's tuned kernels are as fast (bert-base 1 x 14)
            return None
        if any(arg.ty.dtype != "float32" or static_shape(arg) != shape[-1:] for arg in call.args[1:]):
            return None
        return tuple(shape[:-1]), shape[-1]

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = {}
            self.residual_sums, self.folded = {}, set()

        def start(self, function):
            """Which layer norms take the residual add before them (``add(x, r)``, both of the
            norm's shape, used by nothing else): the FMA kernel then stores plain rows."""
            bindings, values, uses = dataflow(function)
            self.residual_sums, self.folded = {}, set()
            for binding in bindings:
                if not isinstance(binding.value, relax.Call) or sizes(binding.value) is None:
                    continue
                total = binding.value.args[0]
                add = values.get(total)
                if (isinstance(total, relax.DataflowVar) and getattr(getattr(add, "op", None), "name", None) == "relax.add"
                        and uses.get(total) == 1 and all(arg.ty.dtype == "float32" and static_shape(arg) == static_shape(total)
                                                         for arg in add.args)):
                    self.residual_sums[binding.var] = tuple(add.args)
                    self.folded.add(total)

        def kernel_for(self, lead, n: int, epsilon: float, residual: bool):
            key = (lead, n, epsilon, residual)
            if key not in self.kernels:
                function = kernel(row_count(lead), n, lanes, epsilon, lead, residual)
                name = "layer_norm_" + "x".join(str(d) for d in (*lead, n)) + ("_residual" if residual else "")
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return self.kernels[key]

        def visit_var_binding_(self, binding):
            if binding.var in self.folded:
                return  # the sum is the kernel's
            if binding.var not in self.residual_sums:
                super().visit_var_binding_(binding)
                return
            call = binding.value
            lead, n = sizes(call)
            x, r = (self.visit_expr(arg) for arg in self.residual_sums[binding.var])
            gamma, beta = (self.visit_expr(arg) for arg in call.args[1:])
            result = relax.call_tir(self.kernel_for(lead, n, float(call.attrs.epsilon), True), [x, r, gamma, beta],
                                    relax.TensorType((*lead, n), "float32"))
            self.set_var_remap(binding.var, self.builder_.emit(result))

        def visit_call_(self, call):
            call = super().visit_call_(call)
            found = sizes(call)
            if found is None:
                return call
            lead, n = found
            x, gamma, beta = call.args
            return relax.call_tir(self.kernel_for(lead, n, float(call.attrs.epsilon), False), [x, unread(), gamma, beta],
                                  relax.TensorType((*lead, n), "float32"))

    return function_pass("LayerNormFp32", Rewriter)

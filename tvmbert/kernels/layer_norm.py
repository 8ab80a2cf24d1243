"""fp32 layer norm over the last axis as a hand-written kernel, and the graph rewrite that calls
it. Below the stages: optimize adds the rewrite (pass ``layer-norm-fp32``).

TVM's legalized layer norm is three reductions and a map that MetaSchedule tunes per shape; tuned,
bert-base 8 x 128's took 385 µs a call (25 calls) where reading and writing its 3 MB takes about
250. This kernel takes one row at a time (a parallel loop over rows): the row's sum, then the sum
of squared deviations from its mean (two passes over a row in L1, as PyTorch computes it, rather
than E[x^2] - mean^2), each over several vector accumulators; then the normalized row, scaled and
shifted, is stored."""

from __future__ import annotations

KERNEL_ATTR = "tvmbert.layer_norm_f32"  # PrimFunc attribute marking the kernel (build counts them)


def fits(n: int, lanes: int) -> bool:
    return lanes > 0 and n % lanes == 0


def kernel(rows: int, n: int, lanes: int, epsilon: float, lead: tuple[int, ...] | None = None, residual: bool = False):
    """The PrimFunc ``y[*lead, :] = (x - mean) / sqrt(var + epsilon) * gamma + beta`` per row of
    ``n`` values (``rows`` the product of ``lead``); with ``residual``, of ``x + r`` (the sum is
    stored in y's row as it is read, and the later passes read it there), else r is one unread
    float."""
    import tvm
    from tvm.script import tirx as T

    assert fits(n, lanes), (n, lanes)
    lead = tuple(lead) if lead else (rows,)
    vectors = n // lanes
    residual_shape = (*lead, n) if residual else (1,)
    chains = next(c for c in (4, 2, 1) if vectors % c == 0)  # independent accumulators per pass
    width = chains * lanes

    def total(partial):
        values = [partial[x] for x in range(width)]
        while len(values) > 1:
            values = [a + b for a, b in zip(values[::2], values[1::2])]
        return values[0]

    def summed(xf, yf, row, column):  # the row as the later passes read it: y holds x + r
        return yf[row, column] if residual else xf[row, column]

    def whole(buffer):
        return tvm.tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d) for d in buffer.shape])

    @T.prim_func(s_tir=True)
    def layer_norm(x: T.Buffer((*lead, n), "float32"), r: T.Buffer(residual_shape, "float32"), gamma: T.Buffer((n,), "float32"),
                   beta: T.Buffer((n,), "float32"), y: T.Buffer((*lead, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("layer_norm_rows"):
                T.reads(whole(x), whole(r), whole(gamma), whole(beta))
                T.writes(whole(y))
                xf = T.decl_buffer((rows, n), "float32", data=x.data)
                rf = T.decl_buffer((rows, n) if residual else (1,), "float32", data=r.data)
                yf = T.decl_buffer((rows, n), "float32", data=y.data)
                for row in T.parallel(rows):
                    # in scope "global", under fma.STACK_BYTES: on the stack (a "local" buffer would
                    # be a heap workspace, allocated and freed for every row)
                    partial = T.alloc_buffer((width,), "float32")
                    mean = T.alloc_buffer((1,), "float32")
                    scale = T.alloc_buffer((1,), "float32")
                    for c in T.vectorized(width):
                        partial[c] = T.float32(0)
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            if residual:
                                yf[row, b * width + c] = xf[row, b * width + c] + rf[row, b * width + c]
                                partial[c] = partial[c] + yf[row, b * width + c]
                            else:
                                partial[c] = partial[c] + xf[row, b * width + c]
                    mean[0] = total(partial) / T.float32(n)
                    for c in T.vectorized(width):
                        partial[c] = T.float32(0)
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            partial[c] = partial[c] + (summed(xf, yf, row, b * width + c) - mean[0]) * (summed(xf, yf, row, b * width + c) - mean[0])
                    scale[0] = T.float32(1) / T.sqrt(total(partial) / T.float32(n) + T.float32(epsilon))
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            yf[row, b * width + c] = (summed(xf, yf, row, b * width + c) - mean[0]) * scale[0] * gamma[b * width + c] \
                                + beta[b * width + c]

    assert isinstance(layer_norm, tvm.tirx.PrimFunc)
    return layer_norm


def layer_norm_rewrite(lanes: int):
    """The module pass: each fp32 ``layer_norm`` over the last axis of a static shape, with its
    scale and shift, whose size is a multiple of the vector lanes, over as many rows as the FMA
    kernel takes (``fma.MIN_ROWS``), becomes one call of the kernel, together with the residual
    add before it where nothing else uses the sum (it runs before ``fma-fp32``, whose kernel
    would otherwise add the residual as it stores: +0.4-0.9 ms a call at 1024 rows there, ~0.1 ms
    here, where the row is read anyway)."""
    from tvm import relax

    from tvmbert.kernels.fma import MIN_ROWS
    from tvmbert.passes.kernel_calls import dataflow, function_pass, row_count, static_shape, unread

    def sizes(call):
        if getattr(call.op, "name", None) != "relax.nn.layer_norm" or call.args[0].ty.dtype != "float32":
            return None
        shape = static_shape(call.args[0])
        if shape is None:
            return None
        axes = [int(a) % len(shape) for a in call.attrs.axes]
        if axes != [len(shape) - 1] or not (call.attrs.center and call.attrs.scale) or not fits(shape[-1], lanes):
            return None
        if row_count(shape[:-1]) < MIN_ROWS:  # a few rows: the tuned kernels are as fast (bert-base 1 x 14)
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

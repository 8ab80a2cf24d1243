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


def kernel(rows: int, n: int, lanes: int, epsilon: float, lead: tuple[int, ...] | None = None):
    """The PrimFunc ``y[*lead, :] = (x - mean) / sqrt(var + epsilon) * gamma + beta`` per row of
    ``n`` values (``rows`` the product of ``lead``)."""
    import tvm
    from tvm.script import tirx as T

    assert fits(n, lanes), (n, lanes)
    lead = tuple(lead) if lead else (rows,)
    vectors = n // lanes
    chains = next(c for c in (4, 2, 1) if vectors % c == 0)  # independent accumulators per pass
    width = chains * lanes

    def total(partial):
        values = [partial[x] for x in range(width)]
        while len(values) > 1:
            values = [a + b for a, b in zip(values[::2], values[1::2])]
        return values[0]

    def whole(buffer):
        return tvm.tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d) for d in buffer.shape])

    @T.prim_func(s_tir=True)
    def layer_norm(x: T.Buffer((*lead, n), "float32"), gamma: T.Buffer((n,), "float32"), beta: T.Buffer((n,), "float32"),
                   y: T.Buffer((*lead, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("layer_norm_rows"):
                T.reads(whole(x), whole(gamma), whole(beta))
                T.writes(whole(y))
                xf = T.decl_buffer((rows, n), "float32", data=x.data)
                yf = T.decl_buffer((rows, n), "float32", data=y.data)
                for r in T.parallel(rows):
                    partial = T.alloc_buffer((width,), "float32", scope="local")
                    mean = T.alloc_buffer((1,), "float32", scope="local")
                    scale = T.alloc_buffer((1,), "float32", scope="local")
                    for c in T.vectorized(width):
                        partial[c] = T.float32(0)
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            partial[c] = partial[c] + xf[r, b * width + c]
                    mean[0] = total(partial) / T.float32(n)
                    for c in T.vectorized(width):
                        partial[c] = T.float32(0)
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            partial[c] = partial[c] + (xf[r, b * width + c] - mean[0]) * (xf[r, b * width + c] - mean[0])
                    scale[0] = T.float32(1) / T.sqrt(total(partial) / T.float32(n) + T.float32(epsilon))
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            yf[r, b * width + c] = (xf[r, b * width + c] - mean[0]) * scale[0] * gamma[b * width + c] \
                                + beta[b * width + c]

    assert isinstance(layer_norm, tvm.tirx.PrimFunc)
    return layer_norm


def layer_norm_rewrite(lanes: int):
    """The module pass: each fp32 ``layer_norm`` over the last axis of a static shape, with its
    scale and shift, whose size is a multiple of the vector lanes, over as many rows as the FMA
    kernel takes (``fma.MIN_ROWS``), becomes one call of the kernel."""
    import tvm
    from tvm import relax

    from .fma import MIN_ROWS
    from .kernel_calls import function_pass, row_count

    def sizes(call):
        if getattr(call.op, "name", None) != "relax.nn.layer_norm" or call.args[0].ty.dtype != "float32":
            return None
        shape = getattr(call.args[0].ty, "shape", None)
        if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
            return None
        shape = [int(d) for d in shape]
        axes = [int(a) % len(shape) for a in call.attrs.axes]
        if axes != [len(shape) - 1] or not (call.attrs.center and call.attrs.scale) or not fits(shape[-1], lanes):
            return None
        if row_count(shape[:-1]) < MIN_ROWS:  # a few rows: the tuned kernels are as fast (bert-base 1 x 14)
            return None
        if any(arg.ty.dtype != "float32" or [int(d) for d in arg.ty.shape] != shape[-1:] for arg in call.args[1:]):
            return None
        return tuple(shape[:-1]), shape[-1]

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = {}

        def start(self, function):
            pass

        def visit_call_(self, call):
            call = super().visit_call_(call)
            found = sizes(call)
            if found is None:
                return call
            lead, n = found
            epsilon = float(call.attrs.epsilon)
            key = (lead, n, epsilon)
            if key not in self.kernels:
                function = kernel(row_count(lead), n, lanes, epsilon, lead)
                name = "layer_norm_" + "x".join(str(d) for d in (*lead, n))
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return relax.call_tir(self.kernels[key], list(call.args), relax.TensorType((*lead, n), "float32"))

    return function_pass("LayerNormFp32", Rewriter)

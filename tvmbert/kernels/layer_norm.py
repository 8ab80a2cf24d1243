"""fp32 layer norm over the last axis as a hand-written kernel. The pass ``layer-norm-fp32``
(``passes/layer_norm_fp32.py``) calls it.

TVM's legalized layer norm is three reductions and a map that MetaSchedule tunes per shape; tuned,
it stayed well above the time its bytes take to read and write (CHANGELOG.md, 2026-11-22). This
kernel takes one row at a time (a parallel loop over rows): the row's sum, then the sum of squared
deviations from its mean (two passes over a row in L1, as PyTorch computes it, rather than E[x^2] -
mean^2), each over several vector accumulators; then the normalized row, scaled and shifted, is
stored. Or, for an int8 matmul that alone reads the norm (ModernBERT's pre-norm layers), the
normalized row is quantized as it is stored, as ``int8.quantize_rows_kernel`` quantizes a row
(``kernel(quantized=True)``): no fp32 copy of the rows is written, and no kernel reads it back."""

from __future__ import annotations

from tvmbert.kernels.fma import whole
from tvmbert.kernels.int8 import ROWS_DTYPE, row_quantizer

KERNEL_ATTR = "tvmbert.layer_norm_f32"  # PrimFunc attribute marking the kernel (build counts them)
EPSILON_ATTR = "tvmbert.layer_norm_epsilon"  # on the fp32-writing kernel: what its quantizing variant needs


def fits(n: int, lanes: int) -> bool:
    return lanes > 0 and n % lanes == 0


def kernel(rows: int, n: int, lanes: int, epsilon: float, lead: tuple[int, ...] | None = None, residual: bool = False,
           quantized: bool = False):
    """The PrimFunc ``y[*lead, :] = (x - mean) / sqrt(var + epsilon) * gamma + beta`` per row of
    ``n`` values (``rows`` the product of ``lead``); with ``residual``, of ``x + r`` (the sum is
    stored in y's row as it is read, and the later passes read it there), else r is one unread
    float. ``quantized`` (no residual): the PrimFunc ``(xq[*lead, n], sx[rows]) = quantize(y)``
    of operands ``(x, gamma, beta, xq, sx)``, y quantized as ``int8.quantize_rows_kernel`` does
    (its largest |y| found by a pass that computes y again: a row of y would not fit the stack)."""
    import tvm
    from tvm.script import tirx as T

    assert fits(n, lanes), (n, lanes)
    assert not (quantized and residual)
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

    @T.macro
    def statistics(xf, rf, yf, row, partial, mean, scale):
        """mean[0] and scale[0] (1 / the deviation) of the row, y's row holding x + r with ``residual``."""
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

    @T.prim_func(s_tir=True)
    def layer_norm(x: T.Buffer((*lead, n), "float32"), r: T.Buffer(residual_shape, "float32"), gamma: T.Buffer((n,), "float32"),
                   beta: T.Buffer((n,), "float32"), y: T.Buffer((*lead, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, EPSILON_ATTR: epsilon, "op_pattern": 8})
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
                    statistics(xf, rf, yf, row, partial, mean, scale)
                    for b in range(vectors // chains):
                        for c in T.vectorized(width):
                            yf[row, b * width + c] = (summed(xf, yf, row, b * width + c) - mean[0]) * scale[0] * gamma[b * width + c] \
                                + beta[b * width + c]

    def normalized(operands, row, column):
        xf, gamma, beta, mean, scale = operands
        return (xf[row, column] - mean[0]) * scale[0] * gamma[column] + beta[column]

    quantize_row = row_quantizer(width, vectors // chains)

    @T.prim_func(s_tir=True)
    def layer_norm_to_int8_rows(x: T.Buffer((*lead, n), "float32"), gamma: T.Buffer((n,), "float32"),
                                beta: T.Buffer((n,), "float32"), xq: T.Buffer((*lead, n), ROWS_DTYPE), sx: T.Buffer((rows,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):
            with T.sblock("layer_norm_rows"):
                T.reads(whole(x), whole(gamma), whole(beta))
                T.writes(whole(xq), whole(sx))
                xf = T.decl_buffer((rows, n), "float32", data=x.data)
                qf = T.decl_buffer((rows, n), ROWS_DTYPE, data=xq.data)
                for row in T.parallel(rows):
                    partial = T.alloc_buffer((width,), "float32")
                    mean = T.alloc_buffer((1,), "float32")
                    scale = T.alloc_buffer((1,), "float32")
                    statistics(xf, xf, xf, row, partial, mean, scale)
                    quantize_row(normalized, (xf, gamma, beta, mean, scale), qf, sx, row)

    function = layer_norm_to_int8_rows if quantized else layer_norm
    assert isinstance(function, tvm.tirx.PrimFunc)
    return function

"""fp32 layer norm over the last axis as a hand-written kernel. The pass ``layer-norm-fp32``
(``passes/layer_norm_fp32.py``) calls it.

TVM's legalized layer norm is three reductions and a map that MetaSchedule tunes per shape; tuned,
it stayed well above the time its bytes take to read and write (CHANGELOG.md, 2026-11-22). This
kernel takes one row at a time (a parallel loop over rows): the row's sum, then the sum of squared
deviations from its mean (two passes over a row in L1, as PyTorch computes it, rather than E[x^2] -
mean^2), each over several vector accumulators; then the normalized row, scaled and shifted, is
stored."""

from __future__ import annotations

from tvmbert.kernels.fma import whole

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

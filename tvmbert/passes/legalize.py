"""The ``legalize`` pass's own lowerings: float32 GELU, erf and softmax as vectorizable polynomials."""

from __future__ import annotations


def vectorized_erf() -> dict:
    """LegalizeOps overrides for float32 GELU and erf: erf as a rational polynomial
    (``scalar_math.erf_float32``, TVM's ``fast_erf``: 4.2e-7 max abs error, a few ulp) instead of
    libm's ``erff``, a scalar call LLVM cannot vectorize, which kept the GELU kernel's loop scalar
    (CHANGELOG.md, 2026-11-21). GELU stays the exact, erf form (``--fast-math`` is the tanh one);
    other dtypes keep libm's erf."""
    import tvm
    from tvm import te

    from tvmbert.kernels.scalar_math import erf_float32, gelu_float32

    def float32_only(op_name, function):
        default = tvm.ir.Op.get(op_name).get_attr("FLegalize")
        name = op_name.rsplit(".", 1)[-1]

        def compute(x):
            return te.compute(x.shape, lambda *i: function(x[i]), name="T_" + name)

        def legalize(builder, call):
            if call.args[0].ty.dtype != "float32":
                return default(builder, call)
            return builder.call_te(compute, call.args[0], primfunc_name_hint=name)

        return legalize

    return {"relax.nn.gelu": float32_only("relax.nn.gelu", gelu_float32), "relax.erf": float32_only("relax.erf", erf_float32)}


def vectorized_softmax() -> dict:
    """LegalizeOps override for float32 softmax: TVM's four stages (max, exp, sum, divide) with
    ``scalar_math.exp_float32`` (within 1 ulp, vectorizable) for libm's ``expf``, a scalar call
    that kept the softmax's loop scalar (CHANGELOG.md, 2026-11-22). Other dtypes keep TVM's softmax; ``--fast-math`` has its own."""
    import tvm
    from tvm import te

    from tvmbert.kernels.scalar_math import exp_float32

    default = tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")

    def softmax(x, axis: int):
        axis = axis % len(x.shape)
        reduced = [d for i, d in enumerate(x.shape) if i != axis]

        def outer(index, k):  # the full index from the others and the softmax axis'
            return (*index[:axis], k, *index[axis:])

        k = te.reduce_axis((0, x.shape[axis]), name="k")
        maximum = te.compute(reduced, lambda *i: te.max(x[outer(i, k)], axis=k), name="T_softmax_maxelem")
        exp = te.compute(x.shape, lambda *i: exp_float32(x[i] - maximum[(*i[:axis], *i[axis + 1:])]), name="T_softmax_exp")
        k = te.reduce_axis((0, x.shape[axis]), name="k")
        total = te.compute(reduced, lambda *i: te.sum(exp[outer(i, k)], axis=k), name="T_softmax_expsum")
        return te.compute(x.shape, lambda *i: exp[i] / total[(*i[:axis], *i[axis + 1:])], name="T_softmax_norm")

    def legalize(builder, call):
        if call.args[0].ty.dtype != "float32":
            return default(builder, call)
        return builder.call_te(softmax, call.args[0], int(call.attrs.axis), primfunc_name_hint="softmax")

    return {"relax.nn.softmax": legalize}


def legalizations() -> dict:
    return {**vectorized_erf(), **vectorized_softmax()}

"""The ``mixed-precision`` pass for bfloat16: matmul inputs in bf16, accumulation in fp32."""

from __future__ import annotations

from tvmbert.passes.rewriters import call_rewrite_pass


def reduced_precision_matmuls(dtype: str):
    """Matmul inputs cast to ``dtype``, accumulation kept in float32; the rest stays float32.

    TVM 0.27's ToMixedPrecision produces float16 only; this is the same policy for bfloat16
    (AMX and AVX512-BF16 on this CPU). bind-params then stores the cast weights.
    """
    from tvm import relax

    def cast(builder, call):
        if getattr(call.op, "name", None) == "relax.matmul" and call.args[0].ty.dtype == "float32":
            lhs, rhs = (builder.emit(relax.op.astype(arg, dtype)) for arg in call.args[:2])
            return relax.op.matmul(lhs, rhs, out_dtype="float32")
        return call

    return call_rewrite_pass("ReducedPrecisionMatmuls", cast)

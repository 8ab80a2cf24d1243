"""The ``int8-matmuls`` pass: fp32 matmuls by a weight, with their bias and the activation or
residual add after them, become a row quantization of the input and one call of the int8 kernel
(``kernels/int8.py``) on the weight quantized per output channel."""

from __future__ import annotations

from tvmbert.kernels.int8 import LEVELS, fits, kernel, quantize_rows_kernel, tile


def quantized_weight(weight, width: int):
    """Relax: W[K, N] -> (Wq[N / width, K / 2, width x 2] int8, sw[N]) with ``sw = max|W[:, n]| / 127``
    and ``Wq = round(W / sw)`` (a zero column: scale 0, zeros), laid out as the kernel reads it.
    Ops on the weight alone: bind-params lifts them into the build-time weight transform."""
    from tvm import relax

    op = relax.op
    k, n = (int(d) for d in weight.ty.shape)
    scale = op.divide(op.max(op.abs(weight), axis=[0]), relax.const(float(LEVELS), "float32"))
    divisor = op.where(op.greater(scale, relax.const(0.0, "float32")), scale, relax.const(1.0, "float32"))
    levels = op.clip(op.round(op.divide(weight, divisor)), -LEVELS, LEVELS)
    pairs = op.reshape(op.astype(levels, "int8"), (k // 2, 2, n // width, width))
    return op.reshape(op.permute_dims(pairs, [2, 0, 3, 1]), (n // width, k // 2, width * 2)), scale


def int8_matmuls(lanes: int):
    """The module pass: ``add(matmul(x, W), b)`` in fp32 (either order), W and b weights, N a
    multiple of the lanes, K of the lanes (the row quantization's vectors) and the product used by
    nothing else, becomes a row quantization of x and one call of the kernel, together with the
    activation or the residual add that follows it, if any (``kernel_calls.Epilogues``). At every
    row count: no schedule of TVM's runs int8 faster. Everything else is left as it is."""
    from tvm import relax

    from tvmbert.ir.dataflow import row_count
    from tvmbert.passes.kernel_calls import fp32_weight_matmul_pass, kernel_operands

    def takes(_lead, n, k):
        return fits(n, k, lanes)

    def quantizer(rewriter, lead, k):
        key = ("quantize_rows", *lead, k)
        if key not in rewriter.cache:
            function = quantize_rows_kernel(row_count(lead), k, lanes, lead)
            name = "int8_quantize_rows_" + "x".join(str(d) for d in (*lead, k))
            rewriter.cache[key] = rewriter.builder_.add_func(function.without_attr("global_symbol"), name)
        return rewriter.cache[key]

    def call_kernel(rewriter, x, weight, bias, sizes, activation, residual):
        lead, n, k = sizes
        m = row_count(lead)
        _, vectors = tile(n, lanes)
        emit = rewriter.builder_.emit
        laid_out, weight_scale = (emit(part) for part in quantized_weight(weight, vectors * lanes))
        quantized = emit(relax.call_tir(quantizer(rewriter, lead, k), [x], [relax.TensorType((*lead, k), "int16"),
                                                                            relax.TensorType((m,), "float32")]))
        rows, row_scale = emit(relax.TupleGetItem(quantized, 0)), emit(relax.TupleGetItem(quantized, 1))
        weight_operand, *rest = kernel_operands(laid_out, bias, residual)
        kernel_for = rewriter.kernels.for_sizes(rewriter.builder_, n, k, activation, residual is not None, "float32")
        return relax.call_tir(kernel_for(m, lead), [rows, row_scale, weight_operand, weight_scale, *rest],
                              relax.TensorType((*lead, n), "float32"))

    return fp32_weight_matmul_pass("Int8Matmuls", "int8_matmul_", lambda m, lead, n, k, activation, residual, _:
                                   kernel(m, n, k, lanes, lead, activation, residual), takes, call_kernel)

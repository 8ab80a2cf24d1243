"""Converters of the PyTorch importer where TVM 0.27's do not match what the exporter produces."""

from __future__ import annotations


def dtype_preserving_matmuls() -> dict:
    """TVM 0.27's importer gives every matmul out_dtype="float32", which silently turns a float64
    model into a mixed one that does not even type-check; these keep the inputs' dtype."""
    from tvm import relax

    def matmul(node, importer):
        lhs, rhs = (importer.env[arg] for arg in node.args[:2])
        return importer.block_builder.emit(relax.op.matmul(lhs, rhs))

    def addmm(node, importer):
        bias, lhs, rhs = (importer.env[arg] for arg in node.args[:3])
        alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        emit = importer.block_builder.emit
        dtype = bias.ty.dtype
        product = emit(relax.op.matmul(lhs, rhs))
        if alpha != 1:
            product = emit(relax.op.multiply(product, relax.const(alpha, dtype)))
        if beta != 1:
            bias = emit(relax.op.multiply(bias, relax.const(beta, dtype)))
        return emit(relax.op.add(bias, product)) if beta != 0 else product

    return {"matmul.default": matmul, "mm.default": matmul, "bmm.default": matmul, "addmm.default": addmm}

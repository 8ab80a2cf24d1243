"""Converters of the PyTorch importer where TVM 0.27's do not match what the exporter produces."""

from __future__ import annotations


def dtype_preserving_ops() -> dict:
    """TVM 0.27's importer gives every matmul and convolution out_dtype="float32", which silently
    turns a float64 model into a mixed one that does not even type-check; these keep the inputs'
    dtype for matmuls and 1-D convolutions (DeBERTa-v2's ``conv_kernel_size`` layer is a Conv1d,
    which torch.export's decompositions make ``convolution.default``)."""
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

    def conv1d(x, weight, bias, stride, padding, dilation, groups, importer):
        out = importer.block_builder.emit(relax.op.nn.conv1d(
            x, weight, strides=stride, padding=padding, dilation=dilation, groups=groups, data_layout="NCW",
            kernel_layout="OIW", out_dtype=str(x.ty.dtype)))
        if bias is None:
            return out
        return importer.block_builder.emit(relax.op.add(out, relax.op.reshape(bias, (1, -1, 1))))

    def conv1d_op(node, importer):
        args = importer.retrieve_args(node)
        return conv1d(*args, *(None, None, None, 1, 0, 1, 1)[len(args):], importer)

    def convolution(node, importer):  # what torch.export makes of a Conv1d
        args = importer.retrieve_args(node)
        x, weight, bias, stride, padding, dilation, transposed, _, groups = (
            *args, *(None, None, None, 1, 0, 1, False, 0, 1)[len(args):])
        if transposed or x.ty.ndim != 3:
            return importer._convolution(node)
        return conv1d(x, weight, bias, stride, padding, dilation, groups, importer)

    return {"matmul.default": matmul, "mm.default": matmul, "bmm.default": matmul, "addmm.default": addmm,
            "conv1d.default": conv1d_op, "convolution.default": convolution}

"""The ``unflatten-bmm`` pass: attention's batched matmuls on the 4-D tensors the exporter flattened."""

from __future__ import annotations


def unflatten_batched_matmuls():
    """torch.export writes a matmul of 4-D tensors (attention's Q K^T and P V) as a 3-D batched
    matmul between reshapes: [b, h, m, k] (broadcast to its own shape) -> [b * h, m, k], matmul,
    then back to [b, h, m, n]. Legalized, that last reshape is a kernel of its own whose div/mod
    indexing LLVM cannot vectorize, and it keeps the scale and the mask that follow from fusing
    into the matmul, so they run as a kernel of their own too (CHANGELOG.md, 2026-11-22). The matmul
    runs on the 4-D tensors instead."""
    import tvm
    from tvm import relax

    from tvmbert.ir.dataflow import is_call, static_shape

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def bound(self, expr):
            return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None

        def four_d(self, flat):
            """x where ``flat`` is reshape(x [b, h, m, k]) to [b * h, m, k] (x possibly broadcast
            to its own shape first), else None."""
            reshape = self.bound(flat)
            if not is_call(reshape, "relax.reshape"):
                return None
            source = reshape.args[0]
            broadcast = self.bound(source)
            if is_call(broadcast, "relax.broadcast_to") and static_shape(broadcast.args[0]) == static_shape(source):
                source = broadcast.args[0]
            shape, flat_shape = static_shape(source), static_shape(flat)
            if shape is None or flat_shape is None or len(shape) != 4 or (shape[0] * shape[1], *shape[2:]) != flat_shape:
                return None
            return source

        def visit_call_(self, call):
            call = super().visit_call_(call)
            product = self.bound(call.args[0]) if is_call(call, "relax.reshape") else None
            if not is_call(product, "relax.matmul"):
                return call
            sources = [self.four_d(arg) for arg in product.args]
            if any(source is None for source in sources):
                return call
            (b, h, m, _), (b2, h2, _, n) = (static_shape(source) for source in sources)
            target = [int(d) for d in call.args[1].values] if isinstance(call.args[1], relax.ShapeExpr) else None
            if (b, h) != (b2, h2) or target != [b, h, m, n]:
                return call
            return relax.op.matmul(*sources, out_dtype=product.attrs.out_dtype)

    @tvm.transform.module_pass(opt_level=0, name="UnflattenBatchedMatmuls")
    def transform(module, _context):
        rewriter = Rewriter(module)
        for global_var, function in module.functions_items():
            if isinstance(function, relax.Function):
                rewriter.builder_.update_func(global_var, relax.analysis.remove_all_unused(rewriter.visit_expr(function)))
        return rewriter.builder_.get()

    return transform

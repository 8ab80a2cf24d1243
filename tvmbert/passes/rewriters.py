"""Module passes from a rewrite: of every call, or of every function with weights by a Relax mutator."""

from __future__ import annotations


def function_pass(name: str, rewriter_class):
    """A module pass running ``rewriter_class(module)`` (a Relax mutator with ``start(function)``)
    over every function that has weights (``num_input``)."""
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name=name)
    def transform(module, _context):
        rewriter = rewriter_class(module)
        for global_var, function in module.functions_items():
            if isinstance(function, relax.Function) and function.attrs and "num_input" in function.attrs:
                rewriter.start(function)
                rewritten = rewriter.visit_expr(function)
                rewriter.builder_.update_func(global_var, relax.analysis.remove_all_unused(rewritten))
        return rewriter.builder_.get()

    return transform


def call_rewrite_pass(name: str, rewrite):
    """A module pass applying ``rewrite(builder, call) -> expr`` to every call of every Relax function."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):
            return rewrite(self.builder_, super().visit_call_(call))

    @tvm.transform.module_pass(opt_level=0, name=name)
    def transform(module, _context):
        rewriter = Rewriter(module)
        for global_var, function in module.functions_items():
            if isinstance(function, relax.Function):
                rewriter.builder_.update_func(global_var, rewriter.visit_expr(function))
        return rewriter.builder_.get()

    return transform

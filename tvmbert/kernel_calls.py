"""Graph rewrites that hand matmuls by a weight to a kernel of our own (``amx.py``, ``fma.py``):
which values are weights, the static sizes of such a matmul, and the call itself, with the rows
padded to the kernel's granularity where they have to be. Below the stages: passes use it."""

from __future__ import annotations


def weights_of(function) -> set:
    """The function's weights (parameters after ``num_input``) and every value computed from
    weights alone (transposes, concatenations): bind-params moves those to build time."""
    from tvm import relax

    weights = set(function.params[int(function.attrs["num_input"]):])
    for block in function.body.blocks:
        for binding in block.bindings:
            used = relax.analysis.free_vars(binding.value)
            if used and all(var in weights for var in used):
                weights.add(binding.var)
    return weights


def weight_matmul_sizes(call, weights) -> tuple[tuple[int, ...], int, int] | None:
    """``(lead, n, k)`` of ``matmul(x[*lead, k], W[k, n])`` with W a weight and every size static;
    None for anything else (two activations, batched weights, symbolic shapes)."""
    import tvm

    if getattr(call.op, "name", None) != "relax.matmul" or len(call.args) != 2:
        return None
    lhs, rhs = call.args
    if rhs not in weights:
        return None
    shapes = [getattr(arg.ty, "shape", None) for arg in (lhs, rhs)]
    if any(s is None or not all(isinstance(d, tvm.tirx.IntImm) for d in s) for s in shapes):
        return None
    x_shape, w_shape = ([int(d) for d in s] for s in shapes)
    if len(w_shape) != 2 or len(x_shape) < 2 or x_shape[-1] != w_shape[0]:
        return None
    return tuple(x_shape[:-1]), w_shape[1], w_shape[0]


def row_count(lead) -> int:
    count = 1
    for size in lead:
        count *= size
    return count


def call_with_padded_rows(builder, kernel_for, x, operands, lead, n: int, k: int, row_multiple: int):
    """``kernel_for(m, lead)(x, *operands) -> y[*lead, n]``. Where the rows (the product of
    ``lead``) are a multiple of ``row_multiple``, x and y keep their shapes (the kernels around
    see no reshape); otherwise x is flattened and padded with zero rows and y sliced back."""
    from tvm import relax

    m = row_count(lead)
    if m % row_multiple == 0:
        return relax.call_tir(kernel_for(m, lead), [x, *operands], relax.TensorType((*lead, n), "float32"))
    padded = -(-m // row_multiple) * row_multiple
    emit = builder.emit
    flat = emit(relax.op.nn.pad(emit(relax.op.reshape(x, (m, k))), [0, padded - m, 0, 0]))
    y = emit(relax.call_tir(kernel_for(padded, (padded,)), [flat, *operands], relax.TensorType((padded, n), "float32")))
    y = emit(relax.op.strided_slice(y, axes=[0], begin=[0], end=[m]))
    return relax.op.reshape(y, (*lead, n))


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


def kernels_in(module, attribute: str) -> list[str]:
    """The kernels of ours a module holds (PrimFuncs marked with ``attribute``), by name."""
    from tvm import tirx

    return sorted(gv.name_hint for gv, f in module.functions_items()
                  if isinstance(f, tirx.PrimFunc) and f.attrs and attribute in f.attrs)

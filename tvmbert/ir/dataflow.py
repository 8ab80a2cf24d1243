"""Reading a Relax function's dataflow: its bindings and their uses, static shapes, which values
are weights, and the static sizes of a matmul by a weight."""

from __future__ import annotations


def dataflow(function) -> tuple[list, dict, dict]:
    """``(bindings, values, uses)`` of a Relax function: its bindings in order, each var's
    value, and how many times each var is read (the function's result counts)."""
    from tvm import relax

    bindings = [b for block in function.body.blocks for b in block.bindings]
    uses: dict = {}
    for value in [b.value for b in bindings] + [function.body.body]:
        for var in relax.analysis.free_vars(value):
            uses[var] = uses.get(var, 0) + 1
    return bindings, {b.var: b.value for b in bindings}, uses


def readers(bindings) -> dict:
    """var -> the vars of the bindings that read it, in order (``dataflow``'s ``uses`` counts them)."""
    from tvm import relax

    found: dict = {}
    for binding in bindings:
        for var in relax.analysis.free_vars(binding.value):
            found.setdefault(var, []).append(binding.var)
    return found


def cast_through_reshapes(var, values: dict, uses: dict, read_by: dict, dtype: str):
    """The var of an ``astype(.., dtype)`` that ``var`` is, or reaches through reshapes each read
    by nothing else (a bf16 build's cast of a kernel's rows before the next matmul); else None."""
    while is_call(values.get(var), "relax.reshape") and uses.get(var) == 1 and read_by.get(var):
        var = read_by[var][0]
    value = values.get(var)
    return var if is_call(value, "relax.astype") and value.attrs.dtype == dtype else None


def is_call(expr, op_name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator named ``op_name`` (``relax.matmul``)."""
    from tvm import relax

    return isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == op_name


def static_shape(expr) -> tuple[int, ...] | None:
    """The shape of a tensor-typed expression when every size is a constant, else None."""
    import tvm

    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def unread(dtype: str = "float32"):
    """The one-value constant a kernel's signature takes in place of an operand it does not read
    (no residual, no mask, no row index)."""
    import numpy as np
    from tvm import relax

    return relax.const(np.zeros(1, dtype))


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
    None for anything else (two activations, batched weights, symbolic shapes, and x a weight
    too: DeBERTa's relative-position embeddings through its key projection are build-time work,
    which bind-params folds; a kernel call there would be compiled into that build-time function)."""
    if getattr(call.op, "name", None) != "relax.matmul" or len(call.args) != 2:
        return None
    lhs, rhs = call.args
    if rhs not in weights or lhs in weights:
        return None
    x_shape, w_shape = static_shape(lhs), static_shape(rhs)
    if x_shape is None or w_shape is None:
        return None
    if len(w_shape) != 2 or len(x_shape) < 2 or x_shape[-1] != w_shape[0]:
        return None
    return tuple(x_shape[:-1]), w_shape[1], w_shape[0]


def row_count(lead) -> int:
    count = 1
    for size in lead:
        count *= size
    return count

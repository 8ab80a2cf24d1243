"""Relax autodiff for training: a forward that returns what the backward needs, and that backward.

From a Relax function ``f(inputs, masks, params) -> outputs`` we build the scalar
``sum(outputs * grad_outputs)`` (``relax.transform.Gradient`` differentiates scalars only), take
its adjoint, and cut the adjoint in two. The forward keeps the bindings that do not depend on
the output gradients and additionally returns the *saved* values; the backward gets those and
recomputes the rest. What is saved is the output of every expensive op (matmuls) that the
backward reaches; cheap elementwise work, reshapes and row reductions between them are
recomputed, as rematerializing partitioners do (PyTorch's min-cut partitioner, Chen et al.'s
checkpointing): the bytes held between forward and backward drop, at the price of one extra pass
over elementwise data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OUTPUT_PREFIX = "tvmbert_out"

# Ops whose results the backward recomputes instead of saving. Anything else (matmul, and any op
# we do not know) is saved.
RECOMPUTED_OPS = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "negative", "exp", "erf", "sqrt", "rsqrt", "tanh", "sigmoid",
    "power", "maximum", "minimum", "where", "astype", "reshape", "permute_dims", "broadcast_to", "expand_dims",
    "squeeze", "collapse_sum_to", "sum", "mean", "variance", "max", "nn.softmax", "nn.gelu", "nn.gelu_tanh",
    "nn.relu", "ones", "zeros",
))


@dataclass
class Split:
    """The two halves, and how their parameters line up with the original function's."""

    module: object  # IRModule with Relax functions "forward" and "backward"
    saved: list[str]  # names of the values the forward returns after the outputs, for the backward
    saved_bytes: int  # their total size
    backward_primal: list[int]  # indices of the original parameters the backward takes (first)
    grad_of: list[int]  # the original parameter each gradient the backward returns belongs to


def register_gradients() -> None:
    """Exact GELU has no gradient in Relax; x*Phi(x) gives Phi(x) + x*phi(x)."""
    import tvm
    from tvm import relax
    from tvm.relax import op

    if tvm.ir.Op.get("relax.nn.gelu").get_attr("FPrimalGradient") is not None:
        return

    @relax.op.base.register_gradient("relax.nn.gelu")
    def _gelu_grad(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        dtype = x.ty.dtype

        def const(value):
            return relax.const(value, dtype)

        cdf = op.multiply(const(0.5), op.add(const(1.0), op.erf(op.multiply(x, const(1 / math.sqrt(2))))))
        pdf = op.multiply(const(1 / math.sqrt(2 * math.pi)), op.exp(op.multiply(const(-0.5), op.multiply(x, x))))
        return [op.multiply(output_grad, op.add(cdf, op.multiply(x, pdf)))]


def differentiate(func, wrt: list[int]) -> Split:
    """Forward and backward of ``func`` with gradients for the parameters at indices ``wrt``."""
    import tvm
    from tvm import relax

    register_gradients()
    params = list(func.params)
    outputs = list(func.ret_ty.fields) if isinstance(func.ret_ty, relax.TupleType) else [func.ret_ty]
    grad_outputs = [relax.Var(f"grad_output{i}", ty) for i, ty in enumerate(outputs)]
    target = _scalar_target(func, params, grad_outputs)
    module = relax.transform.DecomposeOpsForTraining()(tvm.IRModule({"target": target}))
    # Gradient copies the parameters it gets: we name them by position in the new function.
    target = module["target"]
    module = relax.transform.Gradient("target", require_grads=[target.params[i] for i in wrt])(module)
    return _split(module["target_adjoint"], len(params), len(outputs), wrt)


def _scalar_target(func, params, grad_outputs):
    """``sum(out_i * grad_out_i)`` over all outputs: its gradient is the vector-Jacobian product."""
    from tvm import relax
    from tvm.relax import op

    builder = relax.BlockBuilder()
    with builder.function("target", params + grad_outputs):
        with builder.dataflow():
            (block,) = func.body.blocks
            for binding in block.bindings:
                builder.emit_normalized(binding)
            result = func.body.body
            total = None
            for i, grad_output in enumerate(grad_outputs):
                output = builder.emit(relax.TupleGetItem(result, i) if isinstance(result.ty, relax.TupleType) else result,
                                      name_hint=f"{OUTPUT_PREFIX}{i}")
                term = builder.emit(op.sum(op.multiply(output, grad_output)))
                total = term if total is None else builder.emit(op.add(total, term))
            total = builder.emit_output(total)
        builder.emit_func_output(total)
    return builder.get()["target"]


def _split(adjoint, n_params: int, n_outputs: int, wrt: list[int]) -> Split:
    import tvm
    from tvm import relax

    params = list(adjoint.params)
    primal, grad_outputs = params[:n_params], params[n_params:]
    (block,) = adjoint.body.blocks
    bindings = _without_ones_multiplies(list(block.bindings))
    bound = {b.var: b for b in bindings}
    uses = {b.var: relax.analysis.free_vars(b.value) for b in bindings}

    backward_side = set(grad_outputs)  # depends on the output gradients
    for b in bindings:
        if any(v in backward_side for v in uses[b.var]):
            backward_side.add(b.var)

    grads = list(adjoint.body.body.fields[1].fields)
    needed_backward, from_forward = set(), set()
    _walk(grads, lambda v: v in bound and v in backward_side, uses, needed_backward, from_forward)
    recomputed, frontier = set(), set()
    _walk([v for v in from_forward if v in bound], lambda v: v in bound and _recomputable(bound[v].value),
          uses, recomputed, frontier)
    saved = sorted((v for v in frontier if v in bound), key=_order(bindings))

    named = {b.var.name: b.var for b in bindings}
    outputs = [named[f"{OUTPUT_PREFIX}{i}"] for i in range(n_outputs)]
    forward_needed = set()
    _walk(outputs + saved, lambda v: v in bound, uses, forward_needed, set())

    builder = relax.BlockBuilder()
    with builder.function("forward", primal):
        with builder.dataflow():
            for b in bindings:
                if b.var in forward_needed:
                    builder.emit_normalized(b)
            result = builder.emit_output(relax.Tuple(outputs + saved))
        builder.emit_func_output(result)

    backward_uses = set()
    for v in needed_backward | recomputed:
        backward_uses.update(uses[v])
    backward_primal = [i for i, p in enumerate(primal) if p in backward_uses]
    saved_params = [relax.Var(f"saved_{v.name}", v.ty) for v in saved]
    with builder.function("backward", [primal[i] for i in backward_primal] + saved_params + grad_outputs):
        with builder.dataflow():
            for v, param in zip(saved, saved_params):
                builder.emit_normalized(relax.VarBinding(v, param))
            for b in bindings:
                if b.var in needed_backward or b.var in recomputed:
                    builder.emit_normalized(b)
            result = builder.emit_output(relax.Tuple(grads))
        builder.emit_func_output(result)

    module = builder.get()
    module = tvm.IRModule({gv: relax.utils.copy_with_new_vars(f) for gv, f in module.functions_items()})
    module = relax.transform.CanonicalizeBindings()(module)
    saved_bytes = sum(_nbytes(v.ty) for v in saved)
    return Split(module, [v.name for v in saved], saved_bytes, backward_primal, list(wrt))


def _walk(roots, descend, uses, inner: set, frontier: set) -> None:
    """From ``roots`` through the bindings ``descend`` accepts (into ``inner``); the first vars it
    refuses go to ``frontier``."""
    seen = set()
    stack = list(reversed(roots))
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if descend(v):
            inner.add(v)
            stack.extend(uses[v])
        else:
            frontier.add(v)


def _order(bindings):
    position = {b.var: i for i, b in enumerate(bindings)}
    return lambda v: position.get(v, -1)


def _recomputable(value) -> bool:
    import tvm
    from tvm import relax

    if isinstance(value, relax.Call):
        return isinstance(value.op, tvm.ir.Op) and value.op.name in RECOMPUTED_OPS
    return isinstance(value, (relax.Var, relax.Tuple, relax.TupleGetItem, tvm.ir.expr.Constant, relax.ShapeExpr))


def _without_ones_multiplies(bindings):
    """The scalar target's adjoint starts as ``broadcast(ones) * grad_output``: use grad_output."""
    import numpy as np
    import tvm
    import tvm_ffi
    from tvm import relax

    ones = set()

    def is_ones(expr) -> bool:
        if isinstance(expr, tvm.ir.expr.Constant):
            return bool(np.all(expr.value.numpy() == 1))
        return isinstance(expr, relax.Var) and expr in ones

    result = []
    for b in bindings:
        value = b.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            name = value.op.name
            if name == "relax.ones" or (name == "relax.broadcast_to" and is_ones(value.args[0])):
                ones.add(b.var)
            elif name == "relax.multiply":
                for one, other in (value.args, reversed(value.args)):
                    if is_ones(one) and tvm_ffi.structural_equal(other.ty, b.var.ty):
                        b = relax.VarBinding(b.var, other)
                        break
        elif isinstance(value, relax.Var) and value in ones:
            ones.add(b.var)
        result.append(b)
    return result


def _nbytes(ty) -> int:
    from tvm import relax

    if isinstance(ty, relax.TupleType):
        return sum(_nbytes(field) for field in ty.fields)
    import tvm

    return math.prod(int(d) for d in ty.shape.values) * tvm.DataType(ty.dtype).bits // 8

"""The ``combine-qkv`` pass: matmuls that share their input (a layer's Q, K and V projections)
become one matmul and a split."""

from __future__ import annotations

from collections import defaultdict

WEIGHT_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.astype")


def combine_parallel_matmuls(min_group: int = 2):
    """Matmuls that share their input and multiply by weights become one matmul and a split.

    In BERT these are the Q, K and V projections: ``x @ Wq + bq``, ``x @ Wk + bk``,
    ``x @ Wv + bv`` become ``split(x @ concat(Wq, Wk, Wv) + concat(bq, bk, bv))``, one larger
    kernel instead of three that each re-read ``x``. TVM's CombineParallelMatmul misses them:
    the exporter writes the bias first (``add(b, x @ W)``) and the weights arrive transposed.
    Run it before bind-params, which then moves the weight concatenation to build time.
    """
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="CombineParallelMatmuls")
    def transform(module, _context):
        updated = {}
        for global_var, function in module.functions_items():
            if isinstance(function, relax.Function) and "num_input" in function.attrs:
                updated[global_var] = _rewrite(function, min_group)
        for global_var, function in updated.items():
            module[global_var] = function
        return module

    return transform


def _rewrite(function, min_group: int):
    from tvm import relax

    num_input = int(function.attrs["num_input"])
    bindings = {b.var: b.value for block in function.body.blocks for b in block.bindings}
    weights = set(function.params[num_input:])
    for var, value in bindings.items():  # transposed or reshaped weights are weights too
        if isinstance(value, relax.Call) and getattr(value.op, "name", None) in WEIGHT_LAYOUT_OPS and value.args[0] in weights:
            weights.add(var)
    uses = defaultdict(list)
    for var, value in bindings.items():
        for used in relax.analysis.free_vars(value):
            uses[used].append(var)
    for result in _outputs(function.body.body):
        uses[result].append(None)

    def is_call(value, name):
        return isinstance(value, relax.Call) and getattr(value.op, "name", None) == name

    def projection(var, value):
        """(input, weight, bias, output var) of ``input @ weight (+ bias)``, or None."""
        if not is_call(value, "relax.matmul") or value.args[1] not in weights:
            return None
        weight = value.args[1]
        if len(weight.ty.shape) != 2:
            return None
        output, bias = var, None
        users = uses[var]
        if len(users) == 1 and users[0] is not None and is_call(bindings[users[0]], "relax.add"):
            add = bindings[users[0]]
            other = add.args[0] if add.args[1].same_as(var) else add.args[1]
            if other in weights and len(other.ty.shape) == 1:
                output, bias = users[0], other
        return value.args[0], weight, bias, output

    groups = defaultdict(list)
    for var, value in bindings.items():
        found = projection(var, value)
        if found is not None:
            groups[found[0]].append((var, *found[1:]))
    plans = {}
    for source, members in groups.items():
        # One kind per group: all with a bias or none, one dtype, one reduction size.
        for with_bias in (True, False):
            chosen = [m for m in members if (m[2] is not None) == with_bias]
            if len(chosen) >= min_group and len({(str(m[1].ty.dtype), int(m[1].ty.shape[0])) for m in chosen}) == 1:
                plans[chosen[0][0]] = (source, chosen)
    if not plans:
        return function
    derived = {var: bindings[var] for var in weights if var in bindings}
    return _combiner_class()(plans, derived).visit_expr(function)


def _outputs(expr):
    from tvm import relax

    if isinstance(expr, relax.Tuple):
        return [field for item in expr.fields for field in _outputs(item)]
    return [expr] if isinstance(expr, relax.Var) else []


def _combiner_class():
    from tvm import relax

    @relax.expr_functor.mutator
    class Combiner(relax.PyExprMutator):
        def __init__(self, plans, derived):
            super().__init__()
            self.plans = plans  # first matmul var of a group -> (input, members)
            # Transposed weights are bound later than the first matmul of a group: the combined
            # matmul re-computes them from the parameters (bind-params then folds them away).
            self.derived = derived
            self.dropped = {var for _, members in plans.values() for m in members for var in (m[0], m[3])}

        def visit_var_binding_(self, binding):
            plan = self.plans.get(binding.var)
            if plan is not None:
                self._emit_combined(*plan)
            elif binding.var not in self.dropped:
                super().visit_var_binding_(binding)

        def _emit_combined(self, source, members):
            emit = self.builder_.emit

            def weight_here(var):
                return emit(self.derived[var]) if var in self.derived else var

            widths = [int(m[1].ty.shape[1]) for m in members]
            weight = emit(relax.op.concat([weight_here(m[1]) for m in members], axis=1))
            combined = emit(relax.op.matmul(self.visit_expr(source), weight))
            if members[0][2] is not None:
                combined = emit(relax.op.add(combined, emit(relax.op.concat([weight_here(m[2]) for m in members], axis=0))))
            offsets = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
            parts = emit(relax.op.split(combined, offsets, axis=-1))
            for index, member in enumerate(members):
                self.set_var_remap(member[3], emit(relax.TupleGetItem(parts, index)))

    return Combiner

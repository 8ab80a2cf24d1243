"""The graph passes the optimize stage can run (PASSES: adding a pass is one entry there), and
our own passes and importer conversions, where TVM 0.27's do not match what the PyTorch exporter
produces. Below the stages: training lowers its modules with the same passes, and config checks
pass names against the same table."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from tvmbert.core.errors import InputError

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


def unflatten_batched_matmuls():
    """torch.export writes a matmul of 4-D tensors (attention's Q K^T and P V) as a 3-D batched
    matmul between reshapes: [b, h, m, k] (broadcast to its own shape) -> [b * h, m, k], matmul,
    then back to [b, h, m, n]. Legalized, that last reshape is a kernel of its own whose div/mod
    indexing LLVM cannot vectorize, and it keeps the scale and the mask that follow from fusing
    into the matmul: bert-base 8 x 128 spent 2.5 ms x 12 layers on a scale and an add. The matmul
    runs on the 4-D tensors instead."""
    import tvm
    from tvm import relax

    def static_shape(expr):
        shape = getattr(getattr(expr, "ty", None), "shape", None)
        if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
            return None
        return [int(d) for d in shape]

    def is_op(expr, name):
        return isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == name

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def bound(self, expr):
            return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None

        def four_d(self, flat):
            """x where ``flat`` is reshape(x [b, h, m, k]) to [b * h, m, k] (x possibly broadcast
            to its own shape first), else None."""
            reshape = self.bound(flat)
            if not is_op(reshape, "relax.reshape"):
                return None
            source = reshape.args[0]
            broadcast = self.bound(source)
            if is_op(broadcast, "relax.broadcast_to") and static_shape(broadcast.args[0]) == static_shape(source):
                source = broadcast.args[0]
            shape, flat_shape = static_shape(source), static_shape(flat)
            if shape is None or flat_shape is None or len(shape) != 4 or [shape[0] * shape[1], *shape[2:]] != flat_shape:
                return None
            return source

        def visit_call_(self, call):
            call = super().visit_call_(call)
            product = self.bound(call.args[0]) if is_op(call, "relax.reshape") else None
            if not is_op(product, "relax.matmul"):
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

    return _call_rewrite_pass("ReducedPrecisionMatmuls", cast)


def uses_amx(config) -> bool:
    """--dtype bfloat16 for a CPU target with AMX-BF16 (Job refuses bfloat16 for CPUs without)."""
    return config.dtype == "bfloat16" and _target_has_amx(config.target)


@lru_cache(maxsize=8)
def _target_has_amx(target_text: str) -> bool:
    from tvmbert.core import targets
    from tvmbert.kernels import amx

    return amx.target_has_amx(targets.resolve(target_text))


def amx_bf16_matmuls():
    from tvmbert.kernels.amx import amx_matmuls

    return amx_matmuls()


def uses_fma_kernel(config) -> bool:
    """--dtype float32 for a CPU target with AVX-512 or AVX2 and FMA."""
    return config.dtype == "float32" and _fma_lanes(config.target) > 0


def uses_fp32_kernels(config) -> bool:
    """Our attention and layer-norm kernels (fp32 arithmetic): with the FMA kernel, and for
    --dtype bfloat16 on AMX, where only the weight matmuls run in bf16."""
    return uses_fma_kernel(config) or (uses_amx(config) and _fma_lanes(config.target) > 0)


@lru_cache(maxsize=8)
def _fma_lanes(target_text: str) -> int:
    from tvmbert.core import targets
    from tvmbert.kernels import fma

    target = targets.resolve(target_text)
    return fma.lanes_of(target.tvm_target()) if target.kind == "llvm" else 0


def fma_fp32_matmuls(target_text: str):
    from tvmbert.kernels.fma import fma_matmuls

    return fma_matmuls(_fma_lanes(target_text))


def attention_fp32(target_text: str):
    from tvmbert.kernels.attention import attention_rewrite

    return attention_rewrite(_fma_lanes(target_text))


def layer_norm_fp32(target_text: str):
    from tvmbert.kernels.layer_norm import layer_norm_rewrite

    return layer_norm_rewrite(_fma_lanes(target_text))


def fast_math():
    """Opt-in approximations: GELU as its tanh form, and TVM's fast exp/erf/tanh/softmax.

    The seed post found its converter silently turning GELU into FastGELU; here exact GELU (erf)
    is the default and this pass is the one way to give it up, with verify reporting the error.
    """
    from tvm import relax

    def tanh_gelu(_builder, call):
        return relax.op.nn.gelu_tanh(call.args[0]) if getattr(call.op, "name", None) == "relax.nn.gelu" else call

    return [_call_rewrite_pass("TanhGelu", tanh_gelu), relax.transform.FastMathTransform()]


def _call_rewrite_pass(name: str, rewrite):
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


def vectorized_erf() -> dict:
    """LegalizeOps overrides for float32 GELU and erf: erf as a rational polynomial
    (``scalar_math.erf_float32``, TVM's ``fast_erf``: 4.2e-7 max abs error, a few ulp) instead of
    libm's ``erff``, a scalar call LLVM cannot vectorize: bert-base's 14 x 3072 GELU kernel took
    245 µs x 12 layers with it. GELU stays the exact, erf form (``--fast-math`` is the tanh one);
    other dtypes keep libm's erf."""
    import tvm
    from tvm import te

    from tvmbert.kernels.scalar_math import erf_float32, gelu_float32

    def float32_only(op_name, function):
        default = tvm.ir.Op.get(op_name).get_attr("FLegalize")
        name = op_name.rsplit(".", 1)[-1]

        def compute(x):
            return te.compute(x.shape, lambda *i: function(x[i]), name="T_" + name)

        def legalize(builder, call):
            if call.args[0].ty.dtype != "float32":
                return default(builder, call)
            return builder.call_te(compute, call.args[0], primfunc_name_hint=name)

        return legalize

    return {"relax.nn.gelu": float32_only("relax.nn.gelu", gelu_float32), "relax.erf": float32_only("relax.erf", erf_float32)}


def vectorized_softmax() -> dict:
    """LegalizeOps override for float32 softmax: TVM's four stages (max, exp, sum, divide) with
    ``scalar_math.exp_float32`` (within 1 ulp, vectorizable) for libm's ``expf``: bert-base
    1 x 128's softmax took ~600 µs x 12 layers with the scalar call. Other dtypes keep TVM's softmax; ``--fast-math`` has its own."""
    import tvm
    from tvm import te

    from tvmbert.kernels.scalar_math import exp_float32

    default = tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")

    def softmax(x, axis: int):
        axis = axis % len(x.shape)
        reduced = [d for i, d in enumerate(x.shape) if i != axis]

        def outer(index, k):  # the full index from the others and the softmax axis'
            return (*index[:axis], k, *index[axis:])

        k = te.reduce_axis((0, x.shape[axis]), name="k")
        maximum = te.compute(reduced, lambda *i: te.max(x[outer(i, k)], axis=k), name="T_softmax_maxelem")
        exp = te.compute(x.shape, lambda *i: exp_float32(x[i] - maximum[(*i[:axis], *i[axis + 1:])]), name="T_softmax_exp")
        k = te.reduce_axis((0, x.shape[axis]), name="k")
        total = te.compute(reduced, lambda *i: te.sum(exp[outer(i, k)], axis=k), name="T_softmax_expsum")
        return te.compute(x.shape, lambda *i: exp[i] / total[(*i[:axis], *i[axis + 1:])], name="T_softmax_norm")

    def legalize(builder, call):
        if call.args[0].ty.dtype != "float32":
            return default(builder, call)
        return builder.call_te(softmax, call.args[0], int(call.attrs.axis), primfunc_name_hint="softmax")

    return {"relax.nn.softmax": legalize}


def legalizations() -> dict:
    return {**vectorized_erf(), **vectorized_softmax()}


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


@dataclass(frozen=True)
class GraphPass:
    name: str
    make: Callable[[object, str, str], list]  # (relax.transform, the job's dtype, its target) -> the TVM passes it runs, in order
    added_by: Callable[[object], bool] | None = None  # opt-in: not in the default pipeline; added where this holds for the JobConfig
    per_target: bool = False  # what it makes depends on the target beyond whether it is added


# In their canonical order: an opt-in pass is added before the first listed pass that follows it here.
PASSES = (
    GraphPass("fold-constants", lambda t, dtype, target: [t.FoldConstant()]),
    GraphPass("cse", lambda t, dtype, target: [t.EliminateCommonSubexpr()]),
    # Q, K and V projections (same input) become one matmul + split; biases too.
    GraphPass("combine-qkv", lambda t, dtype, target: [combine_parallel_matmuls()]),
    # Attention's two matmuls on 4-D tensors, where the exporter flattened them to 3-D between
    # reshapes: the scale and the mask then fuse into the Q K^T kernel.
    GraphPass("unflatten-bmm", lambda t, dtype, target: [unflatten_batched_matmuls()]),
    # Added for --dtype float16/bfloat16: matmuls in reduced precision accumulating in fp32;
    # bind-params then stores those weights in it (half the bytes to stream per inference).
    GraphPass("mixed-precision", lambda t, dtype, target: [t.ToMixedPrecision(out_dtype="float32") if dtype == "float16"
                                                   else reduced_precision_matmuls(dtype)],
              added_by=lambda config: config.mixed_precision),
    # Added for --dtype bfloat16 on CPUs with AMX-BF16: weight matmuls call our AMX kernel
    # (tvmbert/amx.py), their weights packed in its tile layout by bind-params.
    GraphPass("amx-bf16", lambda t, dtype, target: [amx_bf16_matmuls()], added_by=lambda config: uses_amx(config)),
    # Added with fma-fp32 and with amx-bf16 (whose graph keeps layer norm in fp32): layer norms
    # over a multiple of the vector lanes call our kernel (tvmbert/layer_norm.py: a row at a
    # time, two passes in L1), with the residual add before them: before fma-fp32, which would
    # otherwise fold that add into its matmul (amx-bf16, earlier, keeps the adds it folded).
    GraphPass("layer-norm-fp32", lambda t, dtype, target: [layer_norm_fp32(target)], added_by=lambda config: uses_fp32_kernels(config),
              per_target=True),
    # Added for --dtype float32 on CPUs with AVX-512 or AVX2: weight matmuls (with their bias)
    # with enough rows to be compute-bound call our FMA micro-kernel (tvmbert/fma.py), their
    # weights packed in its panels by bind-params.
    GraphPass("fma-fp32", lambda t, dtype, target: [fma_fp32_matmuls(target)], added_by=lambda config: uses_fma_kernel(config),
              per_target=True),
    # Added with fma-fp32 and with amx-bf16 (whose graph keeps attention in fp32): each layer's
    # attention (Q K^T, scale, mask, softmax, P V and the head transposes around them) becomes
    # one call of our kernel (tvmbert/attention.py).
    GraphPass("attention-fp32", lambda t, dtype, target: [attention_fp32(target)], added_by=lambda config: uses_fp32_kernels(config),
              per_target=True),
    # Weight-only computations (transposed weights, the position-embedding slice) move into
    # main_transform_params, which the build runs once: folded like bound constants, while
    # the weights stay in a separate file instead of inside the library.
    GraphPass("bind-params", lambda t, dtype, target: [t.LiftTransformParams()]),
    GraphPass("dce", lambda t, dtype, target: [t.DeadCodeElimination()]),
    # Off by default (--fast-math): GELU as tanh, fast exp/erf/tanh/softmax.
    GraphPass("fast-math", lambda t, dtype, target: fast_math(), added_by=lambda config: config.fast_math),
    GraphPass("legalize", lambda t, dtype, target: [t.LegalizeOps(legalizations()), t.AnnotateTIROpPattern(), t.FoldConstant()]),
    GraphPass("fuse", lambda t, dtype, target: [t.FuseOps(), t.FuseTIR()]),
)
PASS_NAMES = tuple(p.name for p in PASSES)
DEFAULT_PASSES = tuple(p.name for p in PASSES if p.added_by is None)


def check_pass_names(names, where: str = "options") -> None:
    unknown = [name for name in names if name not in PASS_NAMES]
    if unknown:
        raise InputError(f"{where}: unknown pass {', '.join(repr(n) for n in unknown)} (known: {', '.join(PASS_NAMES)})")


def pass_list(names, dtype: str = "float32", target: str | None = None) -> list:
    """The TVM passes behind ``names``, in order: optimize's pipeline, and training's lowering."""
    from tvm import relax

    table = {p.name: p for p in PASSES}
    return [tvm_pass for name in names for tvm_pass in table[name].make(relax.transform, dtype, target)]


def per_target(names) -> bool:
    """Whether the pipeline's result depends on the target beyond which passes it names."""
    return any(p.per_target for p in PASSES if p.name in names)

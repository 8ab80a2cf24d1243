"""What the passes that hand work to a kernel of ours (``amx_bf16``, ``fma_fp32``, ``int8_matmuls``,
``attention_fp32``, ``layer_norm_fp32``) share: the call itself, with the rows padded to the
kernel's granularity where they have to be, the epilogues that fold into it (a gated
activation's weight reordered for it), one function per kernel shape, and the kernels a module holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvmbert.ir.dataflow import dataflow, row_count, unread


def call_with_padded_rows(builder, kernel_for, x, operands, lead, n: int, k: int, row_multiple: int,
                          out_dtype: str = "float32"):
    """``kernel_for(m, lead)(x, *operands) -> y[*lead, n]``. Where the rows (the product of
    ``lead``) are a multiple of ``row_multiple``, x and y keep their shapes (the kernels around
    see no reshape); otherwise x is flattened and padded with zero rows and y sliced back."""
    from tvm import relax

    m = row_count(lead)
    if m % row_multiple == 0:
        return relax.call_tir(kernel_for(m, lead), [x, *operands], relax.TensorType((*lead, n), out_dtype))
    padded = -(-m // row_multiple) * row_multiple
    emit = builder.emit
    flat = emit(relax.op.nn.pad(emit(relax.op.reshape(x, (m, k))), [0, padded - m, 0, 0]))
    y = emit(relax.call_tir(kernel_for(padded, (padded,)), [flat, *operands], relax.TensorType((padded, n), out_dtype)))
    y = emit(relax.op.strided_slice(y, axes=[0], begin=[0], end=[m]))
    return relax.op.reshape(y, (*lead, n))


def gates_beside_inputs(weight, activated_half: int, chunk: int):
    """Relax: a GLU's W[K, N] (or its bias b[N]) with the activated half's columns first and
    the columns reordered so that every ``2 * chunk`` hold ``chunk`` activated columns, then
    their ``chunk`` gates: what a gated kernel's panels or blocks take (``kernels/fma.kernel``,
    ``kernels/amx.py``). A function of the weight alone, which bind-params lifts into the
    build-time weight transform."""
    from tvm import relax

    shape = [int(d) for d in weight.ty.shape]
    n = shape[-1]
    halves = relax.op.reshape(weight, (*shape[:-1], 2, n // 2 // chunk, chunk))
    if activated_half:
        halves = relax.op.flip(halves, axis=len(shape) - 1)
    axes = list(range(len(shape) + 2))
    axes[len(shape) - 1], axes[len(shape)] = axes[len(shape)], axes[len(shape) - 1]
    return relax.op.reshape(relax.op.permute_dims(halves, axes), shape)


def gated_operands(builder, weight, bias, gate: int, chunk: int):
    """A gated kernel's weight and bias, their columns in ``gates_beside_inputs``' order
    (``gate``: which half is activated), emitted on ``builder``."""
    return builder.emit(gates_beside_inputs(weight, gate, chunk)), builder.emit(gates_beside_inputs(bias, gate, chunk))


def kernels_in(module, attribute: str) -> list[str]:
    """The kernels of ours a module holds (PrimFuncs marked with ``attribute``), by name."""
    from tvm import tirx

    return sorted(gv.name_hint for gv, f in module.functions_items()
                  if isinstance(f, tirx.PrimFunc) and f.attrs and attribute in f.attrs)


def _dims(var) -> list[int]:
    return [int(d) for d in var.ty.shape]


def _op_of(value):
    """The Relax operator a bound value calls (``relax.add``), or None for anything else."""
    return getattr(getattr(value, "op", None), "name", None)


class Epilogues:
    """What folds into a kernel of ours as it stores its result: ``add(matmul(x, W), b)`` (either
    order, b a weight of N values, the product used by nothing else), or a bare ``matmul(x, W)``
    with a zero bias (ModernBERT's layers have no biases), and, after it, an activation
    of ``activations`` on a reshaped view of the sum, used by nothing else (the FFN's GELU: the
    exporter applies it on [batch, tokens, 4 x hidden] after a [rows, 4 x hidden] matmul). A
    reshape of the activation back to the product's shape is then the kernel's result itself.

    Or, instead of an activation, the residual add after it (``add(reshape(sum), residual)``,
    the attention output's and the FFN's: kernels of their own otherwise, each a pass over the rows), where
    ``takes_residual(sizes)`` (the kernel adds it as it stores, and the rows need no padding).

    Or, where ``takes_gate(sizes)``, a gated activation: ``act(one half) * the other half`` of
    the sum (a view of it) split in two along its columns, act one of ``activations``
    (ModernBERT's GeGLU), the kernel then writing that product alone, half the sum's columns
    (``gates`` says which half is activated).

    And a cast of the (activated) sum to one of ``output_dtypes``, its only use, makes the kernel
    write that dtype (bf16 for the next matmul: no cast kernel over the FFN's activations).

    ``fits(call)`` says which matmuls the kernel takes (their sizes, or None); the rewriter calls
    ``visit_binding`` first for every binding and emits nothing more where it returns True."""

    def __init__(self, function, weights: set, fits, activations, takes_residual, output_dtypes=(), takes_gate=None):
        from tvm import relax

        bindings, values, uses = dataflow(function)
        self.values, self.uses = values, uses

        self.sums = {}  # the var the kernel's call replaces (the bias add's, or a bare matmul's) -> (matmul, bias or None, sizes)
        self.products = set()  # the matmuls' vars: dead once their add is the kernel's call
        self.activation = {}  # the add's var -> the activation's op
        self.activated = {}  # var -> the add's var whose kernel result it is (reshaped)
        self.residual = {}  # the add's var -> the residual added to it
        self.out_dtype = {}  # the add's var -> the dtype its kernel writes, where not float32
        self.skipped = set()  # views of a sum only its residual add (or its gated activation) used: nothing to emit
        self.gates = {}  # the add's var -> which half of its columns is activated (0 or 1), the other half gating it
        for binding in bindings:
            if not isinstance(binding.var, relax.DataflowVar) or _op_of(binding.value) != "relax.add":
                continue  # a block's output keeps its binding
            for product, bias in (binding.value.args, binding.value.args[::-1]):
                sizes = fits(values.get(product)) if isinstance(values.get(product), relax.Call) else None
                if (sizes and uses.get(product) == 1 and bias in weights and bias.ty.dtype == "float32"
                        and [int(d) for d in bias.ty.shape] == [sizes[1]]):
                    self.sums[binding.var] = (values[product], bias, sizes)
                    self.products.add(product)
                    break
        for binding in bindings:
            if (isinstance(binding.var, relax.DataflowVar) and _op_of(binding.value) == "relax.matmul"
                    and binding.var not in self.products and (sizes := fits(binding.value))):
                self.sums[binding.var] = (binding.value, None, sizes)
        for binding in bindings:
            if not isinstance(binding.var, relax.DataflowVar) or _op_of(binding.value) != "relax.add":
                continue
            for view, residual in (binding.value.args, binding.value.args[::-1]):
                reshape = values.get(view)
                if (_op_of(reshape) == "relax.reshape" and uses.get(view) == 1 and reshape.args[0] in self.sums
                        and uses.get(reshape.args[0]) == 1 and reshape.args[0] not in self.residual
                        and takes_residual(self.sums[reshape.args[0]][2]) and residual not in weights
                        and list(residual.ty.shape) == list(binding.var.ty.shape) and residual.ty.dtype == "float32"):
                    self.residual[reshape.args[0]] = residual
                    self.activated[binding.var] = reshape.args[0]
                    self.skipped.add(view)
                    break
        for binding in bindings:
            view = binding.value.args[0] if _op_of(binding.value) in activations else None
            reshape = values.get(view)
            if (isinstance(binding.var, relax.DataflowVar) and _op_of(reshape) == "relax.reshape" and uses.get(view) == 1
                    and reshape.args[0] in self.sums and uses.get(reshape.args[0]) == 1
                    and reshape.args[0] not in self.residual):
                self.activation[reshape.args[0]] = _op_of(binding.value)
                self.activated[binding.var] = reshape.args[0]
        for binding in bindings:
            if (takes_gate and isinstance(binding.var, relax.DataflowVar) and _op_of(binding.value) == "relax.multiply"
                    and (gate := self.gated(binding.value, activations, takes_gate)) is not None):
                total, activation, activated_half, views = gate
                self.activation[total], self.gates[total] = activation, activated_half
                self.activated[binding.var] = total
                self.skipped.update(views)
        for binding in bindings:
            source = binding.value.args[0] if _op_of(binding.value) == "relax.reshape" else None
            if (source in self.activated and uses.get(source) == 1
                    and _dims(binding.var) == self.result_dims(self.activated[source])):
                self.activated[binding.var] = self.activated[source]
        for binding in bindings:
            source = binding.value.args[0] if _op_of(binding.value) == "relax.astype" else None
            if source is None or str(binding.value.attrs.dtype) not in output_dtypes or uses.get(source) != 1:
                continue
            total = source if source in self.sums else self.activated.get(source)
            if total is None or total in self.residual or not isinstance(binding.var, relax.DataflowVar):
                continue
            self.out_dtype[total] = str(binding.value.attrs.dtype)
            if source is not total:
                self.skipped.add(source)
            self.activated[binding.var] = total

    def result_dims(self, total) -> list[int]:
        """The shape of what the kernel replacing ``total`` writes: half its columns where it gates."""
        dims = _dims(total)
        return [*dims[:-1], dims[-1] // 2] if total in self.gates else dims

    def gated(self, product, activations, takes_gate):
        """(the sum, the activation, its half, the views between them) where ``product`` is
        ``act(half a) * half 1 - a`` of a sum split in two equal halves along its columns, every
        value between read once (by the next); None for anything else."""
        from tvm import relax

        from tvmbert.ir.dataflow import static_shape

        values, uses = self.values, self.uses
        for activated, gate in (product.args, product.args[::-1]):
            applied = values.get(activated)
            if _op_of(applied) not in activations or uses.get(activated) != 1:
                continue
            item = applied.args[0]
            first, second = values.get(item), values.get(gate)
            if not (isinstance(first, relax.TupleGetItem) and isinstance(second, relax.TupleGetItem)
                    and first.tuple_value.same_as(second.tuple_value) and {int(first.index), int(second.index)} == {0, 1}
                    and uses.get(item) == 1 and uses.get(gate) == 1 and uses.get(first.tuple_value) == 2):
                continue
            split = values.get(first.tuple_value)
            shape = static_shape(split.args[0]) if _op_of(split) == "relax.split" else None
            if not shape or int(split.attrs.axis) % len(shape) != len(shape) - 1:
                continue
            sections = split.attrs.indices_or_sections  # a count, or the indices it splits at
            if hasattr(sections, "__len__"):
                halves = [int(s) for s in sections] == [shape[-1] // 2] and shape[-1] % 2 == 0
            else:
                halves = int(sections) == 2
            view = split.args[0]
            total = values[view].args[0] if _op_of(values.get(view)) == "relax.reshape" and uses.get(view) == 1 else view
            if (not halves or total not in self.sums or uses.get(total) != 1 or total in self.residual
                    or total in self.activation or static_shape(total)[-1] != shape[-1] or not takes_gate(self.sums[total][2])):
                continue
            views = {first.tuple_value, item, gate, activated} | ({view} if view is not total else set())
            return total, _op_of(applied), int(first.index), views
        return None

    def visit_binding(self, mutator, binding, call_kernel) -> bool:
        """``call_kernel(x, weight, bias, sizes, activation, residual, out_dtype, gate) -> call``
        for an add this folds (residual: the residual as [*lead, n], or None; gate: the activated
        half of a gated activation's columns, or None)."""
        import numpy as np
        from tvm import relax

        if binding.var in self.products or binding.var in self.skipped:
            return True
        if binding.var in self.activated:  # the activation ran in the kernel: at most a reshape is left
            result = mutator.visit_expr(self.activated[binding.var])
            if _dims(binding.var) != self.result_dims(self.activated[binding.var]):
                result = mutator.builder_.emit(relax.op.reshape(result, binding.var.ty.shape))
            mutator.set_var_remap(binding.var, result)
            return True
        if binding.var not in self.sums:
            return False
        matmul, bias, sizes = self.sums[binding.var]
        x, weight = (mutator.visit_expr(arg) for arg in matmul.args)
        residual = self.residual.get(binding.var)
        if residual is not None:
            residual = mutator.builder_.emit(relax.op.reshape(mutator.visit_expr(residual), (*sizes[0], sizes[1])))
        bias = mutator.visit_expr(bias) if bias is not None else relax.const(np.zeros(sizes[1], "float32"))
        call = call_kernel(x, weight, bias, sizes, self.activation.get(binding.var), residual,
                           self.out_dtype.get(binding.var, "float32"), self.gates.get(binding.var))
        mutator.set_var_remap(binding.var, mutator.builder_.emit(call))
        return True


class KernelFunctions:
    """The PrimFuncs a rewrite adds to the module: one per shape and epilogue, made by
    ``make(m, lead, n, k, activation, residual, out_dtype, gated)`` once and named after what it
    does (``<prefix><lead>x<n>x<k>[_gelu][_gated][_residual][_to_bfloat16]``)."""

    def __init__(self, prefix: str, make):
        self.prefix, self.make, self.added = prefix, make, {}

    def for_sizes(self, builder, n: int, k: int, activation: str | None, residual: bool, out_dtype: str, gated: bool = False):
        """``kernel_for(m, lead)`` as ``call_with_padded_rows`` takes it."""
        def kernel_for(m, lead):
            key = (*lead, n, k, activation, residual, out_dtype, gated)
            if key not in self.added:
                name = self.prefix + "x".join(str(d) for d in (*lead, n, k)) \
                    + (f"_{activation.rsplit('.', 1)[-1]}" if activation else "") + ("_gated" if gated else "") \
                    + ("_residual" if residual else "") + (f"_to_{out_dtype}" if out_dtype != "float32" else "")
                function = self.make(m, lead, n, k, activation, residual, out_dtype, gated)
                self.added[key] = builder.add_func(function.without_attr("global_symbol"), name)
            return self.added[key]
        return kernel_for


def kernel_operands(weight, bias, residual) -> list:
    """What the kernels take after x: the weight in the kernel's layout, the bias and the
    residual, or in its place the one unread float their signature keeps for it."""
    return [weight, bias, residual if residual is not None else unread()]


def fp32_weight_matmul_pass(name: str, prefix: str, make_kernel, takes, call_kernel, takes_gate=None):
    """The module pass of a kernel that takes fp32 ``add(matmul(x, W), b)`` with the activation or
    residual add after it (``Epilogues``; ``fma-fp32``, ``int8-matmuls``; with ``takes_gate``, a
    gated activation where it says so): the matmuls whose ``(lead, n, k)`` ``takes``, each replaced by
    ``call_kernel(rewriter, x, weight, bias, sizes, activation, residual, gate)``, which emits on
    ``rewriter.builder_`` and finds the kernel's functions in ``rewriter.kernels``
    (``KernelFunctions(prefix, make_kernel)``) and a dict of its own in ``rewriter.cache``.
    Everything else is left as it is."""
    from tvm import relax

    from tvmbert.ir.dataflow import weight_matmul_sizes, weights_of
    from tvmbert.kernels.fma import ACTIVATIONS
    from tvmbert.passes.rewriters import function_pass

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = KernelFunctions(prefix, make_kernel)
            self.cache = {}
            self.weights = set()
            self.epilogues = None

        def start(self, function):
            self.weights = weights_of(function)
            self.epilogues = Epilogues(function, self.weights, self.fits, ACTIVATIONS, takes_residual=lambda sizes: True,
                                       takes_gate=takes_gate)

        def fits(self, call):
            sizes = weight_matmul_sizes(call, self.weights)
            if sizes is None or any(arg.ty.dtype != "float32" for arg in call.args):
                return None
            return sizes if takes(*sizes) else None

        def call(self, x, weight, bias, sizes, activation, residual, out_dtype, gate):
            assert out_dtype == "float32"  # no output_dtypes given to Epilogues
            return call_kernel(self, x, weight, bias, sizes, activation, residual, gate)

        def visit_var_binding_(self, binding):
            if not self.epilogues.visit_binding(self, binding, self.call):
                super().visit_var_binding_(binding)

    return function_pass(name, Rewriter)


@dataclass(frozen=True)
class PanelMajor:
    """A weight-matmul kernel whose calls have a panel-major variant (``fma_fp32``, ``int8_matmuls``):
    its calls marked by ``kernel_attr``; ``width(call)``, their panels' width; ``variant(call,
    function, lanes, rotary)``, ``(kernel, shape [n / width, m, width])`` or None (as
    ``fma_fp32.panel_major_variant``); ``tables``, the index among the call's operands of the one a
    rotating variant reads its rotary tables from (r, unread by the call itself). The attention
    pass reads Q, K and V from such variants (``attention_fp32._panel_sources``)."""

    kernel_attr: str
    width: Callable
    variant: Callable
    tables: int

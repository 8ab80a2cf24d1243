"""The ``int8-matmuls`` pass: fp32 matmuls by a weight, with their bias and the activation or
residual add after them, become a row quantization of the input and one call of the int8 kernel
(``kernels/int8.py``, or on AMX-INT8 ``kernels/amx.int8_kernel``) on the weight quantized per
output channel; a layer norm that only a row quantization reads then quantizes its rows itself
(``quantizing_norms``)."""

from __future__ import annotations

from tvmbert.kernels import amx
from tvmbert.kernels.fma import ACTIVATION_ATTR, GATED_ATTR
from tvmbert.kernels.int8 import (
    DEPTH,
    DOT_PRODUCTS,
    INSTRUCTION_ATTR,
    KERNEL_ATTR,
    LANES_ATTR,
    LEVELS,
    ROW_OFFSET,
    ROWS_DTYPE,
    DotProduct,
    fits,
    kernel,
    quantize_rows_kernel,
    tile,
)
from tvmbert.passes.kernel_calls import PanelMajor


def panel_major_variant(call, function, lanes: int, rotary: tuple[int, int, int] | None = None):
    """As ``fma_fp32.panel_major_variant``, for a call of the vector int8 kernel (not AMX's):
    ``(kernel, shape)``, the same kernel writing its result panel-major (rotating where
    ``rotary`` says), or None where it cannot. ``lanes``: the fp32 lanes of the attention kernel
    that reads it, which its panels' width was chosen by only where they agree."""
    import numpy as np

    from tvmbert.ir.dataflow import static_shape

    if amx.KERNEL_ATTR in function.attrs or int(function.attrs[LANES_ATTR]) != lanes:
        return None
    x, _, laid_out, _, _, _, r = (static_shape(arg) for arg in call.args[1].fields)
    if r != (1,) or bool(function.attrs[GATED_ATTR]):
        return None
    lead, k, n = x[:-1], x[-1], static_shape(call)[-1]
    m, width = int(np.prod(lead)), laid_out[2] // DEPTH
    activation = str(function.attrs[ACTIVATION_ATTR]) or None
    if rotary is not None and (activation or (width // lanes) % 2):
        return None
    dot = DOT_PRODUCTS[str(function.attrs[INSTRUCTION_ATTR])]
    return kernel(m, n, k, lanes, lead, activation, dot=dot, panel_major=True, rotary=rotary), (n // width, m, width)


def _panel_width(call) -> int:
    from tvmbert.ir.dataflow import static_shape

    return static_shape(call.args[1].fields[2])[2] // DEPTH  # the weight's panels, [n / width, k / DEPTH, width x DEPTH]


PANEL_MAJOR = PanelMajor(KERNEL_ATTR, _panel_width, panel_major_variant, tables=6)


def quantized_weight(weight, width: int, dot: DotProduct):
    """Relax: W[K, N] -> (Wq[N / width, K / DEPTH, width x DEPTH] int8, sw[N], c0[N] int32) with
    ``sw = max|W[:, n]| / LEVELS``, and where ``dot`` bounds pairs of weights, at least
    ``max_j |W[2j, n] + W[2j + 1, n]| / dot.pair_levels``; ``Wq = round(W / sw)`` (a zero column:
    scale 0, zeros) laid out as the kernel reads it, and the accumulators' start ``c0 =
    -ROW_OFFSET x sum_k Wq[k, n]``. Ops on the weight alone: bind-params lifts them into the
    build-time weight transform."""
    from tvm import relax

    op = relax.op
    k, n = (int(d) for d in weight.ty.shape)
    scale = op.divide(op.max(op.abs(weight), axis=[0]), relax.const(float(LEVELS), "float32"))
    if dot.pair_levels:
        pair_sums = op.sum(op.reshape(weight, (k // 2, 2, n)), axis=[1])
        scale = op.maximum(scale, op.divide(op.max(op.abs(pair_sums), axis=[0]), relax.const(dot.pair_levels, "float32")))
    divisor = op.where(op.greater(scale, relax.const(0.0, "float32")), scale, relax.const(1.0, "float32"))
    quantized = op.astype(op.clip(op.round(op.divide(weight, divisor)), -LEVELS, LEVELS), "int8")
    steps = op.reshape(quantized, (k // DEPTH, DEPTH, n // width, width))
    laid_out = op.reshape(op.permute_dims(steps, [2, 0, 3, 1]), (n // width, k // DEPTH, width * DEPTH))
    start = op.multiply(op.sum(op.astype(quantized, "int32"), axis=[0]), relax.const(-ROW_OFFSET, "int32"))
    return laid_out, scale, start


def int8_matmuls(lanes: int, instruction: str, amx_tiles: bool = False):
    """The module pass: ``add(matmul(x, W), b)`` in fp32 (either order), W and b weights, N a
    multiple of the lanes, K of the lanes (the row quantization's vectors) and the product used by
    nothing else, becomes a row quantization of x and one call of the kernel, together with the
    activation or the residual add that follows it, if any (``kernel_calls.Epilogues``). At every
    row count: no schedule of TVM's runs int8 faster. Everything else is left as it is.
    ``instruction``: the target's dot product (``DOT_PRODUCTS``); ``amx_tiles``: the matmuls AMX's
    tiles fit (``amx.int8_fits``) run on AMX-INT8 (its rows quantized as for ``instruction``,
    ``vpdpbusd`` on every such CPU, into whole row tiles)."""
    from tvm import relax

    from tvmbert.ir.dataflow import row_count
    from tvmbert.passes.kernel_calls import fp32_weight_matmul_pass, gated_operands, kernel_operands

    dot = DOT_PRODUCTS[instruction]
    assert not amx_tiles or dot.instruction == "vpdpbusd", dot.instruction  # AMX's rows are VNNI's (TargetSpec.has_amx_int8)

    def on_amx(n, k):
        return amx_tiles and amx.int8_fits(n, k)

    def takes(_lead, n, k):
        return fits(n, k, lanes)

    def make_kernel(m, lead, n, k, activation, residual, _out_dtype, gated):
        if on_amx(n, k):
            return amx.int8_kernel(m, n, k, lead, activation, residual, gated=gated)
        return kernel(m, n, k, lanes, lead, activation, residual, dot=dot, gated=gated)

    def quantizer(rewriter, lead, k, rows):
        key = ("quantize_rows", *lead, k, rows)
        if key not in rewriter.cache:
            function = quantize_rows_kernel(row_count(lead), k, lanes, lead, rows)
            name = "int8_quantize_rows_" + "x".join(str(d) for d in (*lead, k)) + (f"_to_{rows}_rows" if rows else "")
            rewriter.cache[key] = rewriter.builder_.add_func(function.without_attr("global_symbol"), name)
        return rewriter.cache[key]

    def call_kernel(rewriter, x, weight, bias, sizes, activation, residual, gate):
        lead, n, k = sizes
        m = row_count(lead)
        rows = amx.padded_rows(m) if on_amx(n, k) else None
        width = amx.TILE if rows else tile(n, lanes, gate is not None)[1] * lanes
        emit = rewriter.builder_.emit
        if gate is not None:  # each panel's columns, half of them activated, then their gates
            weight, bias = gated_operands(rewriter.builder_, weight, bias, gate, width // 2)
        laid_out, weight_scale, start = (emit(operand) for operand in quantized_weight(weight, width, dot))
        rows_type = relax.TensorType((rows, k) if rows else (*lead, k), ROWS_DTYPE)
        quantized = emit(relax.call_tir(quantizer(rewriter, lead, k, rows), [x], [rows_type, relax.TensorType((m,), "float32")]))
        quantized_rows, row_scale = emit(relax.TupleGetItem(quantized, 0)), emit(relax.TupleGetItem(quantized, 1))
        weight_operand, *rest = kernel_operands(laid_out, bias, residual)
        kernel_for = rewriter.kernels.for_sizes(rewriter.builder_, n, k, activation, residual is not None, "float32", gate is not None)
        return relax.call_tir(kernel_for(m, lead), [quantized_rows, row_scale, weight_operand, start, weight_scale, *rest],
                              relax.TensorType((*lead, n // 2 if gate is not None else n), "float32"))

    # A gated activation (GeGLU) in whichever kernel takes the matmul: AMX's, or the vector one where
    # its panels split in two (an even number of vectors).
    return fp32_weight_matmul_pass("Int8Matmuls", "int8_matmul_", make_kernel, takes, call_kernel,
                                   takes_gate=lambda sizes: on_amx(*sizes[1:]) or tile(sizes[1], lanes, True) is not None)


def quantizing_norms(lanes: int):
    """The module pass: a row quantization (``quantize_rows_kernel``'s, into as many rows) of a
    layer norm kernel's result (``kernels/layer_norm.py``, without the residual add) that nothing
    else reads becomes one call of the norm kernel that quantizes as it stores
    (``layer_norm.kernel(quantized=True)``): ModernBERT's pre-norm layers, whose norms feed one
    projection each, write no fp32 rows for the quantization to read back. A norm whose result
    the residual path reads too (BERT's post-norm layers) keeps both calls."""
    from tvm import relax

    from tvmbert.ir.dataflow import dataflow, is_call, row_count, static_shape
    from tvmbert.kernels import layer_norm
    from tvmbert.kernels.int8 import QUANTIZE_ATTR
    from tvmbert.passes.rewriters import function_pass

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.module, self.kernels, self.fused = module, {}, {}

        def callee_attrs(self, value):
            if not (isinstance(value, relax.Call) and getattr(value.op, "name", None) == "relax.call_tir"):
                return {}
            return self.module[value.args[0]].attrs or {}

        def start(self, function):
            """Which quantizations take their norm in (var -> the norm's call): the norm's result
            read by the quantization alone, directly or through a reshape (to [rows, n])."""
            _, values, uses = dataflow(function)
            self.fused = {}
            for var, value in values.items():
                if QUANTIZE_ATTR not in self.callee_attrs(value):
                    continue
                rows = value.args[1].fields[0]
                if is_call(values.get(rows), "relax.reshape") and uses.get(rows) == 1:
                    rows = values[rows].args[0]
                norm = values.get(rows)
                if (layer_norm.EPSILON_ATTR in self.callee_attrs(norm) and uses.get(rows) == 1
                        and static_shape(norm.args[1].fields[1]) == (1,)  # no residual
                        and row_count(list(var.ty.fields[0].shape)[:-1]) == row_count(static_shape(rows)[:-1])):  # no padding rows (AMX's)
                    self.fused[var] = norm

        def kernel_for(self, norm):
            epsilon = float(self.module[norm.args[0]].attrs[layer_norm.EPSILON_ATTR])
            shape = static_shape(norm.args[1].fields[0])
            key = (shape, epsilon)
            if key not in self.kernels:
                lead, n = shape[:-1], shape[-1]
                function = layer_norm.kernel(row_count(lead), n, lanes, epsilon, lead, quantized=True)
                name = "layer_norm_" + "x".join(str(d) for d in shape) + "_to_int8_rows"
                self.kernels[key] = self.builder_.add_func(function.without_attr("global_symbol"), name)
            return self.kernels[key]

        def visit_var_binding_(self, binding):
            if binding.var not in self.fused:
                super().visit_var_binding_(binding)
                return
            norm = self.fused[binding.var]
            x, _, gamma, beta = (self.visit_expr(arg) for arg in norm.args[1].fields)
            rows_type, scales_type = binding.var.ty.fields
            normed = self.builder_.emit(relax.call_tir(self.kernel_for(norm), [x, gamma, beta],
                                                       [relax.TensorType(x.ty.shape, rows_type.dtype), scales_type]))
            rows = self.builder_.emit(relax.op.reshape(self.builder_.emit(relax.TupleGetItem(normed, 0)), rows_type.shape))
            self.set_var_remap(binding.var, self.builder_.emit(relax.Tuple([rows, self.builder_.emit(relax.TupleGetItem(normed, 1))])))

    return function_pass("QuantizingNorms", Rewriter)

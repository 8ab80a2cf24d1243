"""The ``fma-fp32`` pass: fp32 matmuls by a weight, with their bias and the activation or
residual add after them, become calls of the FMA micro-kernel (``kernels/fma.py``) on the weight
in panels."""

from __future__ import annotations

from tvmbert.kernels.fma import ACTIVATION_ATTR, GATED_ATTR, KERNEL_ATTR, kernel, tile
from tvmbert.passes.kernel_calls import PanelMajor


def panel_major_variant(call, function, lanes: int, rotary: tuple[int, int, int] | None = None):
    """``(kernel, shape)``: the kernel ``function`` (one of ``kernel``'s) that the Relax
    ``call_tir`` ``call`` runs, made to write its result panel-major, and that result's shape
    ``[n / width, m, width]``; None for one with a residual or a gated activation, or with an activation or panels of
    an odd number of vectors where it is to rotate (``rotary``, ``kernels/fma.kernel``'s). Writing
    a tile's rows into one panel is cheaper than into rows ``n`` floats apart (CHANGELOG.md,
    2026-11-22), and where the panel width is the head size (6 x 4 tiles, bert-base), each panel
    is one head's Q, K or V, which the attention kernel then reads whole."""
    import numpy as np

    from tvmbert.ir.dataflow import static_shape

    x, wp, _, r = (static_shape(arg) for arg in call.args[1].fields)
    if r != (1,) or bool(function.attrs[GATED_ATTR]):
        return None
    lead, k, n = x[:-1], x[-1], static_shape(call)[-1]
    m, width = int(np.prod(lead)), wp[2]
    activation = str(function.attrs[ACTIVATION_ATTR]) or None
    if rotary is not None and (activation or (width // lanes) % 2):
        return None
    return kernel(m, n, k, lanes, lead, activation, panel_major=True, rotary=rotary), (n // width, m, width)


def _panel_width(call) -> int:
    from tvmbert.ir.dataflow import static_shape

    return static_shape(call.args[1].fields[1])[2]  # the weight's panels, [n / width, k, width]


PANEL_MAJOR = PanelMajor(KERNEL_ATTR, _panel_width, panel_major_variant, tables=3)


def weight_in_panels(weight, width: int):
    """Relax: W[K, N] -> Wp[N / width, K, width] (a reshape and a transpose of a weight alone,
    which bind-params lifts into the build-time weight transform)."""
    from tvm import relax

    k, n = (int(d) for d in weight.ty.shape)
    return relax.op.permute_dims(relax.op.reshape(weight, (k, n // width, width)), [1, 0, 2])


def fma_matmuls(lanes: int, min_rows: int):
    """The module pass: ``add(matmul(x, W), b)`` in fp32 (either order), W and b weights, at least
    ``min_rows`` rows, N a multiple of the lanes and the product used by nothing else, becomes one
    call of the kernel on W in panels, together with the activation, the gated activation or the
    residual add that follows it, if any (``kernel_calls.Epilogues``). Everything else is left as it is."""
    from tvm import relax

    from tvmbert.ir.dataflow import row_count
    from tvmbert.passes.kernel_calls import fp32_weight_matmul_pass, gated_operands, kernel_operands

    def takes(lead, n, _k):
        return row_count(lead) >= min_rows and tile(n, lanes) is not None

    def call_kernel(rewriter, x, weight, bias, sizes, activation, residual, gate):
        lead, n, k = sizes
        gated = gate is not None
        _, vectors = tile(n, lanes, gated)
        if gated:
            weight, bias = gated_operands(rewriter.builder_, weight, bias, gate, vectors * lanes // 2)
        laid_out = rewriter.builder_.emit(weight_in_panels(weight, vectors * lanes))
        kernel_for = rewriter.kernels.for_sizes(rewriter.builder_, n, k, activation, residual is not None, "float32", gated)
        return relax.call_tir(kernel_for(row_count(lead), lead), [x, *kernel_operands(laid_out, bias, residual)],
                              relax.TensorType((*lead, n // 2 if gated else n), "float32"))

    return fp32_weight_matmul_pass("FmaFp32Matmuls", "fma_matmul_", lambda m, lead, n, k, activation, residual, _, gated:
                                   kernel(m, n, k, lanes, lead, activation, residual, gated=gated), takes, call_kernel,
                                   takes_gate=lambda sizes: tile(sizes[1], lanes, True) is not None)

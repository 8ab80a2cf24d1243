"""The ``amx-bf16`` pass: bf16 matmuls by a weight become calls of the AMX kernel
(``kernels/amx.py``), the activation rows padded to its tile and the weight in its VNNI layout."""

from __future__ import annotations

from tvmbert.kernels.amx import ACTIVATIONS, TILE, bf16_fits, bf16_kernel


def weight_in_vnni_layout(weight):
    """Relax: W[K, N] -> Wp[N/16, K/2, 16, 2] (a reshape and a transpose on a weight alone, which
    bind-params lifts into the build-time weight transform)."""
    from tvm import relax

    k, n = (int(d) for d in weight.ty.shape)
    pairs = relax.op.reshape(weight, (k // 2, 2, n // 16, 16))
    return relax.op.permute_dims(pairs, [2, 0, 3, 1])


def amx_matmuls():
    """The module pass: ``matmul(x_bf16, W_bf16, out_dtype=float32)`` with W a weight (a parameter
    after ``num_input``, or a transpose/cast of one) becomes a call of the AMX kernel on x (padded
    to a multiple of 32 rows where it is not) and W in that layout, with the bias added after it and the
    activation after that where there are ones (``kernel_calls.Epilogues``), else a zero bias.
    Matmuls the kernel does not fit (N or K not a multiple of 32, dynamic shapes) are left as they
    are; matmuls of two activations go back to fp32."""
    import numpy as np
    from tvm import relax

    from tvmbert.ir.dataflow import row_count, weight_matmul_sizes, weights_of
    from tvmbert.passes.kernel_calls import Epilogues, KernelFunctions, call_with_padded_rows, gated_operands, kernel_operands
    from tvmbert.passes.rewriters import function_pass

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = KernelFunctions("amx_bf16_matmul_", lambda m, lead, n, k, activation, residual, out_dtype, gated:
                                           bf16_kernel(m, n, k, lead, activation, residual, out_dtype, gated=gated))
            self.weights = set()
            self.epilogues = None

        def start(self, function):
            self.weights = weights_of(function)
            self.epilogues = Epilogues(function, self.weights, self.fits, ACTIVATIONS,
                                       takes_residual=lambda sizes: row_count(sizes[0]) % TILE == 0,
                                       output_dtypes=("bfloat16",), takes_gate=lambda sizes: True)

        def fits(self, call):
            sizes = weight_matmul_sizes(call, self.weights)
            if (sizes is None or str(call.attrs.out_dtype) != "float32" or any(arg.ty.dtype != "bfloat16" for arg in call.args)
                    or not bf16_fits(row_count(sizes[0]), *sizes[1:])):
                return None
            return sizes

        def call_kernel(self, x, weight, bias, sizes, activation, residual, out_dtype, gate=None):
            lead, n, k = sizes
            if gate is not None:  # each block of 32 columns: 16 activated, then their gates
                weight, bias = gated_operands(self.builder_, weight, bias, gate, TILE // 2)
            laid_out = self.builder_.emit(weight_in_vnni_layout(weight))
            kernel_for = self.kernels.for_sizes(self.builder_, n, k, activation, residual is not None, out_dtype, gate is not None)
            return call_with_padded_rows(self.builder_, kernel_for, x, kernel_operands(laid_out, bias, residual), lead,
                                         n // 2 if gate is not None else n, k, TILE, out_dtype)

        def in_float32(self, call):
            """A matmul of two activations (attention's) the kernel does not take: back to fp32
            (TVM's bf16 loop nests convert every element in the inner loop, slower than fp32)."""
            sources = []
            for arg in call.args:
                bound = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
                if not (isinstance(bound, relax.Call) and getattr(bound.op, "name", None) == "relax.astype"
                        and bound.args[0].ty.dtype == "float32"):
                    return call
                sources.append(bound.args[0])
            return relax.op.matmul(*sources, out_dtype="float32")

        def visit_var_binding_(self, binding):
            if not self.epilogues.visit_binding(self, binding, self.call_kernel):
                super().visit_var_binding_(binding)

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if getattr(call.op, "name", None) != "relax.matmul" or len(call.args) != 2:
                return call
            if call.args[1] not in self.weights:
                return self.in_float32(call)
            sizes = self.fits(call)
            if sizes is None:
                return call
            zero_bias = relax.const(np.zeros(sizes[1], "float32"))
            return self.call_kernel(*call.args, zero_bias, sizes, None, None, "float32")

    return function_pass("AmxBf16Matmuls", Rewriter)

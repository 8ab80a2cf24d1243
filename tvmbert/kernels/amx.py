"""bf16 matmuls on Intel AMX (AMX-BF16): the kernel, the graph rewrite that calls it, and the
process permission the kernel needs. Below the stages: optimize adds the rewrite (pass
``amx-bf16``), build and the runtime ask for the permission.

MetaSchedule's x86 tensor intrinsics cover int8 only, and bf16 kernels scheduled by it convert
every bf16 value to fp32 in the inner loop (slower than fp32). AVX512-BF16's ``vdpbf16ps`` through
a tensor intrinsic measured slower than fp32 too on Sapphire Rapids (~104 vs ~160 GFLOP/s per
core). AMX's ``tdpbf16ps`` multiplies 16 x 32 by 32 x 16 bf16 tiles into 16 x 16 fp32
accumulators: ~1 TFLOP/s per core. TVM 0.27 has no AMX support, so the kernel is written directly
in TIR with LLVM's AMX intrinsics, and marked scheduled: tuning, task extraction and the default
schedules leave it alone.

``Y[M, N] (fp32) = X[M, K] (bf16) @ W[K, N] (bf16)``, fp32 accumulation, with M, N, K multiples of
32 and W packed once, at build time, as ``Wp[N/16, K/2, 16, 2]`` (AMX's VNNI layout: pairs of
consecutive k for each of 16 columns). The rewrite pads M (batch x tokens) to a multiple of 32 and
slices the result; a matmul whose N or K is not a multiple of 32 (a classifier with 2 labels)
keeps the bf16 loop nest.
"""

from __future__ import annotations

import ctypes
import platform
from functools import lru_cache

from tvmbert.kernels.scalar_math import gelu_float32

FEATURE = "amx-bf16"  # LLVM's name of the target feature the kernel needs
KERNEL_ATTR = "tvmbert.amx_bf16"  # PrimFunc attribute marking the kernel (build counts them)
TILE = 32  # M, N and K granularity of the kernel (2 x 2 tiles of 16 x 16 fp32, K in steps of 32 bf16)
INSTRUCTION = "tdpbf16ps"  # what the kernel's assembly must contain
ACTIVATIONS = {"relax.nn.gelu": gelu_float32}  # applied as a block is stored (the FFN's GELU)


def target_has_amx(target) -> bool:
    """Whether a resolved target (TargetSpec) is an x86 CPU with AMX-BF16, from its mcpu/mattr."""
    if target.kind != "llvm":
        return False
    from tvm.target.codegen import target_has_features

    return bool(target_has_features(FEATURE, target.tvm_target()))


def no_amx_message(target) -> str:
    return (f"--dtype bfloat16 needs a CPU with AMX-BF16 (Intel Sapphire Rapids or later), and target '{target.key}' "
            f"has none: without it TVM's bf16 kernels convert every value to fp32 in their inner loops and run "
            f"slower than --dtype float32 (AVX512-BF16 alone measured slower than fp32 too). Use --dtype float32, "
            f"or --dtype float16 for half the weight bytes")


@lru_cache(maxsize=1)
def request_permission() -> None:
    """Linux gives a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA), once per process; without it the first AMX instruction is an illegal instruction
    (SIGILL) that kills the process. TVM's runtime does not ask, so whoever loads a library with
    AMX kernels does, before the first call."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError("AMX kernels run on x86-64 Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    if libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "this CPU or kernel does not grant AMX (arch_prctl ARCH_REQ_XCOMP_PERM failed): "
                             "a library built with AMX kernels (--dtype bfloat16) cannot run here")


def fits(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes a matmul of these sizes (M is padded, N and K are not)."""
    return m >= 1 and n % TILE == 0 and k % TILE == 0 and n > 0 and k > 0


def kernel(m: int, n: int, k: int, lead: tuple[int, ...] | None = None, activation: str | None = None,
           residual: bool = False, out_dtype: str = "float32", row_chunk_bytes: int = 1 << 20):
    """The AMX PrimFunc for ``Y[m, n] = act(X[m, k] @ W[k, n] + b[n]) (+ R[m, n])`` (m, n, k
    multiples of 32), W packed, ``act`` one of ``ACTIVATIONS`` or none: bias, activation and
    residual applied to each 32 x 32 block as it is stored, while it is in L1 (without
    ``residual``, R is one unread float), and Y written in ``out_dtype`` (bfloat16 where the next
    matmul reads it: no cast kernel over it).

    With ``lead`` (the leading dimensions of X and Y, whose product is m), X and Y have them instead
    of m: the kernels around it see no reshape. Parallel over column blocks of 32; each block runs over all row blocks, keeping a 32 x 32 fp32
    result in four accumulator tiles (tmm0-3) while A (tmm4-5) and B (tmm6-7) tiles stream along K.
    """
    import tvm
    from tvm.script import tirx as T

    assert m % TILE == 0 and n % TILE == 0 and k % TILE == 0, (m, n, k)
    lda = k * 2  # row stride of X (bf16) in bytes
    row_blocks, col_blocks, k_blocks = m // TILE, n // TILE, k // TILE
    lead = tuple(lead) if lead else (m,)
    # Rows in chunks whose X (bf16) fits a core's L2 (SPR: 2 MiB): all column blocks of a chunk,
    # in parallel, before the next chunk, so that X is not streamed from L3 once per column block.
    chunk = max((d for d in range(1, row_blocks + 1) if row_blocks % d == 0 and d * TILE * k * 2 <= row_chunk_bytes),
                default=1)

    def whole(buffer):
        return tvm.tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d) for d in buffer.shape])

    def intrin(name, *args):
        return T.call_llvm_intrin("void", T.llvm_lookup_intrinsic_id(f"llvm.x86.{name}"), *args)

    epilogue = ACTIVATIONS[activation] if activation else (lambda value: value)

    @T.prim_func(s_tir=True)
    def amx_matmul(x: T.Buffer((*lead, k), "bfloat16"), wp: T.Buffer((n // 16, k // 2, 16, 2), "bfloat16"),
                   b: T.Buffer((n,), "float32"), r: T.Buffer((*lead, n) if residual else (1,), "float32"),
                   y: T.Buffer((*lead, n), out_dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, KERNEL_ATTR: True, "op_pattern": 8})
        with T.sblock("root"):  # SplitLayoutRewritePreproc expects a root block
            with T.sblock("amx_tiles"):  # and a block under it
                T.reads(whole(x), whole(wp), whole(b), whole(r))
                T.writes(whole(y))
                rf = T.decl_buffer((m, n) if residual else (1,), "float32", data=r.data)
                xu = T.decl_buffer((m, k), "uint16", data=x.data)
                yf = T.decl_buffer((m, n), out_dtype, data=y.data)
                wu = T.decl_buffer((n // 16, k // 2, 32), "uint16", data=wp.data)
                for mc in range(row_blocks // chunk):
                    for nb in T.parallel(col_blocks):
                        # Tile configuration: palette 1, 8 tiles of 16 rows x 64 bytes.
                        cfg = T.alloc_buffer((64,), "uint8", scope="local")
                        for byte in range(64):
                            cfg[byte] = T.uint8(0)
                        cfg[0] = T.uint8(1)
                        for t in range(8):
                            cfg[16 + 2 * t] = T.uint8(64)
                            cfg[48 + t] = T.uint8(16)
                        T.evaluate(intrin("ldtilecfg", T.address_of(cfg[0])))
                        block = T.alloc_buffer((32, 32), "float32", scope="local")  # the 2 x 2 tiles, stored
                        for mi in range(chunk):
                            row = (mc * chunk + mi) * 32
                            T.evaluate(intrin("tilezero", T.int8(0)))
                            T.evaluate(intrin("tilezero", T.int8(1)))
                            T.evaluate(intrin("tilezero", T.int8(2)))
                            T.evaluate(intrin("tilezero", T.int8(3)))
                            for kb in range(k_blocks):
                                T.evaluate(intrin("tileloadd64", T.int8(4), T.address_of(xu[row, kb * 32]), T.int64(lda)))
                                T.evaluate(intrin("tileloadd64", T.int8(5), T.address_of(xu[row + 16, kb * 32]), T.int64(lda)))
                                T.evaluate(intrin("tileloadd64", T.int8(6), T.address_of(wu[nb * 2, kb * 16, 0]), T.int64(64)))
                                T.evaluate(intrin("tileloadd64", T.int8(7), T.address_of(wu[nb * 2 + 1, kb * 16, 0]), T.int64(64)))
                                T.evaluate(intrin("tdpbf16ps", T.int8(0), T.int8(4), T.int8(6)))
                                T.evaluate(intrin("tdpbf16ps", T.int8(1), T.int8(4), T.int8(7)))
                                T.evaluate(intrin("tdpbf16ps", T.int8(2), T.int8(5), T.int8(6)))
                                T.evaluate(intrin("tdpbf16ps", T.int8(3), T.int8(5), T.int8(7)))
                            T.evaluate(intrin("tilestored64", T.int8(0), T.address_of(block[0, 0]), T.int64(128)))
                            T.evaluate(intrin("tilestored64", T.int8(1), T.address_of(block[0, 16]), T.int64(128)))
                            T.evaluate(intrin("tilestored64", T.int8(2), T.address_of(block[16, 0]), T.int64(128)))
                            T.evaluate(intrin("tilestored64", T.int8(3), T.address_of(block[16, 16]), T.int64(128)))
                            for i in range(32):
                                for j in T.vectorized(32):
                                    if residual:
                                        yf[row + i, nb * 32 + j] = T.Cast(out_dtype, block[i, j] + b[nb * 32 + j] + rf[row + i, nb * 32 + j])
                                    else:
                                        yf[row + i, nb * 32 + j] = T.Cast(out_dtype, epilogue(block[i, j] + b[nb * 32 + j]))
                        T.evaluate(intrin("tilerelease"))

    assert isinstance(amx_matmul, tvm.tirx.PrimFunc)
    return amx_matmul


def pack_weight(weight):
    """Relax: W[K, N] -> Wp[N/16, K/2, 16, 2] (a reshape and a transpose on a weight alone, which
    bind-params lifts into the build-time weight transform)."""
    from tvm import relax

    k, n = (int(d) for d in weight.ty.shape)
    pairs = relax.op.reshape(weight, (k // 2, 2, n // 16, 16))
    return relax.op.permute_dims(pairs, [2, 0, 3, 1])


def amx_matmuls():
    """The module pass: ``matmul(x_bf16, W_bf16, out_dtype=float32)`` with W a weight (a parameter
    after ``num_input``, or a transpose/cast of one) becomes a call of the AMX kernel on x (padded
    to a multiple of 32 rows where it is not) and W packed, with the bias added after it and the
    activation after that where there are ones (``kernel_calls.Epilogues``), else a zero bias.
    Matmuls the kernel does not fit (N or K not a multiple of 32, dynamic shapes) are left as they
    are; matmuls of two activations go back to fp32."""
    import numpy as np
    from tvm import relax

    from tvmbert.passes.kernel_calls import (
        Epilogues,
        KernelFunctions,
        call_with_padded_rows,
        function_pass,
        kernel_operands,
        row_count,
        weight_matmul_sizes,
        weights_of,
    )

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def __init__(self, module):
            super().__init__(module)
            self.kernels = KernelFunctions("amx_bf16_matmul_", lambda m, lead, n, k, activation, residual, out_dtype:
                                           kernel(m, n, k, lead, activation, residual, out_dtype))
            self.weights = set()
            self.epilogues = None

        def start(self, function):
            self.weights = weights_of(function)
            self.epilogues = Epilogues(function, self.weights, self.fits, ACTIVATIONS,
                                       takes_residual=lambda sizes: row_count(sizes[0]) % TILE == 0,
                                       output_dtypes=("bfloat16",))

        def fits(self, call):
            sizes = weight_matmul_sizes(call, self.weights)
            if (sizes is None or str(call.attrs.out_dtype) != "float32" or any(arg.ty.dtype != "bfloat16" for arg in call.args)
                    or not fits(row_count(sizes[0]), *sizes[1:])):
                return None
            return sizes

        def call_kernel(self, x, weight, bias, sizes, activation, residual, out_dtype):
            lead, n, k = sizes
            packed = self.builder_.emit(pack_weight(weight))
            kernel_for = self.kernels.for_sizes(self.builder_, n, k, activation, residual is not None, out_dtype)
            return call_with_padded_rows(self.builder_, kernel_for, x, kernel_operands(packed, bias, residual), lead, n, k, TILE,
                                         out_dtype)

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


def instructions_in(executable) -> int:
    """How many ``tdpbf16ps`` the executable's CPU code holds (its assembly, generated again)."""
    count = 0
    for imported in executable.mod.imports:
        if imported.kind == "llvm":
            count += imported.inspect_source("asm").count(INSTRUCTION)
        count += sum(m.inspect_source("asm").count(INSTRUCTION) for m in imported.imports if m.kind == "llvm")
    return count

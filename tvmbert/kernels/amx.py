"""bf16 matmuls on Intel AMX (AMX-BF16): the kernel. The pass ``amx-bf16``
(``passes/amx_bf16.py``) calls it; the loader (``deploy/loader.py``) asks for the process
permission its instructions need.

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

from tvmbert.kernels.fma import assembly_of, whole
from tvmbert.kernels.scalar_math import gelu_float32

KERNEL_ATTR = "tvmbert.amx_bf16"  # PrimFunc attribute marking the kernel (build counts them)
TILE = 32  # M, N and K granularity of the kernel (2 x 2 tiles of 16 x 16 fp32, K in steps of 32 bf16)
INSTRUCTION = "tdpbf16ps"  # what the kernel's assembly must contain
ACTIVATIONS = {"relax.nn.gelu": gelu_float32}  # applied as a block is stored (the FFN's GELU)


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


def instructions_in(executable) -> dict[str, int]:
    """How many ``tdpbf16ps`` the executable's CPU code holds."""
    return {INSTRUCTION: assembly_of(executable).count(INSTRUCTION)}

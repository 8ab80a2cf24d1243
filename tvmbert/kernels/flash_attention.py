"""Self-attention as one flash-attention kernel per layer on GPUs. The pass ``flash-attention``
(``passes/flash_attention.py``) calls it.

TVM's own tiled prefill kernels (``tvm.relax.frontend.nn.llm``, the LLM KV cache's) compute
``softmax(Q K^T * scale) V`` a tile of query rows per thread block, streaming K and V through
shared memory with an online softmax, so the scores never reach global memory. None of them takes
an additive mask: the masked variant there takes one valid length per sequence and zeroes padded
queries, which is not what BERT computes (its padded positions still attend to every real token,
and its mask need not be a prefix of ones). This kernel is that kernel with BERT's mask: the same
loads, macros and schedule (``_kernel_common``: block names and tiles as TVM's
``batch_sequence_prefill_kv`` has them), with the mask added to each tile of scores as it is
stored, and Q, K and V read where the graph holds them: columns of the [batch x seq, columns]
outputs of the projections (the fused Q/K/V projection's included), in the kernel's dtype. The result is [batch, seq, heads, dim], as the output projection reads it (in fp16 for fp16
builds: the projection's input).

Masked scores are floored at ``SCORE_FLOOR``: a row whose every key is masked (an all-zero
attention mask) then averages V, as PyTorch's softmax does (its mask's -3.4e38 absorbs the scores).
"""

from __future__ import annotations

import math

KERNEL_ATTR = "tvmbert.flash_attention"  # PrimFunc attribute marking the kernel (build counts them)
LOG2E = math.log2(math.e)  # the kernel's softmax runs in base 2 (exp2)
# Scores (base 2) below this are raised to it: a masked key still weighs 2^-40000 = 0 beside any
# real one, and equal floors weigh equally, above the -5e4 the running max starts from.
SCORE_FLOOR = -4e4


def fits(dim: int, dtype: str, target) -> bool:
    """Whether TVM's prefill tiling takes this head size (its thread factorization, and loads of
    8 bytes: 4 fp16 values) for ``dtype`` on ``target``; any sequence length fits."""
    from tvm.relax.frontend.nn.llm._kernel_common import _get_prefill_kernel_config

    try:
        tile_y = _get_prefill_kernel_config(1, 1, dim, dtype, target)[6]
    except ValueError:
        return False
    return dim % 4 == 0 and tile_y == dim  # Q and O tiles as wide as a head


def kernel(batch: int, heads: int, seq: int, dim: int, columns: tuple, mask_shape: tuple | None, scale: float,
           dtype: str, target, out_dtype: str = "float32"):
    """The PrimFunc ``(q, k, v, mask) -> (out [batch, seq, heads, dim] of out_dtype, lse)``: q, k and v are
    [batch x seq, c] of ``dtype`` with head h's values at columns offset + h x dim (``columns``: (c, offset)
    of each), ``mask`` the additive fp32 mask broadcast to [batch, heads, seq, seq] (shape
    ``mask_shape``; None: a [1] zero). ``dtype``: Q, K and V in shared memory (float16 or float32);
    scores and sums are fp32. ``target``: a TVM GPU target (its tiles and thread limits)."""
    from tvm.relax.frontend.nn.llm import _kernel_common as common
    from tvm.script import tirx as T

    _, load_vec, group_size, bdx, num_warps, tile_x, tile_y, tile_z = common._get_prefill_kernel_config(
        heads, heads, dim, dtype, target)
    init_states, _, softmax_update, compute_o_gemm, *_ = common._make_prefill_macros(
        tile_x, tile_y, tile_z, tile_y, bdx, num_warps, group_size)
    (q_columns, q_offset), (k_columns, k_offset), (v_columns, v_offset) = columns
    mask_shape = tuple(mask_shape) if mask_shape else (1, 1, 1, 1)
    mask_b, mask_h, mask_q, mask_k = (int(int(size) > 1) for size in mask_shape)  # 0 where the mask broadcasts
    weight = scale * LOG2E
    tiles = -(-seq // tile_x)

    @T.macro
    def masked_scores(Q_smem, K_smem, S_local, S_smem, mask, b, h, row_start, column_start):
        with T.sblock():
            for li, lj, lk in T.grid(tile_x, tile_z, tile_y):
                with T.sblock("S_gemm"):
                    i, j, k = T.axis.remap("SSR", [li, lj, lk])
                    with T.init():
                        S_local[i, j] = T.float32(0)
                    S_local[i, j] += T.cast(Q_smem[i, k], "float32") * T.cast(K_smem[j, k], "float32") * T.float32(weight)
        T.tvm_storage_sync("shared")
        for li, lj in T.grid(tile_x, tile_z):
            with T.sblock("S_store"):
                i, j = T.axis.remap("SS", [li, lj])
                # Rows and columns past the sequence read its last ones: never stored, never summed.
                S_smem[i, j] = T.max(S_local[i, j] + mask[b * mask_b, h * mask_h, T.min(row_start + i, seq - 1) * mask_q,
                                                          T.min(column_start + j, seq - 1) * mask_k] * T.float32(LOG2E),
                                     T.float32(SCORE_FLOOR))
        T.tvm_storage_sync("shared")

    @T.prim_func(s_tir=True)
    def flash_attention(q: T.Buffer((batch * seq, q_columns), dtype), k: T.Buffer((batch * seq, k_columns), dtype),
                        v: T.Buffer((batch * seq, v_columns), dtype), mask: T.Buffer(mask_shape, "float32"),
                        output: T.Buffer((batch, seq, heads, dim), out_dtype), lse: T.Buffer((batch, seq, heads), "float32")):
        T.func_attr({"tirx.noalias": True, KERNEL_ATTR: True, "op_pattern": 8})
        for lbx in T.thread_binding(batch * tiles, thread="blockIdx.x"):
            for lby in T.thread_binding(heads, thread="blockIdx.y"):
                for lty in T.thread_binding(num_warps, thread="threadIdx.y"):
                    for ltx in T.thread_binding(bdx, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            vbx, by, ty, tx = T.axis.remap("SSSS", [lbx, lby, lty, ltx])
                            T.reads()
                            T.writes()
                            Q_smem, K_smem, V_smem, O_local = common._alloc_mha_qkvo_buffers(tile_x, tile_z, dim, dim, dtype)
                            S_smem, S_local, m_smem, m_prev_smem, d_smem, m_new, m_prev, d_new = (
                                common._alloc_softmax_state_buffers(tile_x, tile_z, bdx, num_warps))
                            b_idx: T.let[T.int32] = vbx // tiles
                            LH_start: T.let[T.int32] = (vbx % tiles) * tile_x
                            T.tvm_storage_sync("shared")
                            init_states(m_smem, d_smem, O_local, ty, tx)
                            for li, lj in T.grid(tile_x, tile_y):
                                with T.sblock("Q_load"):
                                    i, j = T.axis.remap("SS", [li, lj])
                                    T.reads()
                                    T.writes()
                                    row: T.let[T.int32] = LH_start + i
                                    if row < seq:
                                        Q_smem[i, j] = q[b_idx * seq + row, q_offset + by * dim + j]
                                    else:
                                        Q_smem[i, j] = T.cast(0, dtype)
                            T.tvm_storage_sync("shared")
                            for iterator in T.serial(T.ceildiv(seq, tile_z)):
                                L_kv_start: T.let[T.int32] = iterator * tile_z
                                for lz, ly in T.grid(tile_z, tile_y):
                                    with T.sblock("K_load"):
                                        i, j = T.axis.remap("SS", [lz, ly])
                                        T.reads()
                                        T.writes()
                                        column: T.let[T.int32] = L_kv_start + i
                                        if column < seq:
                                            K_smem[i, j] = k[b_idx * seq + column, k_offset + by * dim + j]
                                        else:
                                            K_smem[i, j] = T.cast(0, dtype)
                                T.tvm_storage_sync("shared")
                                for lz, ly in T.grid(tile_z, tile_y):
                                    with T.sblock("V_load"):
                                        i, j = T.axis.remap("SS", [lz, ly])
                                        T.reads()
                                        T.writes()
                                        column: T.let[T.int32] = L_kv_start + i
                                        if column < seq:
                                            V_smem[i, j] = v[b_idx * seq + column, v_offset + by * dim + j]
                                        else:
                                            V_smem[i, j] = T.cast(0, dtype)
                                T.tvm_storage_sync("shared")
                                masked_scores(Q_smem, K_smem, S_local, S_smem, mask, b_idx, by, LH_start, L_kv_start)
                                # causal 0: only columns past the sequence are left out
                                softmax_update(S_smem, m_smem, d_smem, m_prev_smem, m_new, m_prev, d_new, ty, tx, LH_start,
                                               L_kv_start, 0, seq, seq, 0)
                                compute_o_gemm(S_smem, V_smem, O_local, m_prev_smem, m_smem)
                            for li, lj in T.grid(tile_x, tile_y):
                                with T.sblock("O_store"):
                                    i, j = T.axis.remap("SS", [li, lj])
                                    if LH_start + i < seq:
                                        output[b_idx, LH_start + i, by, j] = T.cast(O_local[i, j] / d_smem[i], out_dtype)
                            for li in T.grid(tile_x):
                                with T.sblock("lse_store"):
                                    i = T.axis.remap("S", [li])
                                    if LH_start + i < seq:
                                        lse[b_idx, LH_start + i, by] = m_smem[i] + T.log2(d_smem[i])

    import tvm

    schedule = tvm.s_tir.Schedule(flash_attention)
    schedule = common._schedule_prefill_kernel(schedule, load_vec, bdx, num_warps, tile_x, tile_y, tile_z, False, False)
    return schedule.mod["main"].with_attr("tirx.is_scheduled", True)

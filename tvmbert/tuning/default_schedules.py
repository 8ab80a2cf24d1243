"""Sound CPU schedules for kernels no tuning database covers.

TVM's CPU pipeline only legalizes: a kernel without a record runs as a naive serial loop nest
(bert-base 1x14: 2.9 s). dlight has CPU rules for GEMV and reductions only. These rules fill the
gap the way TVM's old ``topi/x86/dense.py`` fallback did: matmuls get a register-blocked
outer-product micro-kernel (rows x vectors of accumulators kept in registers over the whole
reduction, weights laid out once in the panels the tiles read, epilogue fused per tile, tiles in
parallel); other kernels get their outer spatial loops fused and parallel and their inner loop
vectorized.

Every rule works on a copy and gives up (returns None) on anything it does not recognise or
cannot schedule; the next rule then tries, and a kernel no rule takes keeps TVM's loop nest.
"""

from __future__ import annotations

from tvmbert.core.targets import vector_lanes
from tvmbert.ir.tasks import LAYOUT_FREE

MAX_ACCUMULATORS = 28  # vector registers a micro-kernel's accumulator tile may hold (AVX-512 has 32)
MAX_TILE_ROWS = 14
MAX_TILE_VECTORS = 4
PARALLEL_MIN_ELEMENTS = 4096  # below this a thread-pool launch costs more than it saves


def default_cpu_schedules():
    """The pass that schedules every kernel a database left unscheduled, first rule that fits."""
    from tvm.s_tir import dlight

    return dlight.ApplyDefaultSchedule(
        _guarded(dlight.cpu.GEMV()), _rule(_matmul), _guarded(dlight.cpu.Reduction()), _rule(_loops))


def default_gpu_schedules(kind: str):
    """dlight's GPU rules, first that fits; each guarded (its GEMV rule asserts on some of
    add_tvm_dispatch's backward kernels)."""
    from tvm.s_tir import dlight

    gpu = dlight.gpu
    return dlight.ApplyDefaultSchedule(_rule(_tensor_core_matmul, kind),
        *(_guarded(rule, kind) for rule in (gpu.Matmul(), gpu.GEMV(), gpu.Reduction(), gpu.GeneralReduction(), gpu.Fallback())))


def _tensor_core_matmul(func, target):
    """dlight's tensor-core (WMMA) schedule for an fp16 matmul of two rows or more on CUDA sm_70
    and later, whatever its sizes: dlight's Matmul rule leaves any matmul with a size of 64 or less
    to the CUDA cores (bert-base at 1 x 14: 14 rows). The schedule pads rows, columns and the
    reduction to its tiles itself, as it loads them into shared memory: no padding kernel, no copy.
    A single row (the pooler at batch 1) is a matrix-vector product, dlight's GEMV rule's."""
    import math
    import re

    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import get_root_block
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization, get_reduction_blocks

    arch = re.match(r"sm_(\d+)", str(target.attrs.get("arch", "")))
    if arch is None or int(arch.group(1)) < 70:
        return None
    sch = s_tir.Schedule(func)
    reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if not reductions or len(reductions) != 1:
        return None
    block = sch.get(reductions[0])
    output = block.writes[0].source
    if (len(block.reads) != 2 or any(read.source.dtype != "float16" for read in block.reads)
            or output.dtype not in ("float16", "float32") or math.prod(int(d) for d in output.shape[:-1]) < 2):
        return None
    return MatmulTensorization().apply(func, target, False)


def _guarded(rule, kind: str = "llvm"):
    """A dlight rule that may raise on a kernel it half recognises: then it simply does not apply."""
    return _rule(lambda func, target: rule.apply(func, target, False), kind)


def _rule(schedule, kind: str = "llvm"):
    from tvm import tirx
    from tvm.s_tir.dlight.base import ScheduleRule

    class Rule(ScheduleRule):
        def apply(self, func, target, _tunable):
            if not isinstance(func, tirx.PrimFunc) or target.kind.name != kind:
                return None
            try:
                return schedule(func, target)
            except Exception:  # noqa: BLE001 - a rule that cannot schedule this kernel leaves it to the next
                return None

    return Rule()


def _iter_kinds(sch, block) -> str:
    return "".join("S" if int(iv.iter_type) == 0 else "R" if int(iv.iter_type) == 2 else "O"
                   for iv in sch.get(block).iter_vars)


def _extent(sch, loop) -> int | None:
    from tvm import tirx

    extent = sch.get(loop).extent
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def _inline_all(sch) -> None:
    """Inlines every spatial block into its consumers where it can, else into its producer."""
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if "R" in _iter_kinds(sch, block):
                continue
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(block)
                    changed = True
                    break
                except Exception:  # noqa: BLE001 - this block stays a stage of its own
                    continue
            if changed:
                break


def _matmul(func, target):
    """C[b.., i, j] = sum_k A[b.., i, k] * B[b.., k, j], with element-wise stages before and after."""
    from tvm import s_tir, tirx

    sch = s_tir.Schedule(func)
    reductions = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if "R" in _iter_kinds(sch, b)]
    if len(reductions) != 1:
        return None
    matmul = reductions[0]
    kinds = _iter_kinds(sch, matmul)
    if not (kinds.endswith("SSR") and set(kinds[:-1]) == {"S"}):
        return None
    body = sch.get(matmul).body
    if not (isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add)
            and isinstance(body.value.b, tirx.Mul)):
        return None
    _inline_all(sch)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    position = [sch.get(b).same_as(sch.get(matmul)) for b in blocks].index(True)
    if position != 0 or len(blocks) > 2:
        return None  # a prologue that would not inline, or an epilogue of several stages
    epilogue = blocks[1] if len(blocks) == 2 else None

    loops = sch.get_loops(matmul)
    if len(loops) != len(kinds):
        return None
    *batch, rows, cols, reduce = loops
    m, n = _extent(sch, rows), _extent(sch, cols)
    if m is None or n is None or _extent(sch, reduce) is None:
        return None
    out_bits = sch.get(matmul).writes[0].source.dtype.bits
    vector = _divisor_at_most(n, vector_lanes(target, out_bits))
    tile_rows, tile_vectors = max(
        ((r, v) for r in range(1, min(m, MAX_TILE_ROWS) + 1) if m % r == 0
         for v in range(1, MAX_TILE_VECTORS + 1) if n % (v * vector) == 0 and r * v <= MAX_ACCUMULATORS),
        key=lambda rv: (rv[0] * rv[1], rv[0]))  # more rows per tile: each weight panel is read by fewer tiles

    row_tiles, tile_row = sch.split(rows, [None, tile_rows])
    col_tiles, tile_vec, lane = sch.split(cols, [None, tile_vectors, vector])
    sch.reorder(*batch, row_tiles, col_tiles, reduce, tile_row, tile_vec, lane)
    outer = sch.fuse(*batch, row_tiles, col_tiles)
    if epilogue is not None:
        sch.set_scope(matmul, 0, "local")
        store = epilogue
    else:
        store = sch.cache_write(matmul, 0, "local")
    sch.reverse_compute_at(store, outer, preserve_unit_loops=True)
    store_loops = sch.get_loops(store)[1:]
    if len(store_loops) >= 2:
        _, store_lane = sch.split(sch.fuse(*store_loops[-2:]) if len(store_loops) > 2 else store_loops[-1],
                                  [None, vector])
        sch.vectorize(store_lane)
    # Loop kinds first: parallel and vectorize need the whole reduction block, before its init is split off.
    sch.unroll(tile_row)
    sch.unroll(tile_vec)
    sch.vectorize(lane)
    if (_extent(sch, outer) or 1) > 1:
        sch.parallel(outer)
    sch.decompose_reduction(matmul, reduce)
    if func.attrs and LAYOUT_FREE in func.attrs:
        # Weights stored tile by tile, in the order the micro-kernel reads them (build repacks
        # them once): each tile then streams one contiguous panel instead of a strided column.
        from tvm.s_tir import meta_schedule as ms

        ms.postproc.RewriteLayout().apply(sch)
    return sch


def _loops(func, target):
    """Any other kernel: stages inlined where they can be; per remaining stage, the outer spatial
    loops fused and parallel, the innermost loop vectorized when the stage is element-wise."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    _inline_all(sch)
    changed = False
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        kinds = _iter_kinds(sch, block)
        loops = sch.get_loops(block)
        if len(loops) != len(kinds) or not loops:
            continue
        leading = len(kinds) - len(kinds.lstrip("S"))
        elements = 1
        for loop in loops[:leading]:
            elements *= _extent(sch, loop) or 1
        if leading == len(kinds):  # element-wise: vectorize the innermost loop
            inner = _extent(sch, loops[-1]) or 1
            vector = _divisor_at_most(inner, vector_lanes(target, sch.get(block).writes[0].source.dtype.bits))
            if vector > 1:
                _, lane = sch.split(loops[-1], [None, vector])
                sch.vectorize(lane)
                changed = True
            loops = sch.get_loops(block)[:leading]
        else:
            loops = loops[:leading]
        if loops and elements >= PARALLEL_MIN_ELEMENTS // 16 ** (leading != len(kinds)):
            try:
                sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
                changed = True
            except Exception:  # noqa: BLE001 - a loop that cannot run in parallel stays serial
                pass
    return sch if changed else None

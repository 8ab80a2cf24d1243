"""Hand-written CPU schedules that MetaSchedule's rules do not generate, measured and recorded
next to its own candidates (the database keeps whichever runs faster).

Small-M matmuls (a batch of a few short sequences times a weight matrix: bert-base at 1 x 14)
are bound by streaming the weights. MetaSchedule tiles them like large GEMMs and keeps partial
sums in memory; here each thread owns a band of output columns, keeps every row's partial sums
for it in vector registers over the whole reduction, and reads its band of the weights, packed at
build time, as one contiguous stream.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ROWS = 32  # rows x band lanes of accumulators must fit in the 32 vector registers with room to spare
VECTOR_LANES = 16  # float32 lanes of an AVX-512 register
MARK = "tvmbert.schedule"  # block annotation naming the hand schedule: found again in a record's trace


@dataclass(frozen=True)
class Variant:
    band: int  # output columns per thread step (a multiple of the vector width)
    unroll: int  # reduction steps unrolled

    @property
    def name(self) -> str:
        return f"streaming-matmul band={self.band} unroll={self.unroll}"


VARIANTS = tuple(Variant(band, unroll) for band in (16, 32, 48, 64) for unroll in (4, 8))


def _matmul_block(sch):
    """The one reduction block of the kernel when it is a small-M matmul reading a layout-free
    weight: (block, read index of the weight, rows, columns); None otherwise."""
    func = sch.mod["main"]
    free = {func.params[int(i)].name for i in (func.attrs or {}).get("layout_free_buffers", [])}
    if not free:
        return None
    reductions = [b for b in sch.get_child_blocks(sch.get_sblock("root", func_name="main"))
                  if any(int(iv.iter_type) == 2 for iv in sch.get(b).iter_vars)]
    if len(reductions) != 1:
        return None
    block = reductions[0]
    iters = sch.get(block).iter_vars
    kinds = [int(iv.iter_type) for iv in iters]
    if kinds.count(2) != 1 or kinds[-1] != 2 or len(iters) < 3 or len(sch.get_loops(block)) != len(iters):
        return None
    rows = 1
    for iv in iters[:-2]:
        rows *= int(iv.dom.extent)
    column, reduction = iters[-2].var, iters[-1].var
    weights = [i for i, read in enumerate(sch.get(block).reads)  # read as [k, n]
               if read.source.name in free and len(read.region) == 2
               and read.region[0].min.same_as(reduction) and read.region[1].min.same_as(column)]
    if rows > MAX_ROWS or len(weights) != 1:
        return None
    return block, weights[0], rows, int(iters[-2].dom.extent)


def applies(mod) -> bool:
    import tvm

    return _matmul_block(tvm.s_tir.Schedule(mod)) is not None


def streaming_matmul(mod, variant: Variant):
    """The kernel scheduled as a weight-streaming matmul, or None where ``variant`` does not fit
    (the band must divide the columns)."""
    import tvm

    sch = tvm.s_tir.Schedule(mod)
    found = _matmul_block(sch)
    if found is None:
        return None
    block, weight, _, columns = found
    if columns % variant.band or variant.band % VECTOR_LANES:
        return None
    *row_loops, column, reduction = sch.get_loops(block)
    rows = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
    band, lane = sch.split(column, [None, variant.band])
    step, unrolled = sch.split(reduction, [None, variant.unroll])
    sch.reorder(band, step, unrolled, rows, lane)
    # The epilogue (bias, activation) runs per band, on the partial sums still in cache.
    epilogue = []
    consumers = sch.get_consumers(block)
    while len(consumers) == 1:
        epilogue.append(consumers[0])
        consumers = sch.get_consumers(consumers[0])
    for stage in epilogue:
        sch.reverse_compute_at(stage, band)
    sch.parallel(band)
    sch.unroll(rows)
    sch.unroll(unrolled)
    sch.vectorize(lane)
    for stage in epilogue:
        innermost = sch.get_loops(stage)[-1]
        extent = sch.get(innermost).extent
        if int(extent) % VECTOR_LANES == 0:
            sch.vectorize(sch.split(innermost, [None, VECTOR_LANES])[1])
    sch.set_scope(block, 0, "local")  # the partial sums: registers, once fully unrolled
    sch.annotate(block, MARK, variant.name)
    sch.decompose_reduction(block, step)  # ``block`` is now the update; the init comes before the loop
    # What MetaSchedule's RewriteLayout postprocessor does: the weight, read in band order, is
    # repacked as [band][k][lane] by a preprocessing block that the build hoists out of the model.
    packed = sch.cache_read(block, weight + 1, "global")  # the update block reads its output first
    sch.annotate(packed, "meta_schedule.layout_rewrite_preproc", 1)
    width = variant.band
    sch.transform_layout(block, ("read", weight + 1), lambda k, n: (n // width, k, n % width))
    return sch


def candidates(mod) -> list:
    """(variant, schedule) for every variant that fits the kernel; none for other kernels."""
    found = []
    for variant in VARIANTS:
        sch = streaming_matmul(mod, variant)
        if sch is not None:
            found.append((variant, sch))
    return found

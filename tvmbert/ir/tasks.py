"""Tuning tasks: the kernels of a Relax module as MetaSchedule extracts them, named and weighed,
and the weights a schedule may lay out. IR work that build, tune and training share, apart from
the database the records of those tasks live in."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUT_FREE = "layout_free_buffers"  # PrimFunc attribute: argument positions whose layout a schedule may choose


@dataclass(frozen=True)
class Task:
    name: str
    module: object  # the IRModule MetaSchedule tunes (one fused PrimFunc)
    weight: int  # how many times main calls it
    flops: float

    @property
    def cost(self) -> float:
        """What the task weighs in one inference: flops x calls (at least 1 flop, to rank the rest)."""
        return max(self.flops, 1.0) * self.weight

    @property
    def trivial(self) -> bool:
        """No arithmetic (reshape, take, cast...): not worth a trial."""
        return self.flops == 0


def entry_module(module, *entries: str):
    """The ``entries`` and what they call, nothing else (DCE alone keeps the other Relax entry
    points); None when ``module`` has none of them."""
    import tvm
    from tvm import relax

    if not any(gv.name_hint in entries for gv in module.get_global_vars()):
        return None
    kept = tvm.IRModule({gv: f for gv, f in module.functions_items()
                         if gv.name_hint in entries or not isinstance(f, relax.Function)})
    return relax.transform.DeadCodeElimination(list(entries))(kept)


def inference_module(module, target):
    """main alone: the weight transforms run once at build time and are not worth tuning. On
    targets that lay weights out, kernels reading a weight matrix say so, and MetaSchedule may then store
    it in the order its tiles read it (its RewriteLayout postprocessor); the build repacks the
    weights once, so that no kernel strides through a matrix in memory."""
    main = entry_module(module, "main")
    return mark_layout_free_weights(main) if target.lays_out_weights else main


def mark_layout_free_weights(module):
    """Marks, in each reducing kernel main calls, the arguments that are weight matrices at every
    call (main's parameters after its ``num_input`` inputs, 2-D or more) as ``layout_free_buffers``.

    Relax's AttachAttrLayoutFreeBuffers does this too, but renames every kernel and marks the
    ones without weights with an empty list: their structural hash changes and their tuning
    records stop matching. Vectors (biases, LayerNorm's scale) gain nothing from a new layout.
    """
    import tvm
    from tvm import relax, tirx

    main = module["main"]
    num_input = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    weights = {param for param in main.params[num_input:] if getattr(param.ty, "ndim", 0) >= 2}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    positions: dict = {}  # kernel GlobalVar -> argument positions that are weights at every call

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            kernel, args = expr.args[0], expr.args[1].fields
            here = {i for i, arg in enumerate(args) if arg in weights}
            positions[kernel] = positions[kernel] & here if kernel in positions else here

    relax.analysis.post_order_visit(main.body, visit)
    return tvm.IRModule({gv: func.with_attr(LAYOUT_FREE, sorted(positions[gv]))
                         if isinstance(func, tirx.PrimFunc) and positions.get(gv) and not _hand_written(func)
                         and _reduces(func) else func
                         for gv, func in module.functions_items()}, attrs=module.attrs)


def _hand_written(func) -> bool:
    """A kernel written scheduled (ours): its weight layout is its own already."""
    return bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


def _reduces(func) -> bool:
    """Whether a kernel has a reduction (a matmul): only there does a schedule read a weight in an
    order of its own. Elementwise kernels and lookups (an embedding table) keep their layout;
    a layout rewrite of a 3-D weight in an elementwise kernel also trips SplitLayoutRewritePreproc."""
    import tvm

    sch = tvm.s_tir.Schedule(func)
    return any(int(iv.iter_type) == 2 for block in sch.get_child_blocks(sch.get_sblock("root"))
               for iv in sch.get(block).iter_vars)


def marked_kernels(module) -> set[str]:
    """The kernels whose weights a schedule may store in a layout of its own."""
    from tvm import tirx

    return {gv.name_hint for gv, func in module.functions_items()
            if isinstance(func, tirx.PrimFunc) and func.attrs and LAYOUT_FREE in func.attrs}


def without_marks(module, names: set[str]):
    import tvm

    return tvm.IRModule({gv: func.without_attr(LAYOUT_FREE) if gv.name_hint in names else func
                         for gv, func in module.functions_items()}, attrs=module.attrs)


def extract_tasks(module, target, entries: tuple[str, ...] = ("main",)) -> list[Task]:
    """The kernels the ``entries`` call (main: inference), with their call counts; hand-written
    kernels (ours) are no task: nothing to tune, no schedule to find."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    tasks = []
    for extracted in ms.relax_integration.extract_tasks(entry_module(module, *entries), target.tvm_target()):
        workload = extracted.dispatched[0]
        if any(_hand_written(func) for func in workload.functions.values()):
            continue
        try:
            flops = float(estimate_tir_flops(workload))
        except Exception:  # an analysis that cannot read a kernel should not stop the stage
            flops = -1.0
        tasks.append(Task(extracted.task_name, workload, int(extracted.weight), flops))
    return tasks

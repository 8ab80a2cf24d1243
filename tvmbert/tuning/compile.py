"""Compiling a Relax module with the target's tuning databases applied: what build does for
inference and training for forward + backward, so it sits below both."""

from __future__ import annotations

from dataclasses import dataclass

from tvmbert.core.errors import StageFailed
from tvmbert.ir.tasks import entry_module, extract_tasks
from tvmbert.tuning import database
from tvmbert.tuning.catalog import DEFAULT, TRANSFERRED, Catalog
from tvmbert.tuning.default_schedules import default_cpu_schedules, default_gpu_schedules
from tvmbert.tuning.intrinsics import register_tensor_intrinsics

WEIGHT_LAYOUT_ENTRY = "main_transform_params"  # weights in, weights as main takes them out
CUDA_GRAPH_CONFIG = "relax.backend.use_cuda_graph"
CUDA_GRAPH_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"  # what a captured forward calls in the VM


@dataclass
class TunedBuild:
    executable: object  # relax.VMExecutable of the entries
    tasks: list  # the non-trivial tasks of the entries
    schedules: dict[str, str]  # task name -> where its schedule came from: native, transferred from KEY, default
    weight_layouts: object | None  # IRModule: WEIGHT_LAYOUT_ENTRY, the weight layouts the tuned kernels read
    databases: list[str]  # every database the records were looked up in
    missing: list[str]  # the target's own database folders that did not exist (catalog.Catalog.missing)

    @property
    def untuned(self) -> list[str]:
        return [name for name, source in self.schedules.items() if source == DEFAULT]

    @property
    def transferred(self) -> list[str]:
        return [name for name, source in self.schedules.items() if source.startswith(TRANSFERRED)]


def summary(schedules: dict[str, str]) -> str:
    """'13/13 tasks tuned (9 native, 4 transferred from llvm-x)' and the like."""
    counts: dict[str, int] = {}
    for source in schedules.values():
        counts[source] = counts.get(source, 0) + 1
    tuned = len(schedules) - counts.get(DEFAULT, 0)
    parts = ", ".join(f"{n} {source}" for source, n in sorted(counts.items()) if source != DEFAULT)
    return f"{tuned}/{len(schedules)} tasks tuned" + (f" ({parts})" if parts else "") \
        + (f", {counts[DEFAULT]} with default schedules" if counts.get(DEFAULT) else "")


def compile_tuned(module, target, log_dir, say, entries: tuple[str, ...] = ("main",), announce: str | None = None,
                  label: str | None = None, cuda_graph: bool = False) -> TunedBuild:
    """Compiles ``module`` for ``target`` with the target's tuning database applied (the records
    measured so far while a tune is running), other CPUs' records where it has none, and default
    schedules for what no database covers (dlight's on GPUs, cpu_schedules' on CPUs).

    ``cuda_graph`` (CUDA targets): Relax's RewriteCUDAGraph captures the static-shape kernel
    launches in a CUDA graph at the first call and replays it after; bert-base on an H200 was
    launch-bound (~4.5 ms at 1 x 14 and at 1 x 128 alike)."""
    import tvm
    from tvm import relax

    target.check_toolchain()  # build's, add_tvm_dispatch's and tune's compiles alike
    live = database.tuning_active(log_dir)
    if live:
        say(f"{announce or 'compile'}: a tuning run is writing to {log_dir}; building with the records measured so far")
    catalog = Catalog(log_dir, target.key, warn=lambda message: say(f"warning: {message}"), live=live,
                      cores=target.config.get("num-cores"))
    module = catalog.prefer_measured_layouts(module, target)
    tasks = [t for t in extract_tasks(module, target, entries) if not t.trivial]
    schedules, records = catalog.schedules(tasks)
    if announce:
        say(f"{announce}: {target.key}, {summary(schedules)}; records read from {', '.join(catalog.read()) or 'no folder'}"
            + (f"; no such folder: {', '.join(catalog.missing())}" if catalog.missing() else ""))
    tvm_target = target.tvm_target()
    if target.is_gpu:  # dlight's tensor-core rules import the intrinsics they tensorize with
        register_tensor_intrinsics(target.kind)
    with tvm_target:
        with records:
            module = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(module)
        module = (default_gpu_schedules(target.kind) if target.is_gpu else default_cpu_schedules())(module)
        if target.lays_out_weights:
            # A kernel tuned with a weight layout of its own starts by laying the weight out; that
            # step becomes a kernel apart, lifted out of main into WEIGHT_LAYOUT_ENTRY, run once by build.
            module = tvm.transform.Sequential([relax.transform.SplitLayoutRewritePreproc(),
                                               relax.transform.LiftTransformParams()])(module)
    weight_layouts = entry_module(module, WEIGHT_LAYOUT_ENTRY)
    try:
        graph = {CUDA_GRAPH_CONFIG: cuda_graph and target.kind == "cuda"}
        # TVM's CUDA compiler reads the architecture from the current target, else from this machine's GPU
        with tvm_target, tvm.transform.PassContext(config=graph):
            executable = tvm.compile(entry_module(module, *entries), tvm_target)
    except Exception as exc:
        raise StageFailed(f"TVM build{' of ' + label if label else ''} for {target.key} failed: {str(exc).splitlines()[-1]}") from exc
    return TunedBuild(executable, tasks, schedules, weight_layouts, catalog.read(), catalog.missing())


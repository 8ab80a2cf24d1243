"""Stage 5: compile for the target with the tuning database applied; export library + params."""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import artifacts, toolchain, tuning_db
from .artifacts import Artifact
from .catalog import DEFAULT, TRANSFERRED, Catalog
from .convert import PARAMS_FILE, load_module, load_params, save_params
from .cpu_schedules import default_cpu_schedules
from .errors import StageFailed
from .job import Job
from .optimize import optimize

LIBRARY_FILE = "model.so"
PREPACK_ENTRY = "main_transform_params"  # weights in, weights as main takes them out


def build(job: Job, force: bool = False) -> Artifact:
    optimized = job.upstream("optimize", optimize)
    log_dir = job.log_dir()
    fp = artifacts.fingerprint(stage="build", optimize=optimized.fingerprint, target=job.target.config,
                               databases=tuning_db.state(log_dir.parent))
    path = job.stage_dir("build")
    if not force and (hit := artifacts.cached("build", path, fp)):
        job.say(f"build: cached ({path})")
        _suggest_adapt(job, hit.meta)
        return hit
    toolchain.check(job.target)

    optimized_module = load_module(optimized.path)
    started = time.perf_counter()
    compiled = compile_tuned(tuning_db.inference_module(optimized_module, job.target), job.target, log_dir, job.say,
                             announce="build")
    params = load_params(job.stage_dir("convert") / PARAMS_FILE)
    for transform in (tuning_db.entry_module(optimized_module, PREPACK_ENTRY), compiled.prepack):
        params = _transform_params(transform, params)
    meta = {
        "artifact": str(path / LIBRARY_FILE),
        "target": job.target.config,
        "target_key": job.target.key,
        "database": str(log_dir),
        "databases_read": compiled.databases,
        "tasks_total": len(compiled.tasks),
        "tasks_tuned": len(compiled.tasks) - len(compiled.untuned),
        "untuned": compiled.untuned,
        "transferred": compiled.transferred,
        "schedules": compiled.schedules,
        "build_seconds": round(time.perf_counter() - started, 2),
        "outputs": optimized.meta.get("outputs") or [],
        "device_modules": device_modules(compiled.executable.mod),
    }
    with artifacts.writing("build", path, fp, meta) as tmp:
        compiled.executable.export_library(str(tmp / LIBRARY_FILE))
        save_params(tmp / PARAMS_FILE, params)
    _suggest_adapt(job, meta)
    return Artifact("build", path, fp, {"fingerprint": fp, **meta}, cached=False)


def _suggest_adapt(job: Job, meta: dict) -> None:
    transferred = meta.get("transferred") or []
    if transferred:
        job.say(f"build: {len(transferred)} kernels run schedules tuned on another CPU; `tvmbert tune {job.config.model} "
                f"--adapt` re-measures them on this one and searches on where the time is (a few minutes)")


@dataclass
class TunedBuild:
    executable: object  # relax.VMExecutable of the entries
    tasks: list  # the non-trivial tasks of the entries
    schedules: dict[str, str]  # task name -> where its schedule came from: native, transferred from KEY, default
    prepack: object | None  # IRModule: PREPACK_ENTRY, the weight layouts the tuned kernels read
    databases: list[str]  # every database the records were looked up in

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
                  label: str | None = None) -> TunedBuild:
    """Compiles ``module`` for ``target`` with the target's tuning database applied (the records
    measured so far while a tune is running), other CPUs' records where it has none, and default
    schedules for what no database covers (dlight's on GPUs, cpu_schedules' on CPUs)."""
    import tvm
    from tvm import relax

    live = tuning_db.tuning_active(log_dir)
    if live:
        say(f"{announce or 'compile'}: a tuning run is writing to {log_dir}; building with the records measured so far")
    catalog = Catalog(log_dir, target.key, warn=lambda message: say(f"warning: {message}"), live=live,
                      cores=target.config.get("num-cores"))
    module = catalog.prefer_measured_layouts(module, target)
    tasks = [t for t in tuning_db.extract_tasks(module, target, entries) if not t.trivial]
    schedules, database = catalog.schedules(tasks)
    if announce:
        say(f"{announce}: {target.key}, {summary(schedules)} ({log_dir})")
    tvm_target = target.tvm_target()
    with tvm_target:
        with database:
            module = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(module)
        module = (_default_gpu_schedules() if target.is_gpu else default_cpu_schedules())(module)
        if target.prepacks_weights:
            # A kernel tuned with a weight layout of its own starts by repacking the weight; that
            # step becomes a kernel apart, lifted out of main into PREPACK_ENTRY, run once by build.
            module = tvm.transform.Sequential([relax.transform.SplitLayoutRewritePreproc(),
                                               relax.transform.LiftTransformParams()])(module)
    prepack = tuning_db.entry_module(module, PREPACK_ENTRY)
    try:
        executable = tvm.compile(tuning_db.entry_module(module, *entries), tvm_target)
    except Exception as exc:
        raise StageFailed(f"TVM build{' of ' + label if label else ''} for {target.key} failed: {str(exc).splitlines()[-1]}") from exc
    return TunedBuild(executable, tasks, schedules, prepack, catalog.read())


def device_modules(module) -> list[dict]:
    """What device code the library carries: a CUDA or HIP module per GPU build, with its code size."""
    found = []
    for imported in module.imports:
        if imported.kind not in ("llvm", "relax.VMExecutable"):
            assembly = imported.inspect_source("asm") if imported.kind == "hip" else ""
            found.append({
                "kind": imported.kind,
                "source_bytes": len(imported.inspect_source("")),
                "assembly_bytes": len(assembly),
                "isa": next((line.split('"')[1] for line in assembly.splitlines() if ".amdgcn_target" in line), None),
            })
        found.extend(device_modules(imported))
    return found


def _default_gpu_schedules():
    """dlight's rules for kernels the database has no schedule for; tuned ones are left alone."""
    from tvm.s_tir import dlight

    return dlight.ApplyDefaultSchedule(
        dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(), dlight.gpu.GeneralReduction(), dlight.gpu.Fallback()
    )


def _transform_params(transform, params: dict) -> dict:
    """Runs weight transforms (optimize's lifted ones, then the tuned kernels' layouts) once, so
    the library gets its weights ready-made. On the build machine's CPU, for any CPU: a build for
    another one (or a GPU) must not run code compiled for it here."""
    import tvm
    from tvm import relax

    if transform is None:
        return params
    vm = relax.VirtualMachine(tvm.compile(transform, tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    outputs = vm[PREPACK_ENTRY]([tvm.runtime.tensor(w) for w in params.values()])
    return {f"w{i:04d}": out.numpy() for i, out in enumerate(outputs)}

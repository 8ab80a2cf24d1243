"""Stage 5: compile for the target with the tuning database applied; export library + params."""

from __future__ import annotations

import re
import time

from tvmbert.core.artifacts import Artifact
from tvmbert.core.families import FAMILIES
from tvmbert.deploy.loader import LIBRARY_FILE
from tvmbert.deploy.weights import PARAMS_FILE, load_params, save_params
from tvmbert.frontend import models
from tvmbert.ir.files import load_module
from tvmbert.ir.tasks import entry_module, inference_module
from tvmbert.kernels import KERNELS
from tvmbert.passes.kernel_calls import kernels_in
from tvmbert.stages.cached import CachedStage
from tvmbert.stages.job import Job
from tvmbert.stages.optimize import optimize, pipeline
from tvmbert.tuning import database
from tvmbert.tuning.compile import CUDA_GRAPH_BUILTIN, WEIGHT_LAYOUT_ENTRY, compile_tuned


def build(job: Job, force: bool = False) -> Artifact:
    job.check_memory()  # compiling it, and running it where verify and bench do: before any stage's work
    optimized = job.upstream("optimize", optimize)
    log_dir = job.log_dir()
    cuda_graph = job.config.cuda_graph and job.target.kind == "cuda"
    stage = CachedStage(job, "build", optimize=optimized.fingerprint, target=job.target.config, cuda_graph=cuda_graph,
                        databases=database.state(database.log_roots(job.log_root)))
    if hit := stage.reused(force):
        _suggest(job, hit.meta)
        return hit
    job.target.check_toolchain()

    optimized_module = load_module(optimized.path)
    started = time.perf_counter()
    compiled = compile_tuned(inference_module(optimized_module, job.target), job.target, log_dir, job.say,
                             announce="build", cuda_graph=cuda_graph)
    params = load_params(job.stage_dir("convert") / PARAMS_FILE)
    for transform in (entry_module(optimized_module, WEIGHT_LAYOUT_ENTRY), compiled.weight_layouts):
        params = _transform_params(transform, params)
    meta = {
        "artifact": str(stage.path / LIBRARY_FILE),
        "target": job.target.config,
        "target_key": job.target.key,
        "database": str(log_dir),
        "databases_read": compiled.databases,
        "databases_missing": compiled.missing,  # this target's folders (the user's, the shipped) that do not exist
        "tasks_total": len(compiled.tasks),
        "tasks_tuned": len(compiled.tasks) - len(compiled.untuned),
        "untuned": compiled.untuned,
        "transferred": compiled.transferred,
        "schedules": compiled.schedules,
        "build_seconds": round(time.perf_counter() - started, 2),
        "outputs": optimized.meta.get("outputs") or [],
        "packing": optimized.meta.get("packing"),  # a packed build's shape and position rule (packing.py)
        "random_weights": optimized.meta.get("random_weights", []),  # --allow-random-weights: drawn, not the model's
        "device_modules": device_modules(compiled.executable.mod),
        "cuda_graph": CUDA_GRAPH_BUILTIN in compiled.executable.as_text(),  # the forward replays a captured CUDA graph
        "gpu_kernels": gpu_kernels(compiled.executable, models.sizes(job.source).layers) if job.target.is_gpu else None,
    }
    for kernel in KERNELS:  # calls of our kernels: no task, nothing to tune
        if found := kernels_in(optimized_module, kernel.attribute):
            meta[f"{kernel.name}_kernels"] = found
            if kernel.instructions_in is not None:  # the proof that the library holds its instructions
                meta[f"{kernel.name}_instructions"] = kernel.instructions_in(compiled.executable)
    # Of our kernels this build's passes call, those the family's graph cannot take, and why.
    in_pipeline = {kernel.name for kernel in KERNELS if kernel.graph_pass in pipeline(job)}
    meta["kernels_not_applied"] = {name: why for name, why in FAMILIES[job.source.family].kernels_not_applied.items()
                                   if name in in_pipeline and f"{name}_kernels" not in meta}
    with stage.writing(meta) as tmp:
        compiled.executable.export_library(str(tmp / LIBRARY_FILE))
        meta["weight_bytes"] = save_params(tmp / PARAMS_FILE, params, job.weights_pool)  # stage.json is written after this block
    _suggest(job, meta)
    _say_without_kernels(job)
    return stage.written(meta)


def _suggest(job: Job, meta: dict) -> None:
    """What would make this build faster, said after every build (a cached one too)."""
    _suggest_adapt(job, meta)
    if not_applied := meta.get("kernels_not_applied"):
        reasons = "; ".join(f"{name} ({why})" for name, why in not_applied.items())
        job.say(f"build: of our kernels, these do not apply to {job.source.family}, whose layers run TVM's schedules there "
                f"instead: {reasons}")


def _say_without_kernels(job: Job) -> None:
    """A CPU without AVX2 and FMA runs none of our hand kernels: said once, as it is built, so that
    a slow build on an old CPU or a VM's baseline model (x86-64-v2, qemu64) is not taken for
    tvmbert's speed."""
    if job.target.kind == "llvm" and not job.target.fp32_lanes:
        job.say(f"build: no hand-written kernel runs on {job.target.key}: they need AVX2 with FMA (or AVX-512), which it "
                f"lacks, so every kernel runs TVM's schedules; on a CPU with them the fp32 weight matmuls, attention and "
                f"layer norms run on ours (about 2x the default schedules at bert-base 1 x 16: docs/benchmarks.md)")


def _suggest_adapt(job: Job, meta: dict) -> None:
    transferred = meta.get("transferred") or []
    if transferred:
        job.say(f"build: {len(transferred)} kernels run schedules tuned on another CPU; `tvmbert tune {job.config.model} "
                f"--adapt` re-measures them on this one and searches on where the time is (a few minutes)")


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


# A kernel's own definition in CUDA source, and the instructions that run on tensor cores:
# WMMA's C++ API and PTX's mma / wgmma (warp-group MMA, sm_90a).
GLOBAL_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^;{]*\)\s*\{')
TENSOR_CORE_CODE = re.compile(r"\bwmma::|\bw?mma\.(?:sync|sp|mma_async)")
VM_CALL = re.compile(r"^\s*call\s+(\S+)", re.MULTILINE)


def gpu_kernels(executable, layers: int) -> dict:
    """The device kernels one forward launches (each call of a kernel function of the VM, times
    the device kernels it launches), per encoder layer (the embeddings' and head's included), and
    those whose code runs on tensor cores."""
    sources = [imported.inspect_source("") for imported in _imports(executable.mod) if imported.kind == "cuda"]
    bodies: dict[str, str] = {}
    for source in sources:
        found = list(GLOBAL_KERNEL.finditer(source))
        for match, following in zip(found, [*found[1:], None]):
            bodies[match.group(1)] = source[match.end():following.start() if following else len(source)]
    launched = 0
    for called in VM_CALL.findall(executable.as_text()):
        launched += sum(1 for name in bodies if re.fullmatch(rf"{re.escape(called)}_kernel(?:_\d+)?", name))
    return {"launched_per_forward": launched, "per_layer": round(launched / max(layers, 1), 1), "device_kernels": len(bodies),
            "tensor_core": sorted(name for name, body in bodies.items() if TENSOR_CORE_CODE.search(body))}


def _imports(module):
    for imported in module.imports:
        yield imported
        yield from _imports(imported)


def _transform_params(transform, params: dict) -> dict:
    """Runs weight transforms (optimize's lifted ones, then the tuned kernels' layouts) once, so
    the library gets its weights ready-made. On the build machine's CPU, for any CPU: a build for
    another one (or a GPU) must not run code compiled for it here."""
    import tvm
    from tvm import relax

    if transform is None:
        return params
    vm = relax.VirtualMachine(tvm.compile(transform, tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    outputs = vm[WEIGHT_LAYOUT_ENTRY]([tvm.runtime.tensor(w) for w in params.values()])
    return {f"w{i:04d}": out.numpy() for i, out in enumerate(outputs)}

"""Stage 2: the exported program into Relax IR, with the weights kept apart as named parameters."""

from __future__ import annotations

from tvmbert.core.artifacts import Artifact
from tvmbert.core.errors import StageFailed, first_line
from tvmbert.deploy.weights import PARAMS_FILE, save_params
from tvmbert.frontend.conversions import dtype_preserving_ops
from tvmbert.ir.files import PROGRAM_FILE, save_module
from tvmbert.passes.bounded_takes import bounded_takes
from tvmbert.stages.cached import CachedStage
from tvmbert.stages.job import Job
from tvmbert.stages.trace import trace


def convert(job: Job, force: bool = False) -> Artifact:
    traced = job.upstream("trace", trace)
    stage = CachedStage(job, "convert", trace=traced.fingerprint)
    if hit := stage.reused(force):
        return hit
    job.say("convert: torch.export program -> Relax IR")
    import torch
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    program = torch.export.load(traced.file(PROGRAM_FILE))
    try:
        module = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                       custom_convert_map=dtype_preserving_ops())
    except Exception as exc:
        raise StageFailed(f"Relax import failed: {first_line(exc)}") from exc
    module, params = relax.frontend.detach_params(bounded_takes()(module))
    # num_input tells Relax passes which parameters are user inputs and which are weights.
    inputs = len(traced.meta["inputs"])
    module["main"] = module["main"].with_attr("num_input", inputs)
    names = [var.name for var in module["main"].params[inputs:]]
    weights = {name: tensor.numpy() for name, tensor in zip(names, params["main"])}
    meta = {"weights": len(weights), "weight_bytes": int(sum(w.nbytes for w in weights.values())), "outputs": traced.meta["outputs"],
            "packing": traced.meta.get("packing"), "random_weights": traced.meta.get("random_weights", [])}
    with stage.writing(meta) as tmp:
        save_module(module, tmp)
        save_params(tmp / PARAMS_FILE, weights, job.weights_pool)
    return stage.written(meta)

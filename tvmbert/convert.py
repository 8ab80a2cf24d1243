"""Stage 2: the exported program into Relax IR, with the weights kept apart as named parameters."""

from __future__ import annotations

import numpy as np

from . import artifacts
from .artifacts import Artifact
from .errors import StageFailed
from .job import Job
from .trace import PROGRAM_FILE, trace

MODULE_FILE = "module.json"  # the exact IR, read back by the next stage
SCRIPT_FILE = "module.py"  # the same IR as TVMScript, for people
PARAMS_FILE = "params.npz"


def convert(job: Job, force: bool = False) -> Artifact:
    traced = job.upstream("trace", trace)
    fp = artifacts.fingerprint(stage="convert", trace=traced.fingerprint)
    path = job.stage_dir("convert")
    if not force and (hit := artifacts.cached("convert", path, fp)):
        job.say(f"convert: cached ({path})")
        return hit
    job.say("convert: torch.export program -> Relax IR")
    import torch
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    program = torch.export.load(traced.file(PROGRAM_FILE))
    try:
        module = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True,
                                       custom_convert_map=dtype_preserving_matmuls())
    except Exception as exc:
        raise StageFailed(f"Relax import failed: {str(exc).splitlines()[0]}") from exc
    module, params = relax.frontend.detach_params(module)
    # num_input tells Relax passes which parameters are user inputs and which are weights.
    inputs = len(job.source.inputs)
    module["main"] = module["main"].with_attr("num_input", inputs)
    names = [var.name for var in module["main"].params[inputs:]]
    weights = {name: tensor.numpy() for name, tensor in zip(names, params["main"])}
    meta = {"weights": len(weights), "weight_bytes": int(sum(w.nbytes for w in weights.values())), "outputs": traced.meta["outputs"]}
    with artifacts.writing("convert", path, fp, meta) as tmp:
        save_module(module, tmp)
        save_params(tmp / PARAMS_FILE, weights)
    return Artifact("convert", path, fp, {"fingerprint": fp, **meta}, cached=False)


def dtype_preserving_matmuls() -> dict:
    """TVM 0.27's importer gives every matmul out_dtype="float32", which silently turns a float64
    model into a mixed one that does not even type-check; these keep the inputs' dtype."""
    from tvm import relax

    def matmul(node, importer):
        lhs, rhs = (importer.env[arg] for arg in node.args[:2])
        return importer.block_builder.emit(relax.op.matmul(lhs, rhs))

    def addmm(node, importer):
        bias, lhs, rhs = (importer.env[arg] for arg in node.args[:3])
        alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        emit = importer.block_builder.emit
        dtype = bias.ty.dtype
        product = emit(relax.op.matmul(lhs, rhs))
        if alpha != 1:
            product = emit(relax.op.multiply(product, relax.const(alpha, dtype)))
        if beta != 1:
            bias = emit(relax.op.multiply(bias, relax.const(beta, dtype)))
        return emit(relax.op.add(bias, product)) if beta != 0 else product

    return {"matmul.default": matmul, "mm.default": matmul, "bmm.default": matmul, "addmm.default": addmm}


def save_module(module, folder) -> None:
    import tvm

    artifacts.write_text(folder / MODULE_FILE, tvm.ir.save_json(module))
    artifacts.write_text(folder / SCRIPT_FILE, module.script(show_meta=False))


def load_module(folder):
    import tvm

    return tvm.ir.load_json((folder / MODULE_FILE).read_text())


BFLOAT16_SUFFIX = "__bfloat16"  # npz has no bfloat16: such arrays are stored as their uint16 bits


def save_params(path, weights: dict[str, np.ndarray]) -> None:
    """Ordered as the function's weight parameters; npz keeps the insertion order."""
    stored = {
        (f"{name}{BFLOAT16_SUFFIX}" if array.dtype.name == "bfloat16" else name):
        (array.view(np.uint16) if array.dtype.name == "bfloat16" else array)
        for name, array in weights.items()
    }
    with open(path, "wb") as handle:
        np.savez(handle, **stored)


def load_params(path) -> dict[str, np.ndarray]:
    import ml_dtypes

    with np.load(path) as data:
        return {
            name.removesuffix(BFLOAT16_SUFFIX): data[name].view(ml_dtypes.bfloat16) if name.endswith(BFLOAT16_SUFFIX) else data[name]
            for name in data.files
        }

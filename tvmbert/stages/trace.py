"""Stage 1: torch.export of the model in eval mode with the example inputs."""

from __future__ import annotations

import contextlib
import io
import logging
import platform

from tvmbert.core import artifacts
from tvmbert.core.artifacts import Artifact
from tvmbert.core.config import torch_dtype
from tvmbert.core.errors import InputError, StageFailed, first_line
from tvmbert.deploy import packing
from tvmbert.frontend import models
from tvmbert.frontend.packed_attention import load_packed
from tvmbert.ir.files import PROGRAM_FILE
from tvmbert.stages.cached import CachedStage
from tvmbert.stages.job import Job


def versions() -> dict:
    import torch
    import transformers
    import tvm

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tvm": tvm.__version__, "python": platform.python_version()}


def trace(job: Job, force: bool = False) -> Artifact:
    import torch

    batch, seq_len = job.inputs.shape
    if job.packed:
        model = load_packed(job.source, torch_dtype(job.config.dtype), job.config.seed)
        inputs = packed_example(job, model.positions)
    else:
        model, inputs = None, job.inputs.tensors
    meta = {
        "model": job.source.name,
        "model_key": job.source.key,
        "config_hash": job.source.fingerprint,
        "seed": job.config.seed,
        "dtype": job.config.dtype,
        "family": job.source.family,
        "task": job.source.task,
        "inputs": {name: {"shape": list(t.shape), "dtype": "int64"} for name, t in inputs.items()},
        "versions": versions(),
    }
    if job.packed:
        meta["packing"] = {"batch": batch, "seq_len": seq_len, "tokens": job.config.tokens, "positions": model.positions}
    stage = CachedStage(job, "trace", model=job.source.fingerprint, seed=job.config.seed, dtype=job.config.dtype,
                        inputs=[t.tolist() for t in inputs.values()], versions=meta["versions"],
                        **({"packing": meta["packing"]} if job.packed else {}))
    if hit := stage.reused(force):
        return hit
    job.check_memory()
    packed = f", packed: {job.config.tokens} tokens" if job.packed else ""
    job.say(f"trace: exporting {job.source.name} ({batch} x {seq_len}{packed}, {job.config.dtype}) with torch.export")
    model = model or models.load(job.source, torch_dtype(job.config.dtype), job.config.seed)
    try:
        with torch.no_grad(), _fake_tensor_log_quiet():
            program = torch.export.export(model, tuple(inputs.values()))
    except Exception as exc:
        raise _export_failure(job, model, inputs, exc) from exc
    if model.random_weights:  # --allow-random-weights: every later artifact and report carries them
        meta["random_weights"] = list(model.random_weights)
    meta["outputs"] = [
        {"name": name, "shape": list(spec.shape), "dtype": str(spec.dtype).replace("torch.", "")}
        for name, spec in zip(model.output_names, _output_specs(program))
    ]
    # Serialized in memory first: torch's zip writer aborts the process when the disk fills up.
    program_bytes = io.BytesIO()
    torch.export.save(program, program_bytes)
    with stage.writing(meta) as tmp:
        (tmp / PROGRAM_FILE).write_bytes(program_bytes.getbuffer())
        artifacts.write_json(tmp / "inputs.json", {n: t.tolist() for n, t in inputs.items()})
    return stage.written(meta)


@contextlib.contextmanager
def _fake_tensor_log_quiet():
    """torch logs a traceback of its own for an op that fails while exporting, before raising;
    the error we raise from it says what happened in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export_failure(job: Job, model, inputs: dict, exc: Exception) -> Exception:
    """Bad input when the user's directory is the model as transformers saved it and transformers'
    own model fails on the example too (a config.json whose sizes its modules cannot run, e.g. a
    pooler narrower than the hidden states); export's failure else (a preset, or a packed build's
    attention, are ours)."""
    import torch

    name = job.source.name
    if job.source.preset is None and not job.packed:
        try:
            with torch.no_grad():
                model(*inputs.values())
        except Exception as eager:  # noqa: BLE001 - whatever the model's own code raises
            return InputError(f"'{name}': transformers' own {type(model.model).__name__} fails on it, before any compiling "
                              f"({first_line(eager)}): its config.json describes a model transformers cannot run")
    return StageFailed(f"torch.export failed for {name}: {first_line(exc)}")


def packed_example(job: Job, positions: dict) -> dict:
    """The example inputs packed (torch tensors by name, in the packed build's order): rows cut
    from the back until their tokens fit the capacity."""
    import torch

    batch, seq_len = job.inputs.shape
    rows = {name: t.numpy() for name, t in job.inputs.tensors.items()}
    arrays = packing.pack(rows, packing.fitting_lengths(batch, seq_len, job.config.tokens), batch, seq_len, job.config.tokens, positions)
    return {name: torch.from_numpy(arrays[name]) for name in packing.input_names(job.source.inputs)}


def _output_specs(program):
    nodes = {node.name: node for node in program.graph.nodes}
    for spec in program.graph_signature.output_specs:
        yield nodes[spec.arg.name].meta["val"]

"""A built model, loaded: the library, its ready-made weights on the device, and a call.

Every input is checked before it reaches the library: TVM's ``take`` does no bounds check, so an
id past the vocabulary reads whatever memory follows the embeddings (NaN, plausible garbage, or
a segfault). A packed build (packing.py) takes the same padded rows: they are packed here, and
its per-token outputs come back padded, zero after each row's length.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tvmbert.core.artifacts import Artifact
from tvmbert.core.errors import InputError
from tvmbert.core.families import TASKS
from tvmbert.deploy import packing
from tvmbert.ir.files import LIBRARY_FILE, PARAMS_FILE, load_params


def _load_library(path: Path):
    """Loads the library from a private copy: the dynamic loader hands back a library it already
    loaded from the same path (or the same file), so a process that rebuilt a model in place (same
    folder, new kernels and weight layouts) would otherwise run the old kernels on the new
    weights. The copies stay until the process exits: a deleted copy's inode could be reused by
    the next one, which the loader would take for the library it already has."""
    import tvm

    folder = Path(tempfile.mkdtemp(prefix="tvmbert-lib-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    private = folder / path.name
    shutil.copyfile(path, private)
    return tvm.runtime.load_module(str(private))


def check_inputs(arrays, shape: tuple[int, int], limits: dict[str, int]) -> list[np.ndarray]:
    """The inputs (named and ordered by ``limits``) as int64 arrays of the build's shape, each
    value in [0, its limit), or an InputError that says which value is out of it."""
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) != len(limits):
        raise InputError(f"a built model takes {len(limits)} inputs ({', '.join(limits)}), got {len(arrays)}")
    checked = []
    for (name, limit), array in zip(limits.items(), arrays):
        if not np.issubdtype(array.dtype, np.integer):
            raise InputError(f"{name} must hold integers, got {array.dtype}")
        if array.shape != tuple(shape):
            raise InputError(f"{name} has shape {list(array.shape)}; this build takes {list(shape)} (build one with --batch/--seq-len)")
        bad = np.argwhere((array < 0) | (array >= limit))
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            allowed = "0 or 1" if name == "attention_mask" else f"in [0, {limit})"
            raise InputError(f"{name} holds {array[where]} at {list(where)}: it must be {allowed}")
        checked.append(array.astype(np.int64, copy=False))
    return checked


class CompiledModel:
    def __init__(self, built: Artifact, job):
        """``job`` (the one ``built`` came from) says the device, and the shape and id ranges
        the inputs are checked against."""
        import tvm
        from tvm import relax

        if built.meta.get("amx_kernels"):  # before loading: the first AMX instruction needs it
            from tvmbert.kernels.amx import request_permission

            try:
                request_permission()
            except OSError as exc:
                raise InputError(str(exc)) from None
        device = job.target.device()
        self.device = device
        self.shape = job.inputs.shape
        self.limits = job.source.input_limits
        self.packing = built.meta.get("packing")  # None: a padded build
        per_token = TASKS[job.source.task].per_token
        self.per_token = [output["name"] in per_token for output in built.meta["outputs"]]
        self.vm = relax.VirtualMachine(_load_library(built.file(LIBRARY_FILE)), device)
        self.main = self.vm["main"]
        weights = list(load_params(built.file(PARAMS_FILE)).values())
        on_device = {}  # equal weights (ALBERT's shared layer) are one tensor on the device
        for weight in weights:
            if id(weight) not in on_device:
                on_device[id(weight)] = tvm.runtime.tensor(weight, device)
        self.weights = [on_device[id(weight)] for weight in weights]

    def _feeds(self, arrays) -> tuple[list[np.ndarray], list[int] | None]:
        """The checked inputs as main takes them, and the row lengths of a packed build."""
        checked = check_inputs(arrays, self.shape, self.limits)
        if self.packing is None:
            return checked, None
        rows = dict(zip(self.limits, checked))
        row_lengths = [int(n) for n in packing.lengths(rows[packing.MASK], self.shape)]
        shape = (self.packing["batch"], self.packing["seq_len"], self.packing["tokens"])
        packing.check_fits(rows[packing.MASK], row_lengths, *shape)
        packed = packing.pack(rows, row_lengths, *shape, self.packing["positions"])
        return [packed[name] for name in packing.input_names(tuple(self.limits))], row_lengths

    def to_device(self, arrays) -> list:
        """Checked inputs on the device (InputError for any value the model has no row for)."""
        import tvm

        return [tvm.runtime.tensor(np.ascontiguousarray(a), self.device) for a in self._feeds(arrays)[0]]

    def run_on_device(self, device_inputs: list):
        """The timed call: inputs already on the device, outputs left there."""
        return self.main(*device_inputs, *self.weights)

    def __call__(self, arrays) -> list[np.ndarray]:
        """Outputs as a padded build gives them: a packed build's per-token ones back in rows."""
        import tvm

        feeds, row_lengths = self._feeds(arrays)
        outputs = self.run_on_device([tvm.runtime.tensor(np.ascontiguousarray(a), self.device) for a in feeds])
        if hasattr(outputs, "numpy"):  # a single output comes back bare, not in a tuple
            outputs = [outputs]
        outputs = [out.numpy() for out in outputs]
        if row_lengths is None:
            return outputs
        return [packing.unpack(out, row_lengths, self.shape[1]) if per_token else out for out, per_token in zip(outputs, self.per_token)]

    def sync(self) -> None:
        self.device.sync()

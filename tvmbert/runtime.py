"""A built model, loaded: the library, its ready-made weights on the device, and a call."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .artifacts import Artifact
from .build import LIBRARY_FILE
from .convert import PARAMS_FILE, load_params


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


class CompiledModel:
    def __init__(self, built: Artifact, device):
        import tvm
        from tvm import relax

        self.device = device
        self.vm = relax.VirtualMachine(_load_library(built.file(LIBRARY_FILE)), device)
        self.main = self.vm["main"]
        self.weights = [tvm.runtime.tensor(w, device) for w in load_params(built.file(PARAMS_FILE)).values()]

    def to_device(self, arrays) -> list:
        import tvm

        return [tvm.runtime.tensor(np.ascontiguousarray(a), self.device) for a in arrays]

    def run_on_device(self, device_inputs: list):
        """The timed call: inputs already on the device, outputs left there."""
        return self.main(*device_inputs, *self.weights)

    def __call__(self, arrays) -> list[np.ndarray]:
        outputs = self.run_on_device(self.to_device(arrays))
        if hasattr(outputs, "numpy"):  # a single output comes back bare, not in a tuple
            outputs = [outputs]
        return [out.numpy() for out in outputs]

    def sync(self) -> None:
        self.device.sync()

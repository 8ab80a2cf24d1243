"""A built model, loaded: the library, its ready-made weights on the device, and a call.

Every input is checked before it reaches the library: TVM's ``take`` does no bounds check, so an
id past the vocabulary reads whatever memory follows the embeddings (NaN, plausible garbage, or
a segfault). A packed build (packing.py) takes the same padded rows: they are packed here, and
its per-token outputs come back padded, zero after each row's length.
"""

from __future__ import annotations

import numpy as np

from tvmbert.core.artifacts import Artifact
from tvmbert.core.families import TASKS
from tvmbert.deploy import packing
from tvmbert.deploy.inputs import check_inputs
from tvmbert.deploy.loader import LIBRARY_FILE, load_library
from tvmbert.deploy.weights import PARAMS_FILE, load_params


class CompiledModel:
    def __init__(self, built: Artifact, job):
        """``job`` (the one ``built`` came from) says the device, and the shape and id ranges
        the inputs are checked against."""
        import tvm
        from tvm import relax

        device = job.target.device()
        self.device = device
        self.shape = job.inputs.shape
        self.limits = job.source.input_limits
        self.packing = built.meta.get("packing")  # None: a padded build
        per_token = TASKS[job.source.task].per_token
        self.per_token = [output["name"] in per_token for output in built.meta["outputs"]]
        library = load_library(built.file(LIBRARY_FILE), built.meta["target"], amx=bool(built.meta.get("amx_kernels")))
        self.vm = relax.VirtualMachine(library, device)
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

"""The files stages hand each other: program, IR, weights and library; here so that runtime,
tune and training read them without importing the stage that wrote them."""

from __future__ import annotations

import numpy as np

from tvmbert.core import artifacts

PROGRAM_FILE = "program.pt2"  # trace: the torch.export program
MODULE_FILE = "module.json"  # the exact IR, read back by the next stage
SCRIPT_FILE = "module.py"  # the same IR as TVMScript, for people
PARAMS_FILE = "params.npz"  # convert's weights; build's, ready-made for the library
LIBRARY_FILE = "model.so"  # build: the compiled library


def save_module(module, folder) -> None:
    import tvm

    artifacts.write_text(folder / MODULE_FILE, tvm.ir.save_json(module))
    artifacts.write_text(folder / SCRIPT_FILE, module.script(show_meta=False))


def load_module(folder):
    import tvm

    return tvm.ir.load_json((folder / MODULE_FILE).read_text())


BFLOAT16_SUFFIX = "__bfloat16"  # npz has no bfloat16: such arrays are stored as their uint16 bits
# A weight equal to an earlier one is stored as an empty array under NAME + this + the earlier
# name: ALBERT's one layer is read by every layer, and each read gets its own prepacked copy.
SAME_AS = "__same_as__"


def save_params(path, weights: dict[str, np.ndarray]) -> int:
    """Ordered as the function's weight parameters (npz keeps the insertion order); each
    distinct array once. Returns the bytes of weights stored."""
    import hashlib

    first_of: dict[tuple, str] = {}
    stored = {}
    for name, array in weights.items():
        bits = array.view(np.uint16) if array.dtype.name == "bfloat16" else array
        content = (array.dtype.name, array.shape, hashlib.sha256(np.ascontiguousarray(bits).data).hexdigest())
        if content in first_of:
            stored[f"{name}{SAME_AS}{first_of[content]}"] = np.zeros(0, np.uint8)
            continue
        first_of[content] = name
        stored[f"{name}{BFLOAT16_SUFFIX}" if array.dtype.name == "bfloat16" else name] = bits
    with open(path, "wb") as handle:
        np.savez(handle, **stored)
    return sum(array.nbytes for array in stored.values())


def load_params(path) -> dict[str, np.ndarray]:
    """The weights by name, in order; equal weights are one array, under each of their names."""
    import ml_dtypes

    weights: dict[str, np.ndarray] = {}
    with np.load(path) as data:
        for key in data.files:
            if SAME_AS in key:
                name, earlier = key.split(SAME_AS)
                weights[name] = weights[earlier]
            elif key.endswith(BFLOAT16_SUFFIX):
                weights[key.removesuffix(BFLOAT16_SUFFIX)] = data[key].view(ml_dtypes.bfloat16)
            else:
                weights[key] = data[key]
    return weights


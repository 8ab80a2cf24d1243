"""The files stages hand each other: program, IR, weights and library; here so that runtime,
tune and training read them without importing the stage that wrote them."""

from __future__ import annotations

import numpy as np

from . import artifacts

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

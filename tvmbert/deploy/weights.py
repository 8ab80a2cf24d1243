"""Weights as files: an npz in the order a library's main takes them, each distinct array once,
bfloat16 stored as its bits (npz has no bfloat16). Build writes them, the loaded model and the
package read them."""

from __future__ import annotations

import numpy as np

PARAMS_FILE = "params.npz"  # convert's weights; build's, ready-made for the library
BFLOAT16_SUFFIX = "__bfloat16"  # npz has no bfloat16: such arrays are stored as their uint16 bits
# A weight equal to an earlier one is stored as an empty array under NAME + this + the earlier
# name: ALBERT's one layer is read by every layer, and each read gets its own copy in its kernel's layout.
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
    weights: dict[str, np.ndarray] = {}
    with np.load(path) as data:
        for key in data.files:
            if SAME_AS in key:
                name, earlier = key.split(SAME_AS)
                weights[name] = weights[earlier]
            elif key.endswith(BFLOAT16_SUFFIX):
                weights[key.removesuffix(BFLOAT16_SUFFIX)] = from_bits(data[key], "bfloat16")
            else:
                weights[key] = data[key]
    return weights



def from_bits(array: np.ndarray, dtype: str) -> np.ndarray:
    """An array read from npz as the dtype it was written in: bfloat16 comes back as its bits."""
    if dtype != "bfloat16":
        return array
    import ml_dtypes

    return array.view(ml_dtypes.bfloat16)

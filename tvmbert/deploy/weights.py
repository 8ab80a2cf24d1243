"""Weights as files: an npz in the order a library's main takes them, each distinct array once,
bfloat16 stored as its bits (npz has no bfloat16). Build writes them, the loaded model and the
package read them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

PARAMS_FILE = "params.npz"  # convert's weights; build's, ready-made for the library
BFLOAT16_SUFFIX = "__bfloat16"  # npz has no bfloat16: such arrays are stored as their uint16 bits
# A weight equal to an earlier one is stored as an empty array under NAME + this + the earlier
# name: ALBERT's one layer is read by every layer, and each read gets its own copy in its kernel's layout.
SAME_AS = "__same_as__"


def save_params(path, weights: dict[str, np.ndarray], pool=None) -> int:
    """Ordered as the function's weight parameters (npz keeps the insertion order); each
    distinct array once. Returns the bytes of weights stored.

    With ``pool`` (a folder), the file is a hard link to one copy there per content: every shape
    of a model converts to the same weights and most builds lay them out alike, so a package's
    buckets would otherwise hold the model's weights twice per bucket in the work directory."""
    import hashlib

    first_of: dict[tuple, str] = {}
    stored = {}
    whole = hashlib.sha256()
    for name, array in weights.items():
        bits = array.view(np.uint16) if array.dtype.name == "bfloat16" else array
        content = (array.dtype.name, array.shape, hashlib.sha256(np.ascontiguousarray(bits).data).hexdigest())
        whole.update(repr((name, content)).encode())
        if content in first_of:
            stored[f"{name}{SAME_AS}{first_of[content]}"] = np.zeros(0, np.uint8)
            continue
        first_of[content] = name
        stored[f"{name}{BFLOAT16_SUFFIX}" if array.dtype.name == "bfloat16" else name] = bits
    nbytes = sum(array.nbytes for array in stored.values())
    shared = Path(pool) / f"{whole.hexdigest()[:32]}.npz" if pool is not None else None
    if shared is not None and _linked_from_pool(path, shared):
        return nbytes
    with open(path, "wb") as handle:
        np.savez(handle, **stored)
    if shared is not None:
        _add_to_pool(path, shared)
    return nbytes


def _linked_from_pool(path: Path, shared: Path) -> bool:
    try:
        os.link(shared, path)
        return True
    except OSError:  # not pooled yet, or a file system without hard links
        return False


def _add_to_pool(path: Path, shared: Path) -> None:
    """Links ``path`` into the pool (atomically: a link under a scratch name, then renamed), and
    drops the pooled copies no artifact links any more. A pool that cannot be written costs only
    the sharing."""
    scratch = shared.with_name(f".{shared.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, scratch)
        scratch.replace(shared)
    except OSError:
        return
    finally:
        scratch.unlink(missing_ok=True)
    for pooled in shared.parent.glob("*.npz"):
        try:
            if pooled.stat().st_nlink == 1:  # only the pool holds it: its artifacts were replaced or removed
                pooled.unlink()
        except OSError:  # another process removed it first
            pass


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

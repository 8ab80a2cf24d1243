"""Inputs checked before they reach a library: TVM's ``take`` does no bounds check, so an id past
the vocabulary reads whatever memory follows the embeddings (NaN, plausible garbage, or a
segfault). The loaded model and the package check with these."""

from __future__ import annotations

import numpy as np

from tvmbert.core.errors import InputError

MASK_INPUT = "attention_mask"  # 0 or 1; padded with 0 (the others with their "pad" value)


def check_range(name: str, array: np.ndarray, limit: int) -> None:
    """Every value of ``array`` in [0, limit), or an InputError that says which one is not."""
    bad = np.argwhere((array < 0) | (array >= limit))
    if len(bad):
        where = tuple(int(i) for i in bad[0])
        allowed = "0 or 1" if name == MASK_INPUT else f"in [0, {limit})"
        raise InputError(f"{name} holds {array[where]} at {list(where)}: it must be {allowed}")


def is_torch(value) -> bool:
    return type(value).__module__.split(".")[0] == "torch"


def as_integers(name: str, value) -> np.ndarray:
    """A NumPy array, a list or a torch tensor of integers as int64."""
    if is_torch(value):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == object or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must hold integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def check_inputs(arrays, shape: tuple[int, int], limits: dict[str, int]) -> list[np.ndarray]:
    """The inputs (named and ordered by ``limits``) as int64 arrays of the build's shape, each
    value in [0, its limit), or an InputError that says which value is out of it."""
    if len(arrays) != len(limits):
        raise InputError(f"a built model takes {len(limits)} inputs ({', '.join(limits)}), got {len(arrays)}")
    checked = []
    for (name, limit), value in zip(limits.items(), arrays):
        array = as_integers(name, value)
        if array.shape != tuple(shape):
            raise InputError(f"{name} has shape {list(array.shape)}; this build takes {list(shape)} (build one with --batch/--seq-len)")
        check_range(name, array, limit)
        checked.append(array)
    return checked

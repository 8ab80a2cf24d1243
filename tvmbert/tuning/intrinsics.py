"""TVM's tensor intrinsics, registered per target kind: the package's own __init__ parses every
backend's (~40 s), and schedules, tuning and records need only their target's."""

from __future__ import annotations

import threading
from contextlib import contextmanager

TENSOR_INTRINSICS = "tvm.s_tir.tensor_intrin"
_STACK_SWAP = threading.Lock()


def tensor_intrinsics_package_alone() -> None:
    """``tvm.s_tir.tensor_intrin`` without its __init__, which registers every backend's intrinsics
    by parsing their TVMScript (40 s per tuning run on 2 Zen 3 cores, 18 of them CUDA's): each
    module is imported where it is used (register_tensor_intrinsics)."""
    import importlib.util
    import sys

    if TENSOR_INTRINSICS not in sys.modules:
        sys.modules[TENSOR_INTRINSICS] = importlib.util.module_from_spec(importlib.util.find_spec(TENSOR_INTRINSICS))


def register_tensor_intrinsics(kind: str | None) -> None:
    """Registers the tensor intrinsics a target kind's schedules may use (its modules of
    ``tvm.s_tir.tensor_intrin``), before a schedule or TuneContext imports the package, and before a
    database of its records is read: a record's trace names its intrinsics, and one that names an
    unregistered intrinsic is unreadable. ``None`` (a folder that names no kind): none."""
    import importlib
    import sys

    from tvmbert.core.targets import KINDS

    if kind not in KINDS:
        return
    tensor_intrinsics_package_alone()
    missing = [f"{TENSOR_INTRINSICS}.{name}" for name in KINDS[kind].tensor_intrinsics]
    missing = [name for name in missing if name not in sys.modules]
    if missing:
        with _frames_without_source():
            for name in missing:
                importlib.import_module(name)


@contextmanager
def _frames_without_source():
    """``inspect.stack()`` without each frame's source line. TVMScript's ``T.prim_func`` takes the
    caller's stack to resolve names, and reads only frames, names and a class line (where there is
    no line, it is not in a class: no intrinsic module defines one in a class). Looking a frame's
    line up maps its file to a module, and a file that does not exist (the import system's
    ``<frozen ...>`` frames) scans all of ``sys.modules`` each time, thousands of modules with
    torch loaded: most of a CUDA build's time went there (CHANGELOG.md, 2026-11-27)."""
    import inspect
    import sys

    def stack(context=1):
        frame, frames = sys._getframe(1), []
        while frame is not None:
            frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None))
            frame = frame.f_back
        return frames

    with _STACK_SWAP:  # two threads' swaps, interleaved, could leave this one in place for good
        full = inspect.stack
        inspect.stack = stack
        try:
            yield
        finally:
            inspect.stack = full

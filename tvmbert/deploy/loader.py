"""A compiled library into this process: only where this CPU can run it, with the permissions its
kernels need, and from a private copy. The one way the loaded model and the package load one."""

from __future__ import annotations

import atexit
import ctypes
import platform
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from tvmbert.core import targets
from tvmbert.core.errors import InputError

LIBRARY_FILE = "model.so"  # build: the compiled library


def check_cpu(what, target_config: dict, error: type[InputError] = InputError, amx: bool = False) -> None:
    """Refuses, with ``error``, code compiled for instruction sets this CPU lacks (``what``: the
    library or the caller, as the message names it; ``amx``: it holds AMX kernels): its first call
    would kill the process (SIGILL), not raise."""
    missing = targets.missing_host_features(target_config, amx)
    if missing:
        raise error(f"{what}: code for '{targets.describe_config(target_config)}' uses {', '.join(missing)}, and this CPU "
                    f"({targets.describe_host()}) lacks {'it' if len(missing) == 1 else 'them'}: running it would kill the process "
                    f"(illegal instruction){amx_note(missing)}. Build for this CPU (--target llvm), "
                    f"or for one it has every instruction set of")


def amx_note(missing: list[str]) -> str:
    """Why AMX can be missing on a CPU LLVM names as one with AMX."""
    return f" (AMX: {targets.AMX_NOT_GRANTED})" if targets.AMX_TILE in missing else ""


def load_library(path: Path, target_config: dict, amx: bool = False, error: type[InputError] = InputError):
    """The library at ``path``, built for ``target_config`` (a TVM JSON target), loaded: refused
    with ``error`` where this CPU lacks an instruction set the code was compiled for (it would die
    on SIGILL at its first call) or the kernel does not grant AMX to a library with AMX kernels.

    From a private copy: the dynamic loader hands back a library it already loaded from the same
    path (or the same file), so a process that rebuilt a model in place (same folder, new kernels
    and weight layouts) would otherwise run the old kernels on the new weights. The copies stay
    until the process exits: a deleted copy's inode could be reused by the next one, which the
    loader would take for the library it already has."""
    targets.use_every_core()
    import tvm

    check_cpu(path, target_config, error, amx)
    if amx:  # before loading: the first AMX instruction needs it
        try:
            request_amx_permission()
        except OSError as exc:
            raise error(f"{path}: its kernels run on AMX: {exc}") from None
    folder = Path(tempfile.mkdtemp(prefix="tvmbert-lib-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    private = folder / path.name
    shutil.copyfile(path, private)
    return tvm.runtime.load_module(str(private))


@lru_cache(maxsize=1)
def request_amx_permission() -> None:
    """Linux gives a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA), once per process; without it the first AMX instruction is an illegal instruction
    (SIGILL) that kills the process. TVM's runtime does not ask, so whoever loads a library with
    AMX kernels does, before the first call."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError("AMX kernels run on x86-64 Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(targets.SYS_ARCH_PRCTL, targets.ARCH_REQ_XCOMP_PERM, targets.XFEATURE_XTILEDATA) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "this CPU or kernel does not grant AMX (arch_prctl ARCH_REQ_XCOMP_PERM failed): "
                             "a library built with AMX kernels (--dtype bfloat16, or int8 for a CPU with AMX-INT8) cannot run here")

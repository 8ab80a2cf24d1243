"""Tools a GPU build needs on this machine, checked before TVM fails deep inside codegen."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tvmbert.core.errors import ToolchainError

# Debian's rocm-device-libs puts the bitcode here; TVM looks under $ROCM_PATH/amdgcn/bitcode.
DEBIAN_ROCM_PATH = "/usr/lib/x86_64-linux-gnu"


def _llvm_major() -> int:
    import tvm

    return int(str(tvm.target.codegen.llvm_version_major()))


def check_cuda() -> None:
    """nvcc, and TVM told to compile with it: TVM 0.27 compiles CUDA with NVRTC by default, which
    needs the cuda-bindings package (neither TVM nor tvmbert depends on it) and fails at the first kernel
    without it. A TVM_CUDA_COMPILE_MODE the user set wins."""
    if shutil.which("nvcc") is None:
        raise ToolchainError("building for cuda needs nvcc on PATH: install the CUDA toolkit (Debian: nvidia-cuda-toolkit)")
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")


def check_rocm() -> None:
    major = _llvm_major()
    if not (shutil.which(f"ld.lld-{major}") or shutil.which(f"ld.lld-{major}.0")):
        raise ToolchainError(
            f"building for rocm needs ld.lld-{major}, matching TVM's LLVM {major} (older lld fails with "
            f"'unknown abi version'): install the Debian package lld-{major}"
        )
    if "ROCM_PATH" not in os.environ and (Path(DEBIAN_ROCM_PATH) / "amdgcn" / "bitcode").is_dir():
        os.environ["ROCM_PATH"] = DEBIAN_ROCM_PATH
    rocm_path = os.environ.get("ROCM_PATH", "/opt/rocm")
    if not (Path(rocm_path) / "amdgcn" / "bitcode").is_dir():
        raise ToolchainError(
            f"building for rocm needs the AMDGPU device bitcode under {rocm_path}/amdgcn/bitcode: install the "
            f"Debian package rocm-device-libs (then ROCM_PATH={DEBIAN_ROCM_PATH} is found by itself) or set ROCM_PATH"
        )

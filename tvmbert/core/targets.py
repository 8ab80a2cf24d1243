"""Friendly target names in, TVM 0.27 JSON targets out; the key that names a tuning database."""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from tvmbert.core import toolchain
from tvmbert.core.errors import InputError

DEFAULT_CUDA_ARCH = "sm_90"
DEFAULT_ROCM_MCPU = "gfx906"


@dataclass(frozen=True)
class TargetKind:
    """What tvmbert knows of one TVM target kind: adding a kind is one entry in KINDS."""

    name: str
    device: str  # TVM's device type (tvm.device(device, 0)), as MetaSchedule's runners name it too
    key_option: str  # the option whose value names the target's database key: llvm-<mcpu>
    defaults: dict[str, Callable[[], object]]  # options filled in, in this order, when not given
    llvm_triple: Callable[[], str] | None = None  # mcpu is an LLVM CPU of this triple (unless mtriple says): checked
    toolchain: Callable[[], None] | None = None  # checks the tools a build needs on this machine

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"


KINDS = {kind.name: kind for kind in (
    TargetKind("llvm", "cpu", "mcpu", {"mcpu": lambda: host_mcpu(), "num-cores": lambda: cpu_count()},
               llvm_triple=lambda: _host_triple()),
    TargetKind("cuda", "cuda", "arch", {"arch": lambda: _local_cuda_arch() or DEFAULT_CUDA_ARCH},
               toolchain=toolchain.check_cuda),
    TargetKind("rocm", "rocm", "mcpu", {"mcpu": lambda: DEFAULT_ROCM_MCPU}, llvm_triple=lambda: "amdgcn-amd-amdhsa",
               toolchain=toolchain.check_rocm),
)}


@dataclass(frozen=True)
class TargetSpec:
    """A target resolved once: its TVM description, its database key, and where it runs."""

    text: str
    config: dict  # the TVM JSON target
    key: str  # e.g. llvm-sapphirerapids, cuda-sm_90, rocm-gfx906

    @property
    def kind(self) -> str:
        return self.config["kind"]

    @property
    def is_gpu(self) -> bool:
        return KINDS[self.kind].is_gpu

    @property
    def device_type(self) -> str:
        return KINDS[self.kind].device

    @property
    def prepacks_weights(self) -> bool:
        """CPU kernels read weights in the order their tiles want, repacked once at build time;
        GPU kernels take them as they are (dlight and the GPU rules stage tiles in shared memory)."""
        return not self.is_gpu

    def tvm_target(self):
        import tvm

        if self.is_gpu:
            # Host code stays generic x86-64: the GPU machine's CPU is not this one.
            return tvm.target.Target(self.config, host={"kind": "llvm"})
        return tvm.target.Target(self.config)

    def device(self):
        import tvm

        return tvm.device(self.device_type, 0)

    def device_present(self) -> bool:
        return not self.is_gpu or bool(self.device().exist)

    def check_toolchain(self) -> None:
        """Before TVM fails deep inside codegen: the tools a build for this kind needs."""
        check = KINDS[self.kind].toolchain
        if check is not None:
            check()


# Read once, before any thread pool could pin this process to fewer cores.
HOST_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
# TVM's runtime otherwise takes half the cores, assuming hyperthreads; we want every core.
os.environ.setdefault("TVM_NUM_THREADS", str(len(HOST_CPUS)))


def cpu_count() -> int:
    return len(HOST_CPUS)


@lru_cache(maxsize=1)
def host_mcpu() -> str:
    """A CPU name LLVM accepts for this host (the wheel's LLVM refuses mcpu=native)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    # Virtual machines often hide the CPU model, and LLVM then guesses an older core; the
    # feature flags are the truth: AMX + AVX512-FP16 is Sapphire Rapids or later.
    if {"amx_tile", "avx512_fp16"} <= flags:
        return "sapphirerapids"
    import tvm

    detected = str(tvm.target.codegen.llvm_get_system_cpu())
    return detected if detected and detected != "generic" else "x86-64"


def _legacy_options(text: str) -> tuple[str, dict]:
    """Parses 'cuda -arch=sm_90' style strings, which TVM 0.27 itself no longer accepts."""
    parts = shlex.split(text)
    options = {}
    for part in parts[1:]:
        if not part.startswith("-") or "=" not in part:
            raise InputError(f"target '{text}': cannot read option '{part}' (expected -name=value)")
        name, value = part.lstrip("-").split("=", 1)
        options[name] = int(value) if value.isdigit() else value
    return parts[0], options


def resolve(text: str) -> TargetSpec:
    text = text.strip()
    if text.startswith("{"):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"target JSON is malformed: {exc}") from None
        if not isinstance(config, dict) or not isinstance(config.get("kind"), str) or config["kind"] not in KINDS:
            raise InputError(f"target JSON needs \"kind\" one of {', '.join(KINDS)}")
        kind, options = config.pop("kind"), config
    else:
        try:
            kind, options = _legacy_options(text) if text else ("", {})
        except ValueError as exc:  # shlex: an unclosed quote
            raise InputError(f"target '{text}' cannot be read: {exc}") from None
    if kind not in KINDS:
        raise InputError(f"unknown target '{text}': use one of {', '.join(KINDS)}, e.g. 'cuda -arch=sm_90', or a JSON dict")
    facts = KINDS[kind]
    for option, default in facts.defaults.items():
        if option not in options:
            options[option] = default()
    config = {"kind": kind, **options}
    try:
        import tvm

        tvm.target.Target(config)
    except Exception as exc:  # TVM raises several types for a bad attribute
        raise InputError(f"target '{text}' is not valid for TVM: {str(exc).splitlines()[-1]}") from None
    if facts.llvm_triple is not None:
        _check_llvm_cpu(text, config, facts.llvm_triple)
    return TargetSpec(text=text, config=config, key=_key(kind, options[facts.key_option]))


def _check_llvm_cpu(text: str, config: dict, default_triple: Callable[[], str]) -> None:
    """LLVM takes a CPU name it does not know with a warning, and builds generic code: exit 0 and
    slow kernels, tuned into a database named after a CPU that does not exist."""
    import tvm
    from tvm.target import codegen

    triple = str(config.get("mtriple") or default_triple())
    cpu = str(config["mcpu"])
    if not codegen.llvm_is_valid_cpu(cpu, triple):
        known = [str(name) for name in codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm", "mtriple": triple}))]
        close = difflib.get_close_matches(cpu, known, n=3)
        raise InputError(f"target '{text}': LLVM knows no CPU '{cpu}' for {triple}"
                         + (f"; did you mean {', '.join(close)}?" if close else f" (known: {', '.join(known[:12])}, ...)"))


def _key(kind: str, detail) -> str:
    """Names the target's folders under tuning_logs/ and build/: whatever the detail, no '/' or '..'."""
    return f"{kind}-{re.sub(r'[^A-Za-z0-9_+-]', '_', str(detail))}"


def _local_cuda_arch() -> str | None:
    import tvm

    device = tvm.cuda(0)
    if not device.exist:
        return None
    return "sm_" + device.compute_version.replace(".", "")


def _host_triple() -> str:
    from tvm.target import codegen

    return str(codegen.llvm_get_system_triple())

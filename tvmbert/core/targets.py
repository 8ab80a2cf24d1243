"""Friendly target names in, TVM 0.27 JSON targets out; the key that names a tuning database."""

from __future__ import annotations

import ctypes
import difflib
import json
import os
import platform
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

from tvmbert.core import hosts, toolchain
from tvmbert.core.errors import InputError

DEFAULT_CUDA_ARCH = "sm_90"
DEFAULT_ROCM_MCPU = "gfx906"
AMX_BF16 = "amx-bf16"  # LLVM's name of the feature the bf16 AMX kernel needs
AMX_INT8 = "amx-int8"  # and the int8 one's
AMX_TILE = "amx-tile"  # the feature both need: without it LLVM turns every AMX feature off
SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ARCH_REQ_XCOMP_PERM = 158, 0x1021, 0x1023  # x86-64 Linux
XFEATURE_XTILEDATA = 18  # the xsave component of AMX's tiles, which Linux hands a process only on request
AMX_NOT_GRANTED = "this kernel or VM does not grant AMX's tile state: Linux before 5.16, or a VM that hides AMX"


@dataclass(frozen=True)
class TargetKind:
    """What tvmbert knows of one TVM target kind: adding a kind is one entry in KINDS."""

    name: str
    device: str  # TVM's device type (tvm.device(device, 0)), as MetaSchedule's runners name it too
    key_option: str  # the option whose value names the target's database key: llvm-<mcpu>
    defaults: dict[str, Callable[[], object]]  # options filled in, in this order, when not given
    host: Callable[[], dict] | None = None  # the options naming this machine's device, where the user names none
    llvm_triple: Callable[[], str] | None = None  # mcpu is an LLVM CPU of this triple (unless mtriple says): checked
    toolchain: Callable[[], None] | None = None  # checks the tools a build needs on this machine
    tensor_intrinsics: tuple[str, ...] = ()  # the modules of tvm.s_tir.tensor_intrin its schedules may tensorize with
    device_limits: Callable[[dict], dict] | None = None  # a GPU's limits for a config (GPU_ARCHITECTURES): what its rules read

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"


KINDS = {kind.name: kind for kind in (
    TargetKind("llvm", "cpu", "mcpu", {"num-cores": lambda: cpu_count()}, host=lambda: host_config(),
               llvm_triple=lambda: _host_triple(), tensor_intrinsics=("x86",)),
    TargetKind("cuda", "cuda", "arch", {"arch": lambda: _local_cuda_arch() or DEFAULT_CUDA_ARCH},
               toolchain=toolchain.check_cuda, tensor_intrinsics=("cuda",), device_limits=lambda config: _gpu_limits(config["arch"], _local_cuda_limits, "cuda")),
    TargetKind("rocm", "rocm", "mcpu", {"mcpu": lambda: DEFAULT_ROCM_MCPU}, llvm_triple=lambda: "amdgcn-amd-amdhsa",
               toolchain=toolchain.check_rocm, tensor_intrinsics=("rocm",), device_limits=lambda config: _gpu_limits(config["mcpu"], lambda arch: None, "rocm")),
)}

# What MetaSchedule's GPU rules (AutoBind, MultiLevelTiling, VerifyGPUCode) and dlight read of a
# GPU target: without max_threads_per_block, TuneContext fails ("missing attribute"), and TVM's
# own defaults for a bare kind are guesses (no shared memory size for CUDA, 256 threads a block for ROCm).
CUDA_LIMITS = ("max_threads_per_block", "max_num_threads", "max_shared_memory_per_block", "thread_warp_size",
               "registers_per_block", "l2_cache_size_bytes")
_CDNA = {"max_threads_per_block": 1024, "max_num_threads": 1024, "max_shared_memory_per_block": 65536, "thread_warp_size": 64}
# Per architecture, where no device of it is here: TVM's tag for a GPU of it (its limits are
# taken, not its arch: sm_90a code would not run on every sm_90 part), or the limits themselves
# where TVM has no tag (none for AMD GPUs; AMD's specs: 1024 threads, 64 KiB LDS, wavefronts of 64).
GPU_ARCHITECTURES: dict[str, str | dict] = {
    "sm_70": "nvidia/nvidia-v100",
    "sm_75": "nvidia/nvidia-t4",
    "sm_80": "nvidia/nvidia-a100",
    "sm_86": "nvidia/nvidia-a10",
    "sm_89": "nvidia/geforce-rtx-4090",
    "sm_90": "nvidia/nvidia-h100",
    "gfx906": _CDNA, "gfx908": _CDNA, "gfx90a": _CDNA, "gfx942": _CDNA,
}
# An architecture the table lacks: limits every CUDA GPU since Volta, and every AMD GCN/CDNA one, meets.
GPU_FALLBACK_LIMITS = {
    "cuda": {"max_threads_per_block": 1024, "max_num_threads": 1024, "max_shared_memory_per_block": 49152,
             "thread_warp_size": 32, "registers_per_block": 65536},
    "rocm": _CDNA,
}


@dataclass(frozen=True)
class TargetSpec:
    """A target resolved once: its TVM description, its database key, and where it runs."""

    text: str
    config: dict  # the TVM JSON target
    key: str  # e.g. llvm-sapphirerapids, cuda-sm_90, rocm-gfx906
    amx_withheld: bool = False  # this host's CPU has AMX, which this process cannot use: built without it

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
    def lays_out_weights(self) -> bool:
        """CPU kernels read weights in the order their tiles want, laid out once at build time;
        GPU kernels take them as they are (dlight and the GPU rules stage tiles in shared memory)."""
        return not self.is_gpu

    def has_features(self, *features: str) -> bool:
        """Whether code for this target may use every one of LLVM's ``features`` (avx2, fma,
        avx512f, amx-bf16, ...), from its mcpu and mattr: false for GPUs."""
        if self.kind != "llvm":
            return False
        from tvm.target.codegen import target_has_features

        return bool(target_has_features(list(features), self.tvm_target()))

    @cached_property
    def fp32_lanes(self) -> int:
        """fp32 lanes of our kernels' vectors: 16 with AVX-512, 8 with AVX2 and FMA, 0 without
        (our fp32 kernels then do not apply)."""
        if self.has_features("avx512f"):
            return 16
        return 8 if self.has_features("avx2", "fma") else 0

    @cached_property
    def int8_lanes(self) -> int:
        """int32 lanes of the int8 kernel's vectors: its ``vpmaddubsw`` on 512 bits needs AVX512-BW
        (an AVX512F-only CPU, Knights Landing, runs the 256-bit one), on 256 bits AVX2; 0 without
        (--dtype int8 is refused)."""
        if self.has_features("avx512bw"):
            return 16
        return 8 if self.has_features("avx2", "fma") else 0

    @cached_property
    def int8_instruction(self) -> str:
        """The int8 kernel's dot product (``kernels/int8.py``'s DOT_PRODUCTS): ``vpdpbusd`` where
        the target has VNNI at the kernel's width (AVX512-VNNI on 512 bits, AVX-VNNI on 256), else
        ``vpmaddubsw`` (with ``vpmaddwd``), whose pairs of weights are bounded not to saturate."""
        vnni = "avx512vnni" if self.int8_lanes == 16 else "avxvnni"
        return "vpdpbusd" if self.int8_lanes and self.has_features(vnni) else "vpmaddubsw"

    @cached_property
    def has_amx_bf16(self) -> bool:
        """AMX-BF16 beside AVX-512 and AVX512-BF16, as on every CPU that has AMX: the kernels
        around the tiles (attention, layer norm, the epilogues) are built and tested for AVX-512's
        vectors with it (the attention kernel rounds to bf16 by ``vcvtneps2bf16``), never for a VM
        that hides AVX-512 and shows AMX."""
        return self.has_features(AMX_BF16, "avx512f", "avx512bf16")

    @cached_property
    def has_amx_int8(self) -> bool:
        """Whether int8 weight matmuls run on AMX tiles (``kernels/amx.int8_kernel``), their rows
        quantized as for AVX512-VNNI (every AMX CPU has it); the matmuls AMX's tiles do not fit
        run on ``int8_instruction``."""
        return self.int8_instruction == "vpdpbusd" and self.int8_lanes == 16 and self.has_features(AMX_INT8)

    def no_amx_message(self) -> str:
        why = f" usable here ({AMX_NOT_GRANTED})" if self.amx_withheld else ""
        return (f"--dtype bfloat16 needs a CPU with AMX-BF16 and AVX-512 with AVX512-BF16 (Intel Sapphire Rapids or later), and target '{self.key}' "
                f"has none{why}: without it TVM's bf16 kernels convert every value to fp32 in their inner loops and run "
                f"slower than --dtype float32 (AVX512-BF16 alone measured slower than fp32 too). Use --dtype float32, "
                f"or --dtype float16 for half the weight bytes")

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


def cpu_count() -> int:
    return len(HOST_CPUS)


def use_every_core() -> None:
    """TVM's runtime otherwise takes half the cores, assuming hyperthreads; we want every core.
    Read when its thread pool starts: the CLI, a Job and the library loader call this first, and
    a TVM_NUM_THREADS the user set wins."""
    os.environ.setdefault("TVM_NUM_THREADS", str(len(HOST_CPUS)))


# x86 instruction sets LLVM may emit anywhere in code for a target that enables them (it
# vectorizes with what it is given), and the flag /proc/cpuinfo shows for each: what a host's
# database key names. What a library needs of the CPU that runs it is every instruction feature
# (``instruction_features``), not only these.
INSTRUCTION_SETS = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt", "avx": "avx",
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "movbe": "movbe",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512cd": "avx512cd",
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma", "avx512vp2intersect": "avx512_vp2intersect",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq", "avxvnni": "avx_vnni",
}
# Every LLVM feature the host target takes from the flags: the instruction sets above, those LLVM
# emits only where asked (GFNI for byte shifts, AES, SHA) and AMX's.
HOST_FEATURES = {
    **INSTRUCTION_SETS, "sse4a": "sse4a", "cx16": "cx16", "sahf": "lahf_lm", "gfni": "gfni", "vaes": "vaes",
    "vpclmulqdq": "vpclmulqdq", "aes": "aes", "pclmul": "pclmulqdq", "sha": "sha_ni", "adx": "adx",
    AMX_TILE: "amx_tile", AMX_BF16: "amx_bf16", AMX_INT8: "amx_int8",
}
# LLVM's tuning features (X86.td's Tuning* definitions: fast-gather, slow-shld, prefer-256-bit,
# false-deps-popcnt, macrofusion, ermsb, ...) change how code is chosen and scheduled, never which
# instructions it may hold, and 64bit-mode is the mode every x86-64 target runs in. Every other
# feature LLVM attaches to a CPU is taken for an instruction set, whatever its name: one a newer
# LLVM adds (APX's egpr, avx10.2, movrs) is refused where the host lacks it, never run on trust.
TUNING_FEATURES = re.compile(r"(fast|faster|slow|false-deps|prefer|tuning|no-bypass-delay|use|lea|idivl-to|idivq-to)-.+"
                             r"|no-bypass-delay|macrofusion|branchfusion|vzeroupper|ermsb|fsrm|pad-short-functions"
                             r"|sbb-dep-breaking|allow-light-256-bit|64bit-mode")
GENERIC_CPUS = ("generic", "x86-64")  # LLVM's names when CPUID tells it nothing: the flags pick an x86-64 level
X86_64_LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64-v2")
WITHOUT, WITH = "_no-", "_with-"  # a host key's parts after the CPU name: llvm-znver4_no-avx512f


def host_flags() -> frozenset[str]:
    """The host's feature flags (``hosts.current``: this machine's, or TVMBERT_HOST's)."""
    return hosts.current().flags


def host_config() -> dict:
    """``mcpu`` and ``mattr`` of exactly what the host runs (``config_for_host``): the wheel's LLVM
    refuses mcpu=native, and a CPU's name alone claims more than a VM may give."""
    return config_for_host(hosts.current())


@lru_cache(maxsize=32)
def config_for_host(host: hosts.Host) -> dict:
    """``mcpu`` and ``mattr`` for exactly what ``host`` runs. The name is LLVM's own, except where
    a VM hides the model and the flags say more; the name's instruction sets the flags lack are
    taken off, those the flags list beyond the name put on (added first, so that a removal also
    takes off whatever depends on it). No mattr where the name fits."""
    flags = host.flags
    mcpu = host.llvm_cpu
    if {"amx_tile", "avx512_fp16"} <= flags:  # AMX + AVX512-FP16: Sapphire Rapids or later, whatever CPUID's model says
        mcpu = "sapphirerapids"
    elif mcpu in GENERIC_CPUS:
        mcpu = next((level for level in X86_64_LEVELS
                     if all(HOST_FEATURES[f] in flags for f in _features_of(level) & HOST_FEATURES.keys())), "x86-64")
    if not flags:  # no /proc/cpuinfo: LLVM's name is all there is
        return {"mcpu": mcpu}
    implied = _features_of(mcpu)
    added = {f for f, flag in HOST_FEATURES.items() if flag in flags and f not in implied}
    removed = {f for f, flag in HOST_FEATURES.items() if flag not in flags and f in implied}
    mattr = [f"+{f}" for f in _roots(added, taken_off=False)] + [f"-{f}" for f in _roots(removed, taken_off=True)]
    return {"mcpu": mcpu, "mattr": mattr} if mattr else {"mcpu": mcpu}


def host_grants_amx() -> bool:
    """Whether this process can have AMX's tile state (asked, not requested): Linux 5.16 or later
    on a CPU it shows AMX on (the host's flags, and the real CPU's where the host is simulated).
    LLVM names a CPU by its model, so a VM that hides AMX, or an older kernel, still gets
    ``sapphirerapids``, whose AMX code would die on its first tile instruction."""
    return "amx_tile" in hosts.runnable_flags() and _kernel_grants_amx()


@lru_cache(maxsize=1)
def _kernel_grants_amx() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    supported = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0:
        return False  # before Linux 5.16: no AMX for any process
    return bool(supported.value >> XFEATURE_XTILEDATA & 1)


def describe_host() -> str:
    """This host as the target it resolves to, for messages: 'llvm -mcpu=znver4 -mattr=-avx512f,-gfni'."""
    described = describe_config({"kind": "llvm", **host_config()})
    return described + (f", simulated by {hosts.HOST_VARIABLE}" if hosts.current().simulated else "")


def describe_config(config: dict) -> str:
    """A TVM JSON target as a user writes it: 'llvm -mcpu=skylake-avx512 -mattr=+avx2'."""
    options = [f"-{name}={','.join(value) if isinstance(value, list | tuple) else value}"
               for name, value in config.items() if name in ("mcpu", "mattr", "arch")]
    return " ".join([config.get("kind", "?"), *options])


def missing_host_features(config: dict, amx_kernels: bool = False) -> list[str]:
    """The instruction features (``instruction_features``) code compiled for ``config`` may use
    and this host's own target lacks (``runnable_features``), by LLVM's names: code built for them
    may die on SIGILL here, so any one refuses it. With ``amx_kernels`` (the library holds our AMX
    kernels), ``amx-tile`` too where this process cannot have AMX (``host_grants_amx``). Empty
    for GPU targets and other architectures."""
    triple = str(config.get("mtriple") or "x86_64")
    if config.get("kind") != "llvm" or not triple.startswith("x86_64"):
        return []
    amx = {AMX_TILE} if amx_kernels and not host_grants_amx() else set()
    if platform.machine() not in ("x86_64", "AMD64"):
        return sorted(amx)
    return sorted(instruction_features(config) - runnable_features(hosts.current()) | amx)


@lru_cache(maxsize=32)
def runnable_features(host: hosts.Host) -> frozenset[str]:
    """The instruction features code may use on ``host``: its own target's (``config_for_host``,
    what --target llvm builds for there), compared as LLVM's feature sets, not as /proc/cpuinfo's
    flags: LLVM knows instruction sets no flag table lists. A simulated host is bounded by this
    machine's CPU too, as far as flags say (HOST_FEATURES): LLVM's name of this CPU would refuse
    the instructions a presented CPU's name carries beyond it (a Zen's clzero on an Intel), which
    LLVM never emits on its own."""
    runnable = instruction_features({"kind": "llvm", **config_for_host(host)})
    real = hosts.real_flags()
    if host.simulated and real:
        runnable -= {feature for feature, flag in HOST_FEATURES.items() if flag not in real}
    return runnable


def instruction_features(config: dict) -> frozenset[str]:
    """LLVM's features of an llvm target less its tuning ones (TUNING_FEATURES): what code compiled
    for it may hold, and a CPU that runs it must have."""
    return frozenset(f for f in _llvm_features(json.dumps(config, sort_keys=True)) if not TUNING_FEATURES.fullmatch(f))


def compiled_instruction_sets(config: dict) -> frozenset[str]:
    """The instruction sets a key names (INSTRUCTION_SETS) code compiled for an llvm target may use."""
    return _llvm_features(json.dumps(config, sort_keys=True)) & INSTRUCTION_SETS.keys()


@lru_cache(maxsize=512)
def _llvm_features(config_json: str) -> frozenset[str]:
    import tvm
    from tvm.target import codegen

    config = json.loads(config_json)
    if config.get("kind") != "llvm":
        return frozenset()
    return frozenset(str(name) for name in codegen.llvm_get_cpu_features(tvm.target.Target(config)))


LIST_OPTIONS = ("mattr", "libs", "keys", "cl-opt")  # options TVM takes as lists: -mattr=+avx2,-amx-int8


def _legacy_options(text: str) -> tuple[str, dict]:
    """Parses 'cuda -arch=sm_90' style strings, which TVM 0.27 itself no longer accepts."""
    parts = shlex.split(text)
    options = {}
    for part in parts[1:]:
        if not part.startswith("-") or "=" not in part:
            raise InputError(f"target '{text}': cannot read option '{part}' (expected -name=value)")
        name, value = part.lstrip("-").split("=", 1)
        options[name] = value.split(",") if name in LIST_OPTIONS else int(value) if value.isdigit() else value
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
    # This host's CPU, as its flags say, unless the user named a CPU; AMX left to what this process
    # can use, unless the user named AMX too.
    on_host = facts.host is not None and facts.key_option not in options
    amx_named = any("amx" in str(e) for e in options.get("mattr", ()))
    if on_host:
        host = facts.host()
        options = {**host, **options, **({"mattr": [*host["mattr"], *options.get("mattr", ())]} if "mattr" in host else {})}
    for option, default in facts.defaults.items():
        if option not in options:
            options[option] = default()
    if facts.device_limits is not None:  # the user's own limits win
        options |= {name: value for name, value in facts.device_limits({"kind": kind, **options}).items() if name not in options}
    config = {"kind": kind, **options}
    try:
        import tvm

        tvm.target.Target(config)
    except Exception as exc:  # TVM raises several types for a bad attribute
        raise InputError(f"target '{text}' is not valid for TVM: {str(exc).splitlines()[-1]}") from None
    if facts.llvm_triple is not None:
        _check_llvm_cpu(text, config, facts.llvm_triple)
    if kind == "llvm" and config.get("mattr"):
        _check_llvm_features(text, config)
    key = llvm_key(config) if kind == "llvm" else _key(kind, options[facts.key_option])
    spec = TargetSpec(text=text, config=config, key=key)
    if on_host and not amx_named and not host_grants_amx() and spec.has_features(AMX_TILE):
        return TargetSpec(text=text, config={**config, "mattr": [*config.get("mattr", ()), f"-{AMX_TILE}"]}, key=key,
                          amx_withheld=True)
    return spec


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


def _check_llvm_features(text: str, config: dict) -> None:
    """LLVM ignores a feature it does not know with a warning: ``-mattr=-amx-int`` would build with
    AMX, exit 0. Each entry is +name or -name, and LLVM must turn it on when asked to."""
    import tvm
    from tvm.target import codegen

    unknown = []
    for entry in config["mattr"]:
        name = str(entry)[1:]
        if str(entry)[:1] not in "+-" or not name:
            unknown.append(str(entry))
            continue
        probe = {key: value for key, value in config.items() if key != "num-cores"} | {"mattr": [f"+{name}"]}
        if name not in {str(feature) for feature in codegen.llvm_get_cpu_features(tvm.target.Target(probe))}:
            unknown.append(str(entry))
    if unknown:
        raise InputError(f"target '{text}': -mattr names no feature LLVM knows in {', '.join(repr(e) for e in unknown)} "
                         f"(each entry +name or -name, e.g. -mattr=+avx2,-amx-int8)")


def llvm_key(config: dict) -> str:
    """``llvm-<mcpu>``, then the instruction sets (INSTRUCTION_SETS) the target's mattr takes off
    the CPU's name (``_no-``) or puts on (``_with-``), each named by the one that implies the rest:
    records tuned for AVX2 code on a Zen 4 whose AVX-512 is hidden live under
    ``llvm-znver4_no-avx512f``, never among the AVX-512 ones. ``cpu_of_key`` reads it back."""
    named = _features_of(config["mcpu"], (), config.get("mtriple")) & INSTRUCTION_SETS.keys()
    built = _features_of(config["mcpu"], tuple(config.get("mattr", ())), config.get("mtriple")) & INSTRUCTION_SETS.keys()
    return _key("llvm", config["mcpu"] + "".join(WITHOUT + f for f in _roots(named - built, taken_off=True))
                + "".join(WITH + f for f in _roots(built - named, taken_off=False)))


def kind_of_key(key: str) -> str | None:
    """The target kind a database key names (cuda-sm_90: cuda), None for a name that is no key."""
    kind = key.partition("-")[0]
    return kind if kind in KINDS else None


def cpu_of_key(key: str) -> dict | None:
    """The llvm target a database key names (``llvm_key``'s inverse), None for other kinds."""
    kind, _, rest = key.partition("-")
    if kind != "llvm" or not rest:
        return None
    mcpu, *parts = re.split(f"({WITHOUT}|{WITH})", rest)
    by_key = {_spelled(f): f for f in INSTRUCTION_SETS}  # the names as a key spells them (sse4_2)
    mattr = [("-" if sign == WITHOUT else "+") + by_key.get(name, name) for sign, name in zip(parts[::2], parts[1::2])]
    # Additions first, as host_config orders them: a removal then takes off what depends on it.
    return {"kind": "llvm", "mcpu": mcpu, **({"mattr": sorted(mattr, key=lambda e: e[0] == "-")} if mattr else {})}


@lru_cache(maxsize=256)
def _features_of(mcpu: str, mattr: tuple = (), triple: str | None = None) -> frozenset[str]:
    """The LLVM features code for ``mcpu`` with ``mattr`` may use."""
    import tvm
    from tvm.target import codegen

    config = {"kind": "llvm", "mcpu": mcpu, **({"mattr": list(mattr)} if mattr else {}), **({"mtriple": triple} if triple else {})}
    return frozenset(str(name) for name in codegen.llvm_get_cpu_features(tvm.target.Target(config)))


def _roots(features: set[str], taken_off: bool) -> list[str]:
    """The fewest of ``features`` that say them all to LLVM: taking a feature off takes off what
    needs it (-avx512f: every AVX-512 set), putting one on puts on what it needs (+avx2: avx)."""
    if taken_off:
        return sorted(f for f in features if not (_needs(f) & features))
    return sorted(f for f in features if not any(f in _needs(other) for other in features - {f}))


@lru_cache(maxsize=64)
def _needs(feature: str) -> frozenset[str]:
    """The host features LLVM turns on with ``feature`` (avx512bw needs avx512f, avx2, ...)."""
    return (_features_of("x86-64", (f"+{feature}",)) - _features_of("x86-64")) & HOST_FEATURES.keys() - {feature}


def _key(kind: str, detail) -> str:
    """Names the target's folders under tuning_logs/ and build/: whatever the detail, no '/' or '..'."""
    return f"{kind}-{_spelled(detail)}"


def _spelled(detail) -> str:
    return re.sub(r"[^A-Za-z0-9_+-]", "_", str(detail))


def _gpu_limits(arch: str, local: Callable[[str], dict | None], kind: str) -> dict:
    """The limits of a GPU of architecture ``arch``: this machine's GPU's where it is one (``local``),
    else from GPU_ARCHITECTURES, else GPU_FALLBACK_LIMITS. (TVM's ROCm target reads a present
    AMD GPU's limits itself.)"""
    here = local(arch)
    if here:
        return here
    known = GPU_ARCHITECTURES.get(arch)
    if isinstance(known, str):
        import tvm

        tagged = tvm.target.Target(known).attrs
        return {name: int(tagged[name]) for name in CUDA_LIMITS if name in tagged}
    return dict(known or GPU_FALLBACK_LIMITS[kind])


@lru_cache(maxsize=8)
def _local_cuda_limits(arch: str) -> dict | None:
    """This machine's CUDA GPU's limits, as its driver reports them, where it is of architecture ``arch``."""
    import tvm

    device = tvm.cuda(0)
    if not device.exist or "sm_" + device.compute_version.replace(".", "") != arch:
        return None
    threads = int(device.max_threads_per_block)
    limits = {"max_threads_per_block": threads, "max_num_threads": threads,
              "max_shared_memory_per_block": int(device.max_shared_memory_per_block), "thread_warp_size": int(device.warp_size),
              "registers_per_block": 65536}  # every architecture since Kepler's; TVM's device API has no getter for it
    l2 = int(device.l2_cache_size_bytes or 0)
    return limits | ({"l2_cache_size_bytes": l2} if l2 > 0 else {})


def _local_cuda_arch() -> str | None:
    import tvm

    device = tvm.cuda(0)
    if not device.exist:
        return None
    return "sm_" + device.compute_version.replace(".", "")


def _host_triple() -> str:
    from tvm.target import codegen

    return str(codegen.llvm_get_system_triple())


def vector_lanes(tvm_target, dtype_bits: int) -> int:
    """Lanes of ``dtype_bits`` in the widest vectors ``tvm_target`` has: 512 bits with AVX-512,
    256 with AVX, else 128 (TVM's llvm_get_vector_width answers 512 for every x86 CPU, AVX2-only
    and SSE-only ones too, unless the target sets vector-width)."""
    from tvm.target.codegen import llvm_get_vector_width, target_has_features

    width = int(tvm_target.attrs.get("vector-width", 0) or 0)
    if not width and tvm_target.kind.name == "llvm" and str(tvm_target.attrs.get("mtriple", "x86_64")).startswith("x86_64"):
        width = 512 if target_has_features("avx512f", tvm_target) else 256 if target_has_features("avx", tvm_target) else 128
    if not width:
        width = llvm_get_vector_width(tvm_target)
    return max((width if width > 0 else 128) // dtype_bits, 1)

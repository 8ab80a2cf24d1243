"""The CPU this process runs on, as LLVM names it and as Linux lists its flags: the machine's own,
or one presented by ``TVMBERT_HOST`` so that any host's decisions can be made and tested on any
x86 machine.

LLVM names a CPU from CPUID's family and model, and a name implies instruction sets a VM may hide
(a Zen 4 without AVX-512, a Sapphire Rapids without AMX): the flags are the truth, the name only
picks LLVM's scheduling model. ``KNOWN_HOSTS`` holds real hosts' (name, flags) pairs as Linux
shows them under KVM: what the tests resolve, and what ``TVMBERT_HOST=<name>`` presents to a whole
command. Adding a host is adding an entry.

A presented host decides what is built and which key its records go under; what this process may
run is still bounded by the real CPU's flags (``runnable_flags``): a simulation never leads to
SIGILL, it refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from tvmbert.core.errors import InputError

HOST_VARIABLE = "TVMBERT_HOST"  # a KNOWN_HOSTS name, or '<llvm cpu>:<flag> <flag> ...'


@dataclass(frozen=True)
class Host:
    """A CPU as the host target is resolved from it."""

    llvm_cpu: str  # LLVM's name for it (llvm_get_system_cpu), from CPUID's family and model
    flags: frozenset[str]  # its /proc/cpuinfo flags
    simulated: bool = False  # presented by TVMBERT_HOST, not read off this machine

    def describe(self) -> str:
        return f"{self.llvm_cpu}, simulated by {HOST_VARIABLE}" if self.simulated else self.llvm_cpu


def _flags(*groups: str) -> frozenset[str]:
    return frozenset(" ".join(groups).split())


# What every x86-64 host under KVM lists, and the groups real CPUs add to it.
_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 syscall nx "
         "lm constant_tsc rep_good nopl xtopology cpuid tsc_known_freq pni cx16 hypervisor lahf_lm")
_V2 = "ssse3 sse4_1 sse4_2 popcnt x2apic"
_V3 = "pclmulqdq fma movbe aes xsave avx f16c rdrand abm bmi1 avx2 bmi2 fsgsbase xsaveopt"
_AMD = ("mmxext fxsr_opt pdpe1gb rdtscp extd_apicid cmp_legacy cr8_legacy sse4a misalignsse 3dnowprefetch osvw topoext "
        "vmmcall rdseed adx smap clflushopt sha_ni xsavec xgetbv1 clzero xsaveerptr arat")
_ZEN3 = "invpcid clwb wbnoinvd umip pku ospke vaes vpclmulqdq rdpid fsrm"
_INTEL = ("ss ht pdpe1gb rdtscp arch_perfmon pclmulqdq pcid tsc_deadline_timer 3dnowprefetch ssbd ibrs ibpb stibp "
          "tsc_adjust smep erms invpcid rdseed adx smap clflushopt clwb sha_ni xsavec xgetbv1 xsaves arat umip pku ospke "
          "gfni vaes vpclmulqdq rdpid md_clear")
_AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
_ICELAKE_AVX512 = "avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
_SPR = "avx_vnni avx512_bf16 waitpkg cldemote movdiri movdir64b serialize tsxldtrk avx512_fp16"
_AMX = "amx_bf16 amx_tile amx_int8"

KNOWN_HOSTS = {
    # The issue-44 machine: AMD EPYC Genoa (family 25 model 17) under KVM with AVX-512 hidden.
    "zen4-avx512-hidden": Host("znver4", _flags(_BASE, _V2, _V3, _AMD, _ZEN3)),
    "zen4": Host("znver4", _flags(_BASE, _V2, _V3, _AMD, _ZEN3, _AVX512, _ICELAKE_AVX512, "gfni avx512_bf16")),
    "zen5": Host("znver5", _flags(_BASE, _V2, _V3, _AMD, _ZEN3, _AVX512, _ICELAKE_AVX512,
                                  "gfni avx512_bf16 avx_vnni avx512_vp2intersect movdiri movdir64b")),
    "zen3": Host("znver3", _flags(_BASE, _V2, _V3, _AMD, _ZEN3)),
    # AMD EPYC Naples (family 23 model 1), as a session's machine listed it.
    "zen1": Host("znver1", _flags(_BASE, _V2, _V3, _AMD)),
    "icelake-server": Host("icelake-server", _flags(_BASE, _V2, _V3, _INTEL, _AVX512, _ICELAKE_AVX512)),
    "sapphirerapids": Host("sapphirerapids", _flags(_BASE, _V2, _V3, _INTEL, _AVX512, _ICELAKE_AVX512, _SPR, _AMX)),
    "sapphirerapids-amx-hidden": Host("sapphirerapids", _flags(_BASE, _V2, _V3, _INTEL, _AVX512, _ICELAKE_AVX512, _SPR)),
    # AVX-512 turned off (for frequency, or by a migration-safe model) while AMX and AVX-VNNI stay.
    "sapphirerapids-avx512-hidden": Host("sapphirerapids", _flags(_BASE, _V2, _V3, _INTEL, _AMX,
                                                                  "avx_vnni waitpkg cldemote movdiri movdir64b serialize")),
    # A client core: AVX-VNNI on 256 bits, no AVX-512.
    "alderlake": Host("alderlake", _flags(_BASE, _V2, _V3, _INTEL, "avx_vnni waitpkg movdiri movdir64b serialize")),
    # KVM's x86-64-v2 model (SSE4.2, no AVX), which CPUID leaves LLVM nothing to name but x86-64.
    "x86-64-v2-vm": Host("x86-64", _flags(_BASE, _V2)),
    # QEMU's default CPU: SSE3, no SSSE3 or SSE4.
    "qemu64": Host("k8-sse3", _flags(_BASE)),
}


@lru_cache(maxsize=1)
def real_flags() -> frozenset[str]:
    """This machine's feature flags as Linux reports them (empty where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def parse(text: str) -> Host:
    """A host from ``TVMBERT_HOST``'s value: a KNOWN_HOSTS name, or '<llvm cpu>:<flags>'."""
    text = text.strip()
    if text in KNOWN_HOSTS:
        return Host(KNOWN_HOSTS[text].llvm_cpu, KNOWN_HOSTS[text].flags, simulated=True)
    cpu, colon, flags = text.partition(":")
    if not colon or not cpu.strip():
        raise InputError(f"{HOST_VARIABLE}='{text}': give a known host ({', '.join(KNOWN_HOSTS)}) or "
                         f"'<llvm cpu>:<flag> <flag> ...' as /proc/cpuinfo lists them")
    return Host(cpu.strip(), frozenset(flags.replace(",", " ").split()), simulated=True)


@lru_cache(maxsize=1)
def current() -> Host:
    """The host every 'this CPU' decision reads: TVMBERT_HOST's when set, else this machine's."""
    presented = os.environ.get(HOST_VARIABLE)
    return parse(presented) if presented else real()


@lru_cache(maxsize=1)
def real() -> Host:
    """This machine's CPU, whatever TVMBERT_HOST presents: what code run in this process is bounded by."""
    import tvm

    detected = str(tvm.target.codegen.llvm_get_system_cpu())
    return Host(detected if detected else "generic", real_flags())


def runnable_flags() -> frozenset[str]:
    """The flags code run in this process may rely on: the host's, and, for a simulated one, only
    those the real CPU has too."""
    host = current()
    return host.flags & real_flags() if host.simulated and real_flags() else host.flags

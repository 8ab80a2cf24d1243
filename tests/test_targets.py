"""Targets: friendly names in, TVM JSON out; GPU builds cross-compile with device code inside."""

from __future__ import annotations

import json

import pytest

from tvmbert.core import hosts, targets
from tvmbert.core.errors import InputError, ToolchainError

from helpers import UNRUNNABLE_CPU, assert_one_line_error


def test_llvm_gets_a_valid_host_cpu():
    spec = targets.resolve("llvm")
    assert spec.config["mcpu"] != "native"
    assert spec.key == targets.llvm_key(spec.config) and targets.cpu_of_key(spec.key)["mcpu"] == spec.config["mcpu"]
    assert targets.missing_host_features(spec.config) == []
    spec.tvm_target()


@pytest.mark.parametrize(
    "text, key",
    [
        ("cuda -arch=sm_80", "cuda-sm_80"),
        ("rocm", "rocm-gfx906"),
        ("rocm -mcpu=gfx90a", "rocm-gfx90a"),
        ('{"kind": "rocm", "mcpu": "gfx942"}', "rocm-gfx942"),
        ('{"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}', "llvm-skylake-avx512"),
    ],
)
def test_target_keys(text, key):
    assert targets.resolve(text).key == key


def test_mattr_takes_one_feature_or_a_list_and_the_kernels_follow_it():
    """TVM takes -mattr as a list: a single '+avx2' was refused as a string."""
    amx = targets.resolve("llvm -mcpu=sapphirerapids")
    without_amx = targets.resolve("llvm -mcpu=sapphirerapids -mattr=-amx-int8")
    without_vnni = targets.resolve("llvm -mcpu=sapphirerapids -mattr=-amx-int8,-avx512vnni")
    assert without_amx.config["mattr"] == ["-amx-int8"] and without_vnni.config["mattr"] == ["-amx-int8", "-avx512vnni"]
    assert amx.has_amx_int8 and not without_amx.has_amx_int8 and without_amx.int8_instruction == "vpdpbusd"
    assert without_vnni.int8_instruction == "vpmaddubsw" and not without_vnni.has_amx_int8
    assert not targets.resolve("llvm -mcpu=skylake-avx512 -mattr=+amx-int8").has_amx_int8  # AMX's rows are VNNI's
    # the AMX attention kernel rounds to bf16 by vcvtneps2bf16: every AMX CPU has AVX512-BF16, a target without it is refused
    assert targets.resolve("llvm -mcpu=sapphirerapids").has_amx_bf16
    assert not targets.resolve("llvm -mcpu=sapphirerapids -mattr=-avx512bf16").has_amx_bf16
    for typo in ("-amx-int", "amx-int8", "", "+avx2,+notafeature"):  # LLVM would ignore them, with a warning only
        with pytest.raises(InputError, match="-mattr names no feature LLVM knows"):
            targets.resolve(f"llvm -mcpu=sapphirerapids -mattr={typo}")


def test_an_amx_cpu_whose_tiles_this_process_cannot_have_builds_without_them(monkeypatch, present_host, tvmbert):
    """Linux before 5.16, or a kernel that withholds AMX: the flags show it, and AMX kernels built
    for it would die on their first tile instruction. The host's target leaves AMX out (int8 on
    vpdpbusd; bf16 refused, saying why); a CPU or AMX the user names is kept."""
    present_host("sapphirerapids")
    monkeypatch.setattr(targets, "host_grants_amx", lambda: False)
    host = targets.resolve("llvm")
    assert host.key == "llvm-sapphirerapids" and host.config["mattr"] == ["-amx-tile"] and host.amx_withheld
    assert not host.has_amx_bf16 and not host.has_amx_int8 and host.int8_instruction == "vpdpbusd"
    assert targets.resolve("llvm -mattr=+avx512vnni").config["mattr"] == ["+avx512vnni", "-amx-tile"]
    for named in ("llvm -mcpu=sapphirerapids", "llvm -mattr=+amx-int8"):
        spec = targets.resolve(named)
        assert spec.has_amx_int8 and not spec.amx_withheld, named
    assert_one_line_error(tvmbert("build", "bert-tiny", "--dtype", "bfloat16"), "AMX-BF16", "does not grant AMX's tile state")
    monkeypatch.setattr(targets, "host_grants_amx", lambda: True)
    granted = targets.resolve("llvm")
    assert granted.has_amx_int8 and "mattr" not in granted.config and not granted.amx_withheld


def test_amx_kernels_are_missing_where_this_process_cannot_have_amx(monkeypatch):
    """Whether the CPU, the kernel and the VM grant AMX is asked without requesting it."""
    if targets.host_flags():
        assert targets.host_grants_amx() <= ("amx_tile" in targets.host_flags())  # never where Linux shows no AMX
    config = {"kind": "llvm", "mcpu": "x86-64"}
    monkeypatch.setattr(targets, "host_grants_amx", lambda: False)
    assert targets.missing_host_features(config) == []
    assert targets.missing_host_features(config, amx_kernels=True) == ["amx-tile"]
    monkeypatch.setattr(targets, "host_grants_amx", lambda: True)
    assert targets.missing_host_features(config, amx_kernels=True) == []


@pytest.mark.parametrize("text", ["vulkan", "cuda arch", '{"kind": "tpu"}', "{not json", "llvm -mcpu='x"])
def test_bad_targets(text):
    with pytest.raises(InputError):
        targets.resolve(text)


@pytest.mark.parametrize("text, fragment", [
    ("llvm -mcpu=notacpu", "LLVM knows no CPU 'notacpu'"),
    ("llvm -mcpu=skylake-avx51", "did you mean skylake-avx512"),
    ("llvm -mcpu=../../../x", "LLVM knows no CPU '../../../x'"),
    ("rocm -mcpu=gfx9999", "LLVM knows no CPU 'gfx9999' for amdgcn"),
])
def test_a_cpu_llvm_does_not_know_is_refused(text, fragment):
    """LLVM itself only warns, and builds generic code."""
    with pytest.raises(InputError, match=fragment):
        targets.resolve(text)


def test_a_target_key_never_leaves_its_folder():
    key = targets.resolve("cuda -arch=sm_../../x").key
    assert "/" not in key and ".." not in key


@pytest.mark.parametrize("target, kind", [("cuda", "cuda"), ("rocm", "hip")])
def test_gpu_cross_compile_carries_device_code(tvmbert, target, kind):
    try:
        targets.resolve(target).check_toolchain()
    except ToolchainError as missing:  # `.ci/run` installs them (Debian packages need root); `make test` alone may lack them
        assert_one_line_error(tvmbert("build", "bert-tiny", "--target", target), str(missing))
        pytest.skip(f"no {target} toolchain on this machine, and build says so in one line: {missing}")
    outcome = tvmbert("build", "bert-tiny", "--target", target, "--json")
    assert outcome.code == 0, outcome.stderr
    modules = outcome.json["device_modules"]
    assert [m["kind"] for m in modules] == [kind]
    assert outcome.json["flash_attention_kernels"] == ["flash_attention_1x2x14x64_masked"]  # each layer's attention: one kernel
    assert outcome.json["cuda_graph"] == (kind == "cuda")  # a static CUDA build replays its forward in a CUDA graph
    if kind == "cuda":
        assert outcome.json["gpu_kernels"]["launched_per_forward"] >= outcome.json["gpu_kernels"]["device_kernels"] > 10
    assert modules[0]["source_bytes"] > 10_000
    if kind == "hip":
        assert modules[0]["isa"].endswith("gfx906") and modules[0]["assembly_bytes"] > 10_000


@pytest.mark.skipif(UNRUNNABLE_CPU is None, reason="no CPU LLVM knows has an instruction set this one lacks")
def test_code_for_a_cpu_this_one_lacks_is_compiled_but_never_run(tvmbert):
    """verify (and bench, add_tvm_dispatch, the runtime) would die on SIGILL at the library's first
    call: it is one line, exit 2, naming what this CPU lacks."""
    target = f"llvm -mcpu={UNRUNNABLE_CPU}"
    built = tvmbert("build", "bert-tiny", "--target", target, "--json")
    assert built.code == 0, built.stderr
    missing = targets.missing_host_features(built.json["target"])
    assert missing
    assert_one_line_error(tvmbert("verify", "bert-tiny", "--target", target), "illegal instruction", missing[0], "--target llvm")
    # bench's floor probes are built for the target too, and run before any engine.
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--target", target, "--engines", "tvm"), "illegal instruction", missing[0])
    import torch

    from tvmbert import InputError, add_tvm_dispatch

    with pytest.raises(InputError, match="illegal instruction"):
        add_tvm_dispatch(torch.nn.Linear(4, 4), torch.ones(2, 4), target=target)


# LLVM's x86 tuning features, read one by one off X86.td for the LLVM of TVM 0.27's wheel: none
# changes which instructions code may hold. TUNING_FEATURES must name exactly these: a newer
# LLVM's feature it takes for tuning fails here until someone has read what it is.
AUDITED_TUNING = {
    "64bit-mode", "allow-light-256-bit", "branchfusion", "ermsb", "false-deps-getmant", "false-deps-lzcnt-tzcnt",
    "false-deps-mulc", "false-deps-mullq", "false-deps-perm", "false-deps-popcnt", "false-deps-range", "fast-11bytenop",
    "fast-15bytenop", "fast-7bytenop", "fast-bextr", "fast-dpwssd", "fast-gather", "fast-hops", "fast-imm16", "fast-lzcnt",
    "fast-movbe", "fast-scalar-fsqrt", "fast-scalar-shift-masks", "fast-shld-rotate", "fast-variable-crosslane-shuffle",
    "fast-variable-perlane-shuffle", "fast-vector-fsqrt", "fast-vector-shift-masks", "faster-shift-than-shuffle", "fsrm",
    "idivl-to-divb", "idivq-to-divl", "lea-sp", "lea-uses-ag", "macrofusion", "no-bypass-delay", "no-bypass-delay-blend",
    "no-bypass-delay-mov", "no-bypass-delay-shuffle", "pad-short-functions", "prefer-256-bit", "prefer-mask-registers",
    "prefer-movmsk-over-vtest", "sbb-dep-breaking", "slow-3ops-lea", "slow-incdec", "slow-lea", "slow-pmaddwd", "slow-pmulld",
    "slow-pmullq", "slow-shld", "slow-two-mem-ops", "slow-unaligned-mem-16", "slow-unaligned-mem-32",
    "tuning-fast-imm-vector-shift", "use-glm-div-sqrt-costs", "use-slm-arith-costs", "vzeroupper",
}


def _every_x86_cpu() -> dict[str, frozenset[str]]:
    """Every CPU name LLVM knows for x86-64, with every LLVM feature it attaches."""
    import tvm
    from tvm.target import codegen

    names = codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu"}))
    return {str(cpu): targets._llvm_features(json.dumps({"kind": "llvm", "mcpu": str(cpu)}, sort_keys=True)) for cpu in names}


def test_no_cpu_llvm_knows_passes_where_the_host_lacks_one_of_its_instructions(present_host):
    """Deny by default: on every known host (as it is, and as far as this CPU has its flags), every
    CPU name LLVM knows either is refused or holds no instruction feature the host's own target
    lacks (every feature but the audited tuning ones, whatever its name: APX's egpr, avx10.2,
    movrs...); the host's own target always passes."""
    cpus = _every_x86_cpu()
    every_feature = frozenset().union(*cpus.values())
    assert {f for f in every_feature if targets.TUNING_FEATURES.fullmatch(f)} == AUDITED_TUNING
    for name, known in hosts.KNOWN_HOSTS.items():
        host = hosts.Host(known.llvm_cpu, known.flags)  # as it is on its own machine
        own = {"kind": "llvm", **targets.config_for_host(host)}
        assert not targets.instruction_features(own) - targets.runnable_features(host), name
        has = targets._llvm_features(json.dumps(own, sort_keys=True))
        for cpu, features in cpus.items():
            passes = not targets.instruction_features({"kind": "llvm", "mcpu": cpu}) - targets.runnable_features(host)
            assert not passes or features - has <= AUDITED_TUNING, (name, cpu, sorted(features - has - AUDITED_TUNING))
        if hosts.real_flags():
            present_host(f"{known.llvm_cpu}:{' '.join(known.flags & hosts.real_flags())}")  # runs here: its own target passes
            assert targets.missing_host_features(targets.resolve("llvm").config) == [], name
    present_host("sapphirerapids")
    assert {"egpr", "ndd", "avx10.2", "movrs", "amx-fp8"} <= set(targets.missing_host_features({"kind": "llvm", "mcpu": "diamondrapids"}))


def test_gpu_targets_carry_the_limits_metaschedule_reads():
    """From TVM's tag for the architecture (sm_90: nvidia-h100's, arch kept), a table for AMD's;
    a limit the user names wins."""
    h100 = targets.resolve("cuda -arch=sm_90").config
    assert h100["arch"] == "sm_90" and h100["max_threads_per_block"] == 1024 and h100["l2_cache_size_bytes"] == 50 * 2**20
    assert targets.resolve("rocm -mcpu=gfx90a").config["thread_warp_size"] == 64
    assert targets.resolve("cuda -arch=sm_80 -max_threads_per_block=512").config["max_threads_per_block"] == 512
    assert "max_shared_memory_per_block" in targets.resolve("cuda -arch=sm_61").config  # no tag: the fallback limits

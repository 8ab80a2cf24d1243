"""Every host as it is: the host target resolved from the CPU's flags, never from its name alone,
on real hosts' (LLVM name, flags) pairs (hosts.KNOWN_HOSTS), on any x86 machine; and the demo's
job, for real, on hosts that are a subset of the one running the tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tvmbert.core import hosts, targets
from tvmbert.core.errors import InputError
from tvmbert.kernels import fma
from tvmbert.tuning import catalog

from helpers import REPO, assert_one_line_error

# Per host: its key, fp32 kernels' lanes, the int8 weight matmuls' instruction and lanes (None:
# --dtype int8 refused), and whether --dtype bfloat16 runs on AMX (with the tile state granted).
ROUTES = {
    "zen4-avx512-hidden": ("llvm-znver4_no-avx512f", 8, ("vpmaddubsw", 8), False),
    "zen4": ("llvm-znver4", 16, ("vpdpbusd", 16), False),
    "zen5": ("llvm-znver5", 16, ("vpdpbusd", 16), False),
    "zen3": ("llvm-znver3", 8, ("vpmaddubsw", 8), False),
    "zen1": ("llvm-znver1", 8, ("vpmaddubsw", 8), False),
    "icelake-server": ("llvm-icelake-server", 16, ("vpdpbusd", 16), False),
    "sapphirerapids": ("llvm-sapphirerapids", 16, ("tdpbusd", 16), True),
    "sapphirerapids-amx-hidden": ("llvm-sapphirerapids", 16, ("vpdpbusd", 16), False),
    "sapphirerapids-avx512-hidden": ("llvm-sapphirerapids_no-avx512f", 8, ("vpdpbusd", 8), False),
    "alderlake": ("llvm-alderlake", 8, ("vpdpbusd", 8), False),
    "x86-64-v2-vm": ("llvm-x86-64-v2", 0, None, False),
    "qemu64": ("llvm-k8-sse3", 0, None, False),
}


def test_every_known_host_has_its_routes_stated():
    assert set(ROUTES) == set(hosts.KNOWN_HOSTS)


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_a_host_target_uses_only_what_the_flags_list(name, present_host, monkeypatch):
    """The key names the host apart from the full CPU, the code may use only what the flags list,
    and every route (fp32 kernels, int8's instruction, bf16 on AMX) fits what the host has."""
    host = present_host(name)
    monkeypatch.setattr(targets, "host_grants_amx", lambda: True)  # the routes as they are where AMX is granted
    key, fp32_lanes, int8_route, bf16 = ROUTES[name]
    spec = targets.resolve("llvm")
    assert spec.key == key and not spec.amx_withheld
    used = {targets.HOST_FEATURES[f] for f in targets.HOST_FEATURES if spec.has_features(f)}
    assert used <= host.flags, sorted(used - host.flags)
    assert {f for f, flag in targets.HOST_FEATURES.items() if flag in host.flags} <= {f for f in targets.HOST_FEATURES
                                                                                     if spec.has_features(f)}
    assert spec.fp32_lanes == fp32_lanes
    instruction = "tdpbusd" if spec.has_amx_int8 else spec.int8_instruction
    assert ((instruction, spec.int8_lanes) if spec.int8_lanes else None) == int8_route
    assert spec.has_amx_bf16 == bf16
    # Decisions that read the key: the fewest rows our kernels take (Sapphire Rapids' shipped
    # records win below 16 only where its AVX-512 code runs), the nearest CPU's records.
    assert fma.min_rows(spec.key) == (16 if key == "llvm-sapphirerapids" else 1)
    described = catalog.describe(spec.key)
    assert described.isa == ("avx512" if fp32_lanes == 16 else "avx2" if fp32_lanes else "sse4" if "sse4_2" in host.flags else "base")


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_a_host_key_names_its_target_back(name, present_host):
    """A key is all a database folder or a fleet package's --cpus entry has: it must name the same
    instruction sets again, on any machine."""
    present_host(name)
    spec = targets.resolve("llvm")
    named = targets.resolve(json.dumps(targets.cpu_of_key(spec.key)))
    assert named.key == spec.key
    assert targets.compiled_instruction_sets(named.config) == targets.compiled_instruction_sets(spec.config)


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_code_for_a_host_holds_no_wider_vectors_than_it_has(name, present_host):
    """Compiled, never run: a 64-wide fp32 loop, which LLVM splits into the widest vectors the
    target allows, must hold no zmm register without AVX-512 and no ymm without AVX."""
    import tvm
    from tvm.script import tirx as T

    present_host(name)
    spec = targets.resolve("llvm")

    @T.prim_func(s_tir=True)
    def scaled_add(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32"), c: T.Buffer((1024,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in T.serial(16):
            for j in T.vectorized(64):
                with T.sblock("c"):
                    v = T.axis.spatial(1024, i * 64 + j)
                    c[v] = a[v] * T.float32(3) + b[v]

    assembly = tvm.compile(tvm.IRModule({"main": scaled_add}), target=spec.tvm_target()).mod.inspect_source("asm")
    registers = set(re.findall(r"%([xyz])mm\d+", assembly))
    widest = "z" if spec.has_features("avx512f") else "y" if spec.has_features("avx") else "x"
    assert max(registers) == widest, (spec.key, sorted(registers))


def test_a_host_without_avx2_refuses_int8_and_bf16_saying_why(present_host, tvmbert):
    present_host("x86-64-v2-vm")
    assert_one_line_error(tvmbert("build", "bert-tiny", "--dtype", "int8"), "need AVX2", "llvm-x86-64-v2")
    assert_one_line_error(tvmbert("build", "bert-tiny", "--dtype", "bfloat16"), "AMX-BF16 and AVX-512", "llvm-x86-64-v2")


def test_a_simulated_host_never_runs_what_the_real_cpu_lacks(present_host):
    """The host decides what is built; what runs here is bounded by the real CPU too."""
    present_host("x86-64-v2-vm")
    assert "avx2" in targets.missing_host_features({"kind": "llvm", "mcpu": "haswell"})
    if hosts.real_flags() and "avx2" not in hosts.real_flags():
        pytest.skip("this CPU has no AVX2: the rest presents a host with more than it has")
    present_host("znver1:" + " ".join(hosts.KNOWN_HOSTS["zen1"].flags - {"avx2"}))
    assert targets.missing_host_features({"kind": "llvm", "mcpu": "x86-64-v3"}) == ["avx2"]
    assert targets.missing_host_features({"kind": "llvm", "mcpu": "haswell"}) == ["avx2", "invpcid"]  # Zen 1 has no INVPCID


@pytest.mark.parametrize("value, fragment", [("nonsense", "give a known host"), (":avx2", "give a known host")])
def test_a_bad_host_variable_is_one_line(value, fragment, present_host, tvmbert):
    with pytest.raises(InputError, match=fragment):
        present_host(value)
    assert_one_line_error(tvmbert("build", "bert-tiny"), "TVMBERT_HOST", fragment)


def _subset_of_this_cpu(name: str) -> str:
    """TVMBERT_HOST for KNOWN_HOSTS[name] less what this CPU lacks: code for it runs here."""
    host = hosts.KNOWN_HOSTS[name]
    return f"{host.llvm_cpu}:{' '.join(sorted(host.flags & hosts.real_flags()))}"


def _demo_job(tmp_path: Path, host: str) -> subprocess.CompletedProcess:
    """`make demo`'s job (configs/demo.yaml: every stage), the bench against ONNX Runtime only,
    in a process of its own under TVMBERT_HOST, with a copy of the shipped tuning logs."""
    config = (REPO / "configs" / "demo.yaml").read_text()
    config = re.sub(r"(?s)\nbench:.*", "\nbench:\n  warmup: 2\n  repeat: 5\n  min_time_s: 0.2\n  engines: [tvm, onnxruntime]\n", config)
    (tmp_path / "demo.yaml").write_text(config)
    subprocess.run(["cp", "-r", str(REPO / "tvmbert" / "tuning_logs"), str(tmp_path / "logs")], check=True)
    environment = {**os.environ, hosts.HOST_VARIABLE: host, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tvmbert", "run", str(tmp_path / "demo.yaml"), "--workdir", str(tmp_path / "work"),
                           "--log-dir", str(tmp_path / "logs"), "--json"],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not hosts.real_flags(), reason="no /proc/cpuinfo: nothing to present a host as a subset of")
@pytest.mark.parametrize("name, kernels", [("zen4-avx512-hidden", True), ("x86-64-v2-vm", False)])
def test_the_demo_runs_for_real_on_a_host_with_less_than_its_name(name, kernels, tmp_path):
    """The issue-44 machine (a Zen 4 whose VM hides AVX-512) and a VM's x86-64-v2 baseline (no
    AVX: TVM's schedules only, and build says so), each as far as this CPU has its flags: every
    stage, verified against PyTorch, timed."""
    host = _subset_of_this_cpu(name)
    done = _demo_job(tmp_path, host)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(done.stdout)
    key = targets.llvm_key({"kind": "llvm", **targets.config_for_host(hosts.parse(host))})
    assert stages["build"]["target_key"] == key
    assert stages["verify"]["passed"]
    assert ("fma_kernels" in stages["build"]) == (kernels and "fma" in hosts.real_flags() and "avx2" in hosts.real_flags())
    assert ("no hand-written kernel runs" in done.stderr) == (not kernels)
    assert set(stages["bench"]["results"][0]["engines"]) == {"tvm", "onnxruntime"}

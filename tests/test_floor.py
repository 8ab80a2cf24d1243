"""bench's floor: the FMA probe is register-only FMAs at the target's widest vectors (built for
an AVX2 and an AVX-512 host, run on this one), it computes what it says, and a shape's floor is
bound by whichever of the peak and the bandwidth binds."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tvmbert.core import targets
from tvmbert.core.memory import ModelSizes
from tvmbert.stages.bench import floor

from helpers import HOST_TARGET

BERT_BASE = ModelSizes(weights=109_482_240, hidden=768, intermediate=3072, heads=12, layers=12)


@pytest.mark.parametrize("mcpu, register", [("haswell", "ymm"), ("skylake-avx512", "zmm")])
def test_the_fma_probe_is_register_only_fmas_on_the_widest_vectors(mcpu, register):
    import tvm

    target = targets.resolve(f'{{"kind": "llvm", "mcpu": "{mcpu}"}}').tvm_target()
    lanes = targets.vector_lanes(target, 32)
    assembly = tvm.compile(floor.fma_probe(2, lanes, "float32"), target=target).mod.inspect_source("asm")
    fmas = [line for line in assembly.splitlines() if re.match(r"\s+vfmadd\w+ps", line)]
    assert len(fmas) >= floor.CHAINS and all(f"%{register}" in line and "(" not in line for line in fmas), fmas


def test_the_fma_probe_computes_its_chains_on_every_thread():
    import tvm

    lanes, steps = HOST_TARGET.fp32_lanes or 4, 3
    library = tvm.compile(floor.fma_probe(2, lanes, "float32", steps), target=HOST_TARGET.tvm_target()).mod
    device = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((2, floor.CHAINS, lanes), "float32"), device)
    library(tvm.runtime.tensor(np.full((2, lanes), 0.5, "float32"), device), out)
    start = 0.5 + np.arange(floor.CHAINS, dtype=np.float32)  # acc = acc / 2 + 1/2 tends to 1
    expected = 1 + (start - 1) * 0.5**steps
    np.testing.assert_array_equal(out.numpy(), np.broadcast_to(expected[None, :, None], (2, floor.CHAINS, lanes)))


def test_the_floor_is_measured_here_for_fp32_and_fp64_only():
    measured = floor.measure(HOST_TARGET, 1, "float32")
    assert measured.fma_gflop_per_s > 1 and measured.memory_gb_per_s > 0.5 and measured.dtype == "float32"
    assert floor.measure(HOST_TARGET, 1, "int8") is None and floor.measure(targets.resolve("cuda"), 1, "float32") is None


def test_a_shapes_floor_is_the_peak_or_the_weights_whichever_binds():
    gflop = BERT_BASE.flops(1, 14) / 1e9
    weights_mb = BERT_BASE.matmul_weights * 4 / 1e6
    assert BERT_BASE.matmul_weights == 12 * (4 * 768**2 + 2 * 768 * 3072)
    slow_cores = floor.Floor(fma_gflop_per_s=70.0, memory_gb_per_s=25.0, dtype="float32").shape(BERT_BASE, 1, 14)
    assert slow_cores == {"floor_ms": round(gflop / 70.0 * 1e3, 3), "bound": "fma"}
    wide_cores = floor.Floor(fma_gflop_per_s=700.0, memory_gb_per_s=25.0, dtype="float32").shape(BERT_BASE, 1, 14)
    assert wide_cores == {"floor_ms": round(weights_mb / 25.0, 3), "bound": "memory"}
    wide_doubles = floor.Floor(fma_gflop_per_s=700.0, memory_gb_per_s=25.0, dtype="float64").shape(BERT_BASE, 1, 14)
    assert wide_doubles["floor_ms"] == pytest.approx(2 * wide_cores["floor_ms"], rel=1e-3)
    # ALBERT's layers share one layer's weights: a call reads at least those, not 12 copies.
    albert = ModelSizes(weights=11_683_584, hidden=768, intermediate=3072, heads=12, layers=12)
    assert albert.matmul_weights == albert.weights

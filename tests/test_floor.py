"""bench's floor: the FMA probe is register-only FMAs at the target's widest vectors (built for
an AVX2 and an AVX-512 host, run on this one), it computes what it says, and a shape's floor is
bound by whichever of the peak and the bandwidth binds, the weights counted once."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tvmbert.core import targets
from tvmbert.frontend import models
from tvmbert.stages.bench import floor

from helpers import HOST_TARGET

LAYER_WEIGHTS = 4 * 768**2 + 2 * 768 * 3072  # bert-base's Q, K, V, output and FFN weights
POOLER_WEIGHTS = 768**2


@pytest.mark.parametrize("mcpu, register", [("haswell", "ymm"), ("skylake-avx512", "zmm")])
def test_the_fma_probe_is_register_only_fmas_on_the_widest_vectors(mcpu, register):
    import tvm

    target = targets.resolve(f'{{"kind": "llvm", "mcpu": "{mcpu}"}}').tvm_target()
    lanes = targets.vector_lanes(target, 32)
    lines = tvm.compile(floor.fma_probe(2, lanes, "float32"), target=target).mod.inspect_source("asm").splitlines()
    # The loop the FMAs are in: from its label to the jump back to it.
    first = next(i for i, line in enumerate(lines) if re.match(r"\s+vfmadd", line))
    start = next(i for i in range(first, -1, -1) if re.fullmatch(r"\.LBB\w+:", lines[i]))
    label = lines[start].rstrip(":")
    end = next(i for i in range(first, len(lines)) if re.fullmatch(rf"\s+j\w+\s+{re.escape(label)}", lines[i]))
    body = [line.split() for line in lines[start + 1:end] if line.startswith("\t") and not line.strip().startswith(".")]
    fmas = [line for line in body if re.fullmatch(r"vfmadd\w+ps", line[0])]
    assert fmas and len(fmas) % floor.CHAINS == 0 and all(f"%{register}" in "".join(line) for line in fmas), body
    assert not any("(" in "".join(line[1:]) for line in body), body  # no load or store: the chains stay in registers


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
    single, probe = floor.measure(HOST_TARGET, 1, "float32")
    lanes = HOST_TARGET.fp32_lanes or 4
    # At most 2 FMA units of the widest vectors at 6 GHz: a rate above it counts FLOPs the probe does not do.
    assert 1 < single.fma_gflop_per_s < lanes * 2 * 2 * 6 and single.memory_gb_per_s > 0.5 and single.dtype == "float32"
    assert 1 < probe() < lanes * 2 * 2 * 6  # the probe for the rounds: its best run's rate
    double, _ = floor.measure(HOST_TARGET, 1, "float64")
    assert double.dtype == "float64" and double.fma_gflop_per_s < single.fma_gflop_per_s
    assert single.cache_bytes == floor.last_level_cache_bytes() > 0
    for dtype in ("int8", "bfloat16", "float16"):
        assert floor.measure(HOST_TARGET, 1, dtype) is None
    assert floor.measure(targets.resolve("cuda"), 1, "float32") is None
    assert floor.applies_to("tvm") and floor.applies_to("onnxruntime")
    assert not floor.applies_to("ort-int8") and not floor.applies_to("tvm-packed")


def test_the_probe_between_rounds_reports_its_best_run():
    """Its first runs after the engines' rounds can start both threads on one core (half the
    rate, a few ms): the rate is its best run's."""
    durations = iter([0.02, 0.02, 0.01] + [0.015] * floor.PROBE_CALLS)
    clock = [0.0]

    def library(operands, out):  # the untimed wake-up run, then each timed run's duration
        clock[0] += next(durations)

    probe = object.__new__(floor.FmaProbe)
    probe.library, probe.operands, probe.out, probe.flops = library, None, None, 1e9
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(floor.time, "perf_counter", lambda: clock[0])
        assert probe() == pytest.approx(100.0)  # 1 GFLOP in its best run's 10 ms


def test_a_shapes_floor_is_the_peak_or_the_weights_whichever_binds():
    bert = models.sizes(models.resolve("bert-base"))
    assert bert.matmul_weights == 12 * LAYER_WEIGHTS + POOLER_WEIGHTS
    gflop = bert.flops(1, 14) / 1e9
    weights_mb = bert.matmul_weights * 4 / 1e6
    slow_cores = floor.Floor(fma_gflop_per_s=70.0, memory_gb_per_s=25.0, cache_bytes=2**25, dtype="float32")
    assert slow_cores.shape_ms(bert, 1, 14) == (pytest.approx(gflop / 70.0 * 1e3), "fma")
    wide_cores = floor.Floor(fma_gflop_per_s=700.0, memory_gb_per_s=25.0, cache_bytes=2**25, dtype="float32")
    assert wide_cores.shape_ms(bert, 1, 14) == (pytest.approx(weights_mb / 25.0), "memory")
    assert wide_cores.shape_ms(bert, 1, 512)[1] == "fma"
    wide_doubles = floor.Floor(fma_gflop_per_s=350.0, memory_gb_per_s=25.0, cache_bytes=2**25, dtype="float64")
    assert wide_doubles.shape_ms(bert, 1, 14)[0] == pytest.approx(2 * wide_cores.shape_ms(bert, 1, 14)[0])
    # Weights that fit in the last level cache are read from it by calls back to back: no memory bound.
    huge_cache = floor.Floor(fma_gflop_per_s=700.0, memory_gb_per_s=25.0, cache_bytes=2**30, dtype="float32")
    assert huge_cache.shape_ms(bert, 1, 14) == (pytest.approx(gflop / 700.0 * 1e3), "fma")
    # ALBERT's layers share one set of weights: a call reads them once, not once a layer.
    assert models.sizes(models.resolve("albert-base")).matmul_weights == LAYER_WEIGHTS + POOLER_WEIGHTS


def test_flops_count_each_layers_matmuls_and_the_keys_it_attends_to():
    """bert-base: 4 H^2 + 2 H I multiply-adds a token a layer, and every key; ModernBERT-base: its
    GeGLU's (4 H^2 + 3 H I), and in its 14 local layers of 22 the 129 keys of the window."""
    bert = models.sizes(models.resolve("bert-base"))
    assert bert.flops(2, 128) == 2 * 2 * 128 * 12 * (4 * 768 ** 2 + 2 * 768 * 3072 + 2 * 128 * 768)
    modern = models.sizes(models.resolve("modernbert-base"))
    assert modern.attention_keys.count(None) == 8 and set(modern.attention_keys) == {None, 129}
    assert modern.flops(1, 8192) == 2 * 8192 * (22 * (4 * 768 ** 2 + 3 * 768 * 1152) + 2 * 768 * (8 * 8192 + 14 * 129))
    assert modern.flops(1, 64) == 2 * 64 * (22 * (4 * 768 ** 2 + 3 * 768 * 1152) + 2 * 768 * 22 * 64)  # windows wider than the text

"""A lent GPU machine's run, prepared on CPU: benchmarks/gpu_run.sh starts every step here (each
device step cross-compiles, then says in one line that there is no CUDA device), a GPU build is
timed against PyTorch on the same GPU, and what the GPU itself must show is marked cuda."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tvmbert.core import registry, targets
from tvmbert.core.errors import InputError
from tvmbert.stages.bench.engines import default_engines, peer_dtype

from helpers import CUDA_PRESENT, REPO, assert_one_line_error

SCRIPTS = ("benchmarks/gpu_run.sh", "benchmarks/lent_machine.sh", "benchmarks/steps.sh")
GPU_PEERS = ("torch-eager", "torch-sdpa", "torch-cudagraph", "torch-compile")
DEVICE_STEPS = ("verify-fp16.json", "verify-fp16-b8.json", "graph-check.txt", "bench-fp16-b1.json", "bench-fp16-b8.json", "profile.txt", "tune.json",
                "bench-tuned.json")
LIMITS = ("BUILDS_S", "VERIFY_S", "VERIFY_B8_S", "CHECK_S", "BENCH_S", "BENCH_B8_S", "PROFILE_S", "TUNE_S", "RECORDS_S", "REBUILD_S",
          "BENCH_TUNED_S", "TESTS_S")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lent_machine_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def dry_run(tmp_path, steps: str) -> str:
    """benchmarks/gpu_run.sh's steps here, on bert-tiny; its log."""
    out = tmp_path / "out"
    # The steps' limits are a GPU's; on a shared 2-core machine a bert-tiny build alone can take
    # longer, and the dry run checks that each step starts and stops where it should, not its time.
    environment = {**os.environ, "OUT": str(out), "MODEL": "bert-tiny", "PY": sys.executable, "WORK": str(tmp_path / "work"),
                   "STEPS": steps, **dict.fromkeys(LIMITS, "400")}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh")], env=environment, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    log = (out / "log.txt").read_text()
    assert "Traceback" not in log, log
    return log


def compiled_kernels(library: Path) -> bool:
    """Whether the CUDA kernels in ``library`` were compiled (TVM keeps their source where it has no CUDA runtime)."""
    return b"__global__" not in library.read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(CUDA_PRESENT, reason="the dry run is for machines without a CUDA device")
def test_every_gpu_step_starts_here_and_says_there_is_no_cuda_device(tmp_path):
    """Each step of the three calls: the builds compile every shape the device steps run, each
    device step stops at the device in one line, the rebuild with the tuning logs compiles. A step
    that would not start on the GPU fails here first."""
    log = dry_run(tmp_path, "builds verify-fp16 verify-fp16-b8 graph-check bench-fp16-b1 bench-fp16-b8 profile tune records rebuild "
                            "bench-tuned tests")
    assert "== builds.txt: exit 0 after" in log and "== rebuild.json: exit 0 after" in log, log
    for name in DEVICE_STEPS:
        assert f"== {name}: exit 2 after" in log, log
    assert log.count("error: verify runs the model: this machine has no cuda device") == 2, log
    assert log.count("error: bench runs the model: this machine has no cuda device") == 3, log
    assert "the graph check runs the model: this machine has no cuda device" in log, log
    assert "the profile runs the model: this machine has no cuda device" in log and "--rpc-tracker" in log, log
    for build in ("b1-s14-float16", "b1-s128-float16", "b8-s128-float16"):
        libraries = list((tmp_path / "work").glob(f"bert-tiny/{build}/cuda-*/build/model.so"))
        assert libraries and all(compiled_kernels(library) for library in libraries), build
    assert len(list((tmp_path / "work").glob("bert-tiny/b1-s128-float16/cuda-*/build/model.so"))) == 2  # with and without its graph
    # At 14 rows too, every fp16 weight matmul but the pooler's single row runs on tensor cores
    # (default_schedules._tensor_core_matmul: dlight's own rule leaves sizes of 64 or less to CUDA cores).
    small = json.loads(next((tmp_path / "work").glob("bert-tiny/b1-s14-float16/cuda-*/build/stage.json")).read_text())
    assert sum("matmul" in name for name in small["gpu_kernels"]["tensor_core"]) == 4, small["gpu_kernels"]
    assert "== tests.txt: exit 0 after" in log and "no CUDA device on this machine" in (tmp_path / "out" / "tests.txt").read_text()


def test_the_timed_call_waits_for_the_device():
    """A GPU runs kernels after the call that launched them returns: tvm's timed call ends with the
    device's sync (here a device that finishes 20 ms after the launch), or it times launches only."""
    import torch

    from tvmbert.stages.bench import engines
    from tvmbert.stages.bench.timing import measure

    class LaunchingModel:
        def __init__(self, built, job):
            self.finished_at = 0.0

        def to_device(self, arrays):
            return arrays

        def run_on_device(self, inputs):
            self.finished_at = time.perf_counter() + 0.02

        def sync(self):
            time.sleep(max(0.0, self.finished_at - time.perf_counter()))

    job = SimpleNamespace(upstream=lambda stage, run: SimpleNamespace(meta={}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engines, "CompiledModel", LaunchingModel)
        engine = engines.tvm_engine(job, [torch.zeros(1, 4, dtype=torch.int64)], threads=1)
    measure([engine], warmup=0, repeat=3, min_time_s=0)
    assert min(engine.timings_ms) >= 20, engine.timings_ms


# A job of a GPU build, as the PyTorch peers read it.
GPU_JOB = SimpleNamespace(config=SimpleNamespace(dtype="float16", seed=0), target=SimpleNamespace(is_gpu=True), source=None)


class OnDevice:
    """A model or a tensor that moves to any device (this machine has no GPU); its forward is
    recorded in ``calls``."""

    def __init__(self, calls: list):
        self.calls = calls

    def to(self, device):
        return self

    def __call__(self, *inputs):
        import torch

        self.calls.append("forward")
        return (torch.zeros(1),)


def test_a_pytorch_peer_on_a_gpu_synchronizes_after_each_call(monkeypatch):
    """The same for PyTorch's peers: their call on a GPU ends with torch.cuda.synchronize()."""
    import torch

    from tvmbert.stages.bench import engines

    calls = []
    monkeypatch.setattr(engines.models, "load", lambda *args, **kwargs: OnDevice(calls))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    engine = engines.torch_eager(GPU_JOB, [OnDevice(calls)], threads=1)
    engine.run()
    assert calls == ["forward", "synchronize"]


def test_a_gpu_build_is_timed_against_pytorch_on_its_gpu(tvmbert):
    """ONNX Runtime and OpenVINO run on the CPU here: a GPU build's ratio is against the PyTorch
    peers on the same GPU, in the build's own precision."""
    assert default_engines("float16", gpu=True) == ("tvm", *GPU_PEERS)
    assert all(registry.ENGINES[name].on_gpu for name in GPU_PEERS)
    assert peer_dtype("float16", gpu=True) == "float16" and peer_dtype("float16") == "float32"
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--target", "cuda", "--engines", "tvm,onnxruntime"),
                          "onnxruntime runs on the CPU only", "torch-eager, torch-sdpa, torch-cudagraph, torch-compile")
    assert "torch-cudagraph" not in default_engines("float32")
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--engines", "tvm,torch-cudagraph"), "torch-cudagraph needs a GPU")
    assert "torch-cudagraph" in " ".join(tvmbert("bench", "--help", workdir_arg=False).stdout.split())


def test_the_cuda_graph_peer_captures_once_and_each_call_replays_synchronized(monkeypatch):
    """torch-cudagraph: the SDPA model warmed up and captured once when set up; each timed call
    replays the graph (no forward) and synchronizes; torch.compile on a GPU is max-autotune."""
    import contextlib
    import gc
    import weakref

    import torch

    from tvmbert.stages.bench import engines

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def capturing(graph):
        calls.append("capture")
        yield

    loaded = []
    monkeypatch.setattr(engines.models, "load", lambda *args, **kwargs: loaded.append(OnDevice(calls)) or loaded[-1])
    monkeypatch.setattr(engines, "fastest_attention", lambda job: "sdpa")  # the fake job has no model source
    for name, value in {"synchronize": lambda: calls.append("synchronize"), "CUDAGraph": Graph, "graph": capturing,
                        "Stream": Stream, "current_stream": Stream, "stream": lambda s: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    engine = engines.torch_cudagraph(GPU_JOB, [OnDevice(calls)], threads=1)
    assert calls == ["forward"] * engines.CAPTURE_WARMUP + ["capture", "forward"]
    # The replays read the model's weights and the inputs where they were captured: both live as long as the engine.
    model = weakref.ref(loaded.pop())
    gc.collect()
    assert model() is not None
    calls.clear()
    engine.run()
    engine.run()
    assert calls == ["replay", "synchronize"] * 2
    assert engines.TORCH_COMPILE_MODE[engines.torch_device(GPU_JOB)] == "max-autotune"


def test_dispatch_refuses_inputs_on_another_device_than_its_target():
    """DLPack hands TVM PyTorch's memory as it is: CPU tensors would reach a GPU build's kernels."""
    import torch

    from tvmbert import add_tvm_dispatch

    with pytest.raises(InputError, match="sample inputs are on cpu"):
        add_tvm_dispatch(torch.nn.Linear(4, 4), torch.ones(2, 4), target="cuda")


@pytest.mark.skipif(CUDA_PRESENT, reason="this machine has a CUDA device")
def test_a_cuda_package_is_refused_in_one_line_where_there_is_no_gpu(tmp_path, workdir):
    """export cross-compiles and says what for; load refuses it in one line, before TVM would fail
    to load the library (no CUDA runtime) or run it."""
    from tvmbert import load
    from tvmbert.core.config import JobConfig
    from tvmbert.stages.export import export

    manifest = export(JobConfig(model="bert-tiny", target="cuda", workdir=str(workdir)), tmp_path / "pkg", batches=(1,),
                      seq_lens=(8,))
    assert manifest["target"]["kind"] == "cuda" and manifest["target_key"].startswith("cuda-sm_")
    with pytest.raises(InputError, match="built for cuda-sm_.*this machine has no cuda device") as refused:
        load(tmp_path / "pkg")
    assert "\n" not in str(refused.value)


def test_pytorch_cast_to_float16_passes_the_gpu_peers_check():
    """On a GPU the PyTorch peers run bert-base cast to float16 (layer norm and softmax too): their
    check against fp32 must leave room for it (measured here on the CPU, with room to spare)."""
    import torch

    from tvmbert.core.config import JobConfig
    from tvmbert.frontend import models
    from tvmbert.stages.bench.engines import check_tolerance
    from tvmbert.stages.job import Job

    job = Job(JobConfig(model="bert-base", dtype="float16", batch=2, seq_len=128))
    inputs = job.inputs.as_tuple()
    with torch.inference_mode():
        want, got = (models.load(job.source, dtype, attn_implementation="sdpa")(*inputs)[0] for dtype in ("float32", "float16"))
    off = float((got.float() - want).abs().max())
    assert 2 * off < check_tolerance("torch-sdpa", "float16", gpu=True), off


def test_a_layers_forward_and_backward_compile_for_cuda(tmp_path):
    """What add_tvm_dispatch compiles for a GPU: every forward and backward kernel scheduled by
    dlight's rules, a rule that raises on one (GEMV's, on some backward kernels) passed over."""
    import torch

    from tvmbert.passes.pipeline import lowering
    from tvmbert.training.dispatch import ENTRIES, training_module
    from tvmbert.tuning.compile import compile_tuned

    layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Dropout(0.1)).train()
    split, *_ = training_module(layer.forward, layer, (torch.randn(4, 16, requires_grad=True),))
    built = compile_tuned(lowering(ENTRIES)(split.module), targets.resolve("cuda"), tmp_path, lambda line: None, ENTRIES)
    assert built.tasks and len(built.untuned) == len(built.tasks)


def test_build_reports_kernels_per_layer_and_tensor_core_ones_and_cuda_graphs_turn_off(tvmbert):
    """At 128 tokens dlight puts fp16 weight matmuls on tensor cores (wmma in their CUDA source);
    --no-cuda-graph builds a forward that launches each kernel itself."""
    built = tvmbert("build", "bert-tiny", "--target", "cuda -arch=sm_80", "--dtype", "float16", "--seq-len", "128",
                    "--no-cuda-graph", "--json")
    assert built.code == 0, built.stderr
    kernels = built.json["gpu_kernels"]
    assert built.json["cuda_graph"] is False
    assert kernels["per_layer"] == kernels["launched_per_forward"] / 2  # bert-tiny: 2 layers
    # A layer's attention is one flash-attention kernel, bias + GELU and bias + residual run in the
    # matmuls' epilogues and each layer norm writes fp16 (flat-epilogues): 7 kernels a layer, 12 for
    # the embeddings and pooler (54 in all before).
    assert built.json["flash_attention_kernels"] == ["flash_attention_1x2x128x64_masked"]
    assert kernels["launched_per_forward"] <= 26, kernels
    assert any("matmul" in name and "gelu" in name for name in kernels["tensor_core"]), kernels
    assert sum(bool(re.search(r"matmul.*_add\d*_add_kernel", name)) for name in kernels["tensor_core"]) == 2, kernels
    assert any("matmul" in name for name in kernels["tensor_core"]), kernels
    assert not any("softmax" in name or "layer_norm" in name for name in kernels["tensor_core"]), kernels


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bert_tiny_verifies_on_the_gpu(tvmbert, dtype):
    verified = tvmbert("verify", "bert-tiny", "--target", "cuda", "--dtype", dtype, "--json")
    assert verified.code == 0, verified.stderr
    assert verified.json["passed"]


@pytest.mark.cuda
def test_the_gpu_bench_times_every_gpu_peer_synchronized(tvmbert):
    report = tvmbert("bench", "bert-tiny", "--target", "cuda", "--dtype", "float16", "--repeat", "5", "--min-time", "0.2", "--json")
    assert report.code == 0, report.stderr
    engines = report.json["engines"]
    assert all(engines[name]["median_ms"] > 0 for name in ("tvm", *GPU_PEERS)), engines
    assert report.json["engine_dtypes"]["torch-eager"] == "float16"


@pytest.mark.cuda
def test_dispatch_runs_cuda_tensors_through_dlpack():
    import torch

    from tvmbert import add_tvm_dispatch

    layer = torch.nn.Linear(16, 16).cuda()
    inputs = torch.randn(4, 16, device="cuda", requires_grad=True)
    expected = layer(inputs)
    add_tvm_dispatch(layer, inputs, target=f"cuda -arch={targets.resolve('cuda').config['arch']}")
    got = layer(inputs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    got.sum().backward()
    assert inputs.grad is not None and inputs.grad.device.type == "cuda"

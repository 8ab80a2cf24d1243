"""A lent GPU machine's run, prepared on CPU: benchmarks/gpu_run.sh starts every step here (each
device step cross-compiles, then says in one line that there is no CUDA device), a GPU build is
timed against PyTorch on the same GPU, and what the GPU itself must show is marked cuda."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tvmbert.core import registry, targets
from tvmbert.core.errors import InputError
from tvmbert.stages.bench.engines import default_engines, peer_dtype

from helpers import CUDA_PRESENT, REPO, assert_one_line_error

SCRIPTS = ("benchmarks/gpu_run.sh", "benchmarks/lent_machine.sh", "benchmarks/steps.sh")
GPU_PEERS = ("torch-eager", "torch-sdpa", "torch-compile")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lent_machine_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(CUDA_PRESENT, reason="the dry run is for machines without a CUDA device")
def test_every_gpu_step_starts_here_and_says_there_is_no_cuda_device(tmp_path):
    """Each step a lent machine runs starts (the builds cross-compile) and stops at the device,
    in one line: a step that would not start on the GPU fails here first."""
    out = tmp_path / "out"
    environment = {**os.environ, "OUT": str(out), "MODEL": "bert-tiny", "PY": sys.executable, "WORK": str(tmp_path / "work"),
                   "STEPS": "verify-fp32 verify-fp16 bench-fp16 bench-fp32 tests"}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh")], env=environment, capture_output=True, text=True,
                          timeout=500)
    assert done.returncode == 0, done.stderr
    log = (out / "log.txt").read_text()
    for name in ("verify-fp32.json", "verify-fp16.json", "bench-fp16.json", "bench-fp32.json"):
        assert f"== {name}: exit 2 after" in log, log
    assert log.count("error: verify runs the model: this machine has no cuda device") == 2, log
    assert log.count("error: bench runs the model: this machine has no cuda device") == 2, log
    assert "Traceback" not in log
    for dtype in ("float32", "float16"):  # verify built the library before it looked for the device
        assert list((tmp_path / "work").glob(f"bert-tiny/b1-s14-{dtype}/cuda-*/build/model.so")), dtype
    assert "== tests.txt: exit 0 after" in log and "skipped" in (out / "tests.txt").read_text()


def test_a_gpu_build_is_timed_against_pytorch_on_its_gpu(tvmbert):
    """ONNX Runtime and OpenVINO run on the CPU here: a GPU build's ratio is against the PyTorch
    peers on the same GPU, in the build's own precision."""
    assert default_engines("float16", gpu=True) == ("tvm", *GPU_PEERS)
    assert all(registry.ENGINES[name].on_gpu for name in GPU_PEERS)
    assert peer_dtype("float16", gpu=True) == "float16" and peer_dtype("float16") == "float32"
    assert_one_line_error(tvmbert("bench", "bert-tiny", "--target", "cuda", "--engines", "tvm,onnxruntime"),
                          "onnxruntime runs on the CPU only", "torch-eager, torch-sdpa, torch-compile")


def test_dispatch_refuses_inputs_on_another_device_than_its_target():
    """DLPack hands TVM PyTorch's memory as it is: CPU tensors would reach a GPU build's kernels."""
    import torch

    from tvmbert import add_tvm_dispatch

    with pytest.raises(InputError, match="sample inputs are on cpu"):
        add_tvm_dispatch(torch.nn.Linear(4, 4), torch.ones(2, 4), target="cuda")


def test_a_cuda_package_is_refused_in_one_line_where_there_is_no_gpu(tmp_path, workdir):
    from tvmbert import load
    from tvmbert.core.config import JobConfig
    from tvmbert.stages.export import export

    if CUDA_PRESENT:
        pytest.skip("this machine has a CUDA device")
    export(JobConfig(model="bert-tiny", target="cuda", workdir=str(workdir)), tmp_path / "pkg", batches=(1,), seq_lens=(8,))
    with pytest.raises(InputError, match="built for cuda-sm_.*this machine has no cuda device"):
        load(tmp_path / "pkg")


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

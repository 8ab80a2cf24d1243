"""The engines bench times: set up from registry.ENGINES (a factory per entry below), and checked."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from tvmbert.core import artifacts, registry
from tvmbert.core.config import torch_dtype
from tvmbert.core.errors import InputError, first_line
from tvmbert.deploy import packing
from tvmbert.deploy.compiled import CompiledModel
from tvmbert.frontend import models
from tvmbert.stages.build import build
from tvmbert.stages.job import Job

ENGINES = tuple(registry.ENGINES)  # their names, in report order
# A sanity check of each engine against PyTorch eager in fp32 (fp64 for float64), not verify's bar.
# int8's catches a broken quantization only (bert-base with random weights, 1 x 128: tvm 0.095,
# ONNX Runtime's dynamic quantization 0.16, OpenVINO's NNCF 0.17): verify measures its accuracy.
CHECK_TOLERANCE = {"float32": 1e-3, "float64": 1e-8, "float16": 2e-2, "bfloat16": 5e-2, "int8": 1.0}
# The dtype the PyTorch peers run in, per --dtype: with --dtype bfloat16 the model cast to bf16,
# as HuggingFace users run bf16 inference on CPUs (from_pretrained(torch_dtype=torch.bfloat16)),
# and the cast also ran faster than torch.autocast (docs/benchmarks.md, bf16): the faster peer is
# the fair one. Everything runs in bf16 there (layer norm,
# softmax, GELU too), so its error against fp32 is larger than TVM's: PEER_CHECK_TOLERANCE.
# float16 peers stay float32 on CPUs (PyTorch's CPU fp16 is slow) and run float16 on GPUs, as
# users run them there; ONNX Runtime always runs float32. OpenVINO follows PyTorch: its bf16
# precision hint (AMX or AVX512-BF16), else f32.
PEER_DTYPE = {"bfloat16": "bfloat16"}
GPU_PEER_DTYPE = {"bfloat16": "bfloat16", "float16": "float16"}
# PyTorch's bert-base cast to float16 was 0.012 off fp32 at 8 x 128 (on a CPU): float16's 2e-2,
# TVM's bar with fp32 accumulation and fp32 layer norm, leaves its peers on a GPU too little room.
PEER_CHECK_TOLERANCE = {"bfloat16": 2e-1, "float16": 5e-2}
IN_PEER_DTYPE = ("torch-eager", "torch-sdpa", "torch-cudagraph", "torch-compile", "openvino")  # the engines PEER_DTYPE applies to
OPENVINO_PRECISION = {"float32": "f32", "bfloat16": "bf16"}
# What the quantized peers compute in, as the report says it.
QUANTIZED_PEERS = {
    "ort-int8": "int8 weight matmuls (ONNX Runtime dynamic quantization: weights per channel, inputs u8 per tensor)",
    "openvino-int8": "int8 (NNCF post-training quantization, calibrated on the bench's inputs)",
}
# Per output channel, as tvm quantizes: as fast as per tensor (docs/benchmarks.md, How bench
# measures) and closer to fp32.
PER_CHANNEL_ORT = True
CALIBRATION_SAMPLES = 16  # openvino-int8's calibration inputs
CAPTURE_WARMUP = 3  # eager calls on a side stream before a CUDA graph's capture, as PyTorch's docs ask
# torch.compile's mode per device: on a GPU "max-autotune" (Triton autotuned matmuls, CUDA graphs),
# what users pick for the fastest inference; its compile takes minutes (the default mode's alone
# outran 80 s for bert-base on an H200), part of its setup, not of its time.
TORCH_COMPILE_MODE = {"cuda": "max-autotune", "cpu": None}


def default_engines(dtype: str, gpu: bool = False) -> tuple[str, ...]:
    """Every default engine, and the peers that quantize to ``dtype``; for a GPU build, those
    that run on its GPU."""
    return tuple(name for name, engine in registry.ENGINES.items()
                 if engine.default and engine.quantized in (None, dtype) and (engine.on_gpu or not gpu) and (gpu or not engine.gpu_only))


def peer_dtype(dtype: str, gpu: bool = False) -> str:
    return (GPU_PEER_DTYPE if gpu else PEER_DTYPE).get(dtype, torch_dtype(dtype))


def check_tolerance(engine: str, dtype: str, gpu: bool = False) -> float:
    quantized = registry.ENGINES[engine].quantized
    if quantized is not None:
        return CHECK_TOLERANCE[quantized]
    if engine in IN_PEER_DTYPE and peer_dtype(dtype, gpu) != torch_dtype(dtype):
        return PEER_CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[dtype])
    return CHECK_TOLERANCE[dtype]


def torch_device(job: Job) -> str:
    """Where the PyTorch peers run: a GPU build's GPU (PyTorch names ROCm's "cuda" too), else the CPU."""
    return "cuda" if job.target.is_gpu else "cpu"


@dataclass
class Engine:
    name: str
    run: Callable[[], object]  # one inference, synchronized
    outputs: Callable[[], list[np.ndarray]]  # one inference, results on the host
    setup_s: float = 0.0  # export / compile / build / load: the one-time cost
    memory_mb: float = 0.0  # resident memory the engine added when set up and first run
    timings_ms: list[float] = field(default_factory=list)
    after_idle_ms: list[float] = field(default_factory=list)  # calls after bench.timing.IDLE_S without calls
    quiet_ms: list[float] = field(default_factory=list)  # before each round: how long the process took to go quiet


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def tvm_engine(job: Job, inputs, threads: int) -> Engine:
    built = job.upstream("build", build)
    compiled = CompiledModel(built, job)
    device_inputs = compiled.to_device([t.numpy() for t in inputs])

    def run():
        compiled.run_on_device(device_inputs)
        compiled.sync()

    engine = Engine("tvm", run, lambda: compiled([t.numpy() for t in inputs]))
    engine.setup_s = float(built.meta.get("build_seconds", 0.0))
    return engine


def tvm_packed_engine(job: Job, inputs, threads: int) -> Engine:
    """The packed build of these rows, its token capacity exactly their real tokens: what a
    padding-free runtime computes (same rows in, outputs back in rows)."""
    mask = inputs[job.inputs.names.index("attention_mask")].numpy()
    tokens = int(packing.lengths(mask, mask.shape).sum())
    engine = tvm_engine(Job(replace(job.config, tokens=tokens), no_deps=job.no_deps, say=job.say), inputs, threads)
    engine.name = "tvm-packed"
    return engine


def _torch(name: str, job: Job, inputs, attention: str, compiled: bool = False, dtype: str | None = None,
           graph: bool = False) -> Engine:
    """A PyTorch peer on ``torch_device``: on a GPU, each call synchronized (kernels launch
    asynchronously, and a timer would otherwise time the launches). With ``graph``, the forward
    is captured once in a torch.cuda.CUDAGraph and each call replays it on the same input buffers."""
    import torch

    device = torch_device(job)
    model = models.load(job.source, dtype or peer_dtype(job.config.dtype, job.target.is_gpu), job.config.seed,
                        attn_implementation=attention).to(device)
    if compiled:
        model = torch.compile(model, backend="inductor", mode=TORCH_COMPILE_MODE[device])
    placed = tuple(t.to(device) for t in inputs)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward():
        with torch.inference_mode():
            return model(*placed)

    if graph:
        forward = _captured(forward)

    def run():
        outputs = forward()
        synchronize()
        return outputs

    return Engine(name, run, lambda: [t.float().cpu().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.cpu().numpy()
                                      for t in run()])


def _captured(forward):
    """``forward`` captured in a CUDA graph: warmed up on a side stream, captured once; the
    returned call replays it and returns the captured outputs, rewritten in place by each replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARMUP):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        outputs = forward()

    def replay():
        cuda_graph.replay()
        return outputs

    # The graph reads the buffers it was captured on, the model's weights and the inputs, which
    # only ``forward``'s closure holds: freed with it, their memory went to other tensors, and a
    # replay embedded whatever ids it found there (an H200's run: an index out of range, the
    # device's assert, every later call failing).
    replay.captured_from = forward
    return replay


def reference(job: Job, inputs) -> list[np.ndarray]:
    """What every engine is checked against: PyTorch eager in fp32 (fp64 for float64)."""
    return [np.asarray(o) for o in _torch("torch-eager", job, inputs, "eager", dtype=torch_dtype(job.config.dtype)).outputs()]


def check_engines(job: Job, names) -> None:
    """A GPU build is timed against peers on its GPU: a CPU-only peer named for it is refused, and
    a GPU-only peer named for a CPU build."""
    gpu_only = [name for name in names if not job.target.is_gpu and registry.ENGINES[name].gpu_only]
    if gpu_only:
        raise InputError(f"--engines: {', '.join(gpu_only)} needs a GPU, and this is a {job.target.kind} build: "
                         "use --target cuda")
    on_cpu = [name for name in names if job.target.is_gpu and not registry.ENGINES[name].on_gpu]
    if on_cpu:
        gpu_peers = ", ".join(n for n, e in registry.ENGINES.items() if e.on_gpu and not n.startswith("tvm"))
        raise InputError(f"--engines: {', '.join(on_cpu)} {'runs' if len(on_cpu) == 1 else 'run'} on the CPU only, and a "
                         f"{job.target.kind} build is timed against peers on its GPU: {gpu_peers}")


def torch_eager(job: Job, inputs, threads: int) -> Engine:
    return _torch("torch-eager", job, inputs, "eager")


def torch_sdpa(job: Job, inputs, threads: int) -> Engine:
    return _torch("torch-sdpa", job, inputs, "sdpa")


def fastest_attention(job: Job) -> str:
    """The attention a PyTorch user of this family would compile or capture: SDPA where
    transformers has it for the family, else eager (DeBERTa-v2 has no SDPA attention)."""
    return "sdpa" if getattr(models.model_class(job.source), "_supports_sdpa", False) else "eager"


def torch_cudagraph(job: Job, inputs, threads: int) -> Engine:
    return _torch("torch-cudagraph", job, inputs, fastest_attention(job), graph=True)


def torch_compile(job: Job, inputs, threads: int) -> Engine:
    return _torch("torch-compile", job, inputs, fastest_attention(job), compiled=True)


def onnx_session(job: Job, path, sample, threads: int, dynamic_shapes=None):
    """An ONNX Runtime session on the job's model, exported to ``path`` once (atomically) from
    ``sample`` inputs (torch tensors); ``dynamic_shapes`` as torch.onnx.export takes them."""
    export_onnx(job, path, sample, dynamic_shapes)
    return ort_session(path, threads)


def export_onnx(job: Job, path, sample, dynamic_shapes=None) -> None:
    import torch

    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        model = models.load(job.source, torch_dtype(job.config.dtype), job.config.seed, attn_implementation="eager")
        with _quiet(), _onnx_written(path) as tmp:  # its exporter logs a warning for each torchvision op it cannot register
            torch.onnx.export(model, tuple(sample), str(tmp), input_names=list(job.source.inputs),
                              output_names=list(model.output_names), dynamic_shapes=dynamic_shapes, dynamo=True, optimize=True,
                              verbose=False)


@contextlib.contextmanager
def _onnx_written(path):
    """A path to write an ONNX model to, moved to ``path`` when the block ends without error. The
    exporter names its external weights file after the model's file and records that name in it,
    so the model is written under its final name in a scratch folder; the weights move first and
    the model last, so that a model file present is a complete one. A killed bench's folder goes
    at the next export (``artifacts.scratch_beside``)."""
    with artifacts.scratch_beside(path) as scratch:
        yield scratch / path.name
        for written in sorted(scratch.iterdir(), key=lambda file: file.name == path.name):
            written.replace(path.parent / written.name)


def ort_session(path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def onnxruntime_engine(job: Job, inputs, threads: int) -> Engine:
    session = onnx_session(job, job.stage_dir("build").parent / "onnx" / "model.onnx", inputs, threads)
    feed = {name: t.numpy() for name, t in zip(job.source.inputs, inputs)}
    return Engine("onnxruntime", lambda: session.run(None, feed), lambda: session.run(None, feed))


@contextlib.contextmanager
def _quiet():
    """A peer's own tool (the ONNX exporter, a quantizer), silenced: its stdout (progress bars) and its logged warnings."""
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            yield
    finally:
        logging.disable(previous)


def ort_int8_engine(job: Job, inputs, threads: int) -> Engine:
    """ONNX Runtime's dynamic quantization of the same exported model (``quantize_dynamic``: int8
    weights per output channel, each MatMul's input quantized to u8 per tensor at run time), as
    optimum's ORTQuantizer and sentence-transformers' ``export_dynamic_quantized_onnx_model`` make
    it (PER_CHANNEL_ORT)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = job.stage_dir("build").parent / "onnx"
    export_onnx(job, folder / "model.onnx", inputs)
    path = folder / "model-int8.onnx"
    if not path.is_file():
        with _quiet(), _onnx_written(path) as tmp:  # its advice to pre-process (shape inference) changes nothing here
            quantize_dynamic(folder / "model.onnx", tmp, weight_type=QuantType.QInt8, per_channel=PER_CHANNEL_ORT)
    session = ort_session(path, threads)
    feed = {name: t.numpy() for name, t in zip(job.source.inputs, inputs)}
    return Engine("ort-int8", lambda: session.run(None, feed), lambda: session.run(None, feed))


def openvino_int8_engine(job: Job, inputs, threads: int) -> Engine:
    """OpenVINO's int8 as its docs make it: NNCF's post-training ``quantize`` (transformer
    preset: int8 weights per channel, activations calibrated) on a calibration set of the bench's
    own input and seeded random inputs of its shape, then the CPU plugin as ``openvino_engine``
    configures it."""
    import nncf
    import openvino

    from tvmbert.stages.verify import sample_inputs

    model = models.load(job.source, "float32", job.config.seed, attn_implementation="eager")
    converted = openvino.convert_model(model, example_input=tuple(inputs), share_weights=False)  # copied, as openvino_engine says why
    calibration = [[t.numpy() for t in sample] for sample in [tuple(inputs), *sample_inputs(job, CALIBRATION_SAMPLES)[1:]]]
    with _quiet():  # NNCF draws progress bars on stdout, where bench --json writes its report
        quantized = nncf.quantize(converted, nncf.Dataset(calibration), model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(calibration))
    compiled = openvino.Core().compile_model(quantized, "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    feed = [t.numpy() for t in inputs]

    def outputs():
        request.infer(feed)
        return [_openvino_array(openvino, request.get_output_tensor(i)) for i in range(len(compiled.outputs))]

    return Engine("openvino-int8", lambda: request.infer(feed), outputs)


def openvino_engine(job: Job, inputs, threads: int) -> Engine:
    """OpenVINO's CPU plugin on the same PyTorch model (``openvino.convert_model``), configured as
    its docs advise for latency: one stream, the bench's threads, the precision asked for (it
    would otherwise run bf16 on CPUs that have it)."""
    import openvino

    precision = OPENVINO_PRECISION.get(peer_dtype(job.config.dtype))
    if precision is None:
        raise RuntimeError(f"OpenVINO's CPU plugin computes in f32 or bf16, not {peer_dtype(job.config.dtype)}")
    model = models.load(job.source, peer_dtype(job.config.dtype), job.config.seed, attn_implementation="eager")
    # Weights copied: shared (convert_model's default), a bf16 compiled model reads the PyTorch
    # model's tensors in place, and they are freed when this function returns (bert-base bf16
    # beside torch-eager: a segfault in bench's rounds).
    converted = openvino.convert_model(model, example_input=tuple(inputs), share_weights=False)
    compiled = openvino.Core().compile_model(converted, "CPU", {
        "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    feed = [t.numpy() for t in inputs]

    def outputs():
        request.infer(feed)
        return [_openvino_array(openvino, request.get_output_tensor(i)) for i in range(len(compiled.outputs))]

    return Engine("openvino", lambda: request.infer(feed), outputs)


def _openvino_array(openvino, tensor) -> np.ndarray:
    """A copy of an OpenVINO output as float32 where it is bf16: its ``data`` hands a bf16 tensor's
    bits as a float16 array (NumPy has no bf16), which read as float16 are other numbers
    (bert-base bf16 1 x 128: a max abs diff of 2.3 against PyTorch, for OpenVINO's right answers)."""
    if tensor.element_type == openvino.Type.bf16:
        import ml_dtypes

        return tensor.data.view(ml_dtypes.bfloat16).astype(np.float32)
    return np.array(tensor.data)


def failure_line(exc: Exception) -> str:
    """A peer's failure as the report gives it: its type, then its message's first line cut at 160
    (a bare ``assert`` has none: its type alone)."""
    return f"{type(exc).__name__}: {first_line(exc)[:160]}" if str(exc).strip() else type(exc).__name__


def why_unavailable(name: str, job: Job) -> str | None:
    """Why an engine cannot run here, or on this model, or None."""
    missing = [m for m in registry.ENGINES[name].requires if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed ({', '.join(missing)}): pip install 'tvmbert[peers]'"
    if name == "torch-sdpa" and fastest_attention(job) != "sdpa":
        return (f"transformers has no SDPA attention for {models.model_class(job.source).__name__} "
                "(torch-eager and torch-compile time the attention it has)")
    return None


def _make(name: str, job: Job, inputs, threads: int) -> Engine:
    factory = registry.resolve(registry.ENGINES[name].factory)
    before, started = _rss_mb(), time.perf_counter()
    engine = factory(job, inputs, threads)
    engine.run()  # first call: lazy compilation (torch.compile) and allocation belong to setup
    engine.setup_s += time.perf_counter() - started
    engine.memory_mb = max(0.0, _rss_mb() - before)
    return engine


class Incomparable(Exception):
    """An engine's outputs that cannot be compared with the reference: their count, a shape, a NaN or inf."""


def _check(engine: Engine, expected: list[np.ndarray], mask: np.ndarray, per_token: list[bool], tolerance: float) -> dict:
    """Its largest difference from ``expected`` on real tokens only (padded positions are not part
    of anybody's answer), the bound and whether it is within: an engine beyond it is still timed,
    so that its time and its error are seen side by side."""
    got = engine.outputs()
    if len(got) != len(expected):
        raise Incomparable(f"returned {len(got)} outputs, expected {len(expected)}")
    worst = 0.0
    for have, want, token_rows in zip(got, expected, per_token):
        if np.shape(have) != want.shape:
            raise Incomparable(f"returned an output of shape {np.shape(have)}, expected {want.shape}")
        diff = np.abs(np.asarray(have, dtype=np.float64) - want.astype(np.float64))
        if token_rows:
            diff = diff[mask.astype(bool)]
        if not np.isfinite(diff).all():
            raise Incomparable("returned NaN or inf")
        worst = max(worst, float(diff.max()))
    return {"max_abs_diff": float(f"{worst:.3g}"), "bound": tolerance, "within": worst <= tolerance}

"""The tables of stages and of bench engines: adding one is one entry here (and its code).

Config and job read these tables and sit below the stages, so an entry names its code as
"module:function" under tvmbert, imported when it runs, as entry points do: reading a table
imports no stage.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from tvmbert.core.artifacts import artifact_summary


def resolve(reference: str):
    """'module:function' under tvmbert -> the function."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(f"tvmbert.{module}"), name)


@dataclass(frozen=True)
class Stage:
    name: str
    function: str  # "module:function": the stage, called with a Job
    per_target: bool  # its folder is under the target's key: built for the target, or run on it
    cached: bool = True  # returns an Artifact, reused while its inputs are unchanged (force= redoes it); else a report

    def run(self, job, force: bool = False) -> dict:
        """The stage's result as JSON: the artifact's summary, or the report (a dict, or its to_json())."""
        function = resolve(self.function)
        if self.cached:
            return artifact_summary(function(job, force=force))
        result = function(job)
        return result if isinstance(result, dict) else result.to_json()


# In pipeline order.
STAGES = {stage.name: stage for stage in (
    Stage("trace", "stages.trace:trace", per_target=False),
    Stage("convert", "stages.convert:convert", per_target=False),
    Stage("optimize", "stages.optimize:optimize", per_target=False),
    Stage("tune", "stages.tune:tune", per_target=True, cached=False),
    Stage("build", "stages.build:build", per_target=True),
    Stage("verify", "stages.verify:verify", per_target=True, cached=False),
    Stage("bench", "stages.bench:bench", per_target=True, cached=False),
    Stage("export", "stages.export:export", per_target=True, cached=False),
)}


@dataclass(frozen=True)
class BenchEngine:
    name: str
    factory: str  # "module:function": (job, inputs, threads) -> bench.engines.Engine, set up
    requires: tuple[str, ...] = ()  # modules it imports, from tvmbert's [peers] extra: without them it is skipped
    default: bool = True  # timed when --engines is not given (else only when named, or by bench --packed)
    quantized: str | None = None  # the dtype it quantizes the model's matmuls to: timed by default for that --dtype only
    on_gpu: bool = False  # runs on a GPU target's device (the others run on the CPU: never timed against a GPU build)
    gpu_only: bool = False  # needs a GPU: timed by default for GPU builds only, refused for a CPU one


# In report order; tvm, the subject, first.
ENGINES = {engine.name: engine for engine in (
    BenchEngine("tvm", "stages.bench.engines:tvm_engine", on_gpu=True),
    # The packed build of the same rows (packing.py): one more build per shape, so asked for.
    BenchEngine("tvm-packed", "stages.bench.engines:tvm_packed_engine", default=False, on_gpu=True),
    BenchEngine("torch-eager", "stages.bench.engines:torch_eager", on_gpu=True),
    BenchEngine("torch-sdpa", "stages.bench.engines:torch_sdpa", on_gpu=True),
    # SDPA captured once per shape in a CUDA graph and replayed: eager PyTorch on a GPU is launch-bound
    # (~9 ms for bert-base at every shape on an H200, 0.75-2.4 ms captured).
    BenchEngine("torch-cudagraph", "stages.bench.engines:torch_cudagraph", on_gpu=True, gpu_only=True),
    BenchEngine("torch-compile", "stages.bench.engines:torch_compile", on_gpu=True),
    BenchEngine("onnxruntime", "stages.bench.engines:onnxruntime_engine", requires=("onnxruntime", "onnx", "onnxscript")),
    BenchEngine("openvino", "stages.bench.engines:openvino_engine", requires=("openvino",)),
    # What users who quantize pick on CPUs (sentence-transformers' guidance: ONNX int8, OpenVINO int8).
    BenchEngine("ort-int8", "stages.bench.engines:ort_int8_engine", requires=("onnxruntime", "onnx", "onnxscript"), quantized="int8"),
    BenchEngine("openvino-int8", "stages.bench.engines:openvino_int8_engine", requires=("openvino", "nncf"), quantized="int8"),
)}

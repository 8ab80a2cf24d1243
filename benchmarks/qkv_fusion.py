"""What combine-qkv buys: tuned TVM builds with and without it, timed together in one run.

    python benchmarks/qkv_fusion.py [MODEL] [SEQ_LEN]      # default: bert-base 14 (the seed shape)

Both builds use the committed tuning logs (the unfused Q/K/V matmuls have the same workload as
the attention output projection, so both are fully tuned); torch-eager runs beside them as the
common reference. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from tvmbert import Job, JobConfig, build
from tvmbert.core.targets import cpu_count
from tvmbert.deploy.compiled import CompiledModel
from tvmbert.passes.pipeline import DEFAULT_PASSES
from tvmbert.stages.bench.engines import Engine
from tvmbert.stages.bench.timing import _summary, measure, set_threads


def engine(name: str, job: Job) -> tuple[Engine, dict]:
    built = build(job)
    compiled = CompiledModel(built, job)
    inputs = compiled.to_device([t.numpy() for t in job.inputs.as_tuple()])
    def run():
        compiled.run_on_device(inputs)
        compiled.sync()

    return Engine(name, run, lambda: []), built.meta


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "bert-base"
    seq_len = int(sys.argv[2]) if len(sys.argv) > 2 else 14
    fused = JobConfig(model=model, seq_len=seq_len)
    unfused = replace(fused, passes=tuple(p for p in DEFAULT_PASSES if p != "combine-qkv"), workdir="build/no-combine-qkv")
    set_threads(cpu_count())
    engines, builds = [], {}
    for name, config in (("tvm combine-qkv", fused), ("tvm without combine-qkv", unfused)):
        made, meta = engine(name, Job(config))
        engines.append(made)
        builds[name] = {"tasks_total": meta["tasks_total"], "tasks_tuned": meta["tasks_tuned"]}
    import torch

    from tvmbert.frontend import models

    job = Job(fused)
    reference = models.load(job.source)
    inputs = job.inputs.as_tuple()

    def eager():
        with torch.inference_mode():
            reference(*inputs)

    engines.append(Engine("torch-eager", eager, lambda: []))
    measure(engines, warmup=5, repeat=30, min_time_s=5.0)
    report = {e.name: _summary(e, 1) for e in engines}
    for name, meta in builds.items():
        report[name].update(meta)
    first, second = (report[name]["median_ms"] for name in builds)
    print(json.dumps({"model": model, "seq_len": seq_len, "engines": report, "fused_over_unfused": round(first / second, 3)},
                     indent=2))


if __name__ == "__main__":
    main()

"""Hand-written CPU schedules: which kernels they take, and that they compute what the kernel does."""

from __future__ import annotations

import numpy as np
import pytest

from tvmbert import Job, JobConfig, optimize, schedules, tuning_db
from tvmbert.convert import load_module


@pytest.fixture(scope="module")
def tasks(workdir):
    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir)))
    module = tuning_db.inference_module(load_module(optimize(job).path), job.target)
    return {t.name: t for t in tuning_db.extract_tasks(module, job.target)}


def test_streaming_matmul_takes_the_weight_matmuls_only(tasks):
    taken = {name for name, task in tasks.items() if schedules.applies(task.module)}
    # QKV, attention output, FFN up and down, pooler (+ tanh): not the attention's activation matmuls.
    assert taken == {"fused_matmul_add2", "fused_matmul3_add4", "fused_matmul4_add5", "fused_matmul5_add4",
                     "fused_matmul6_add6_tir_tanh"}


@pytest.mark.parametrize("name", ["fused_matmul_add2", "fused_matmul6_add6_tir_tanh"])
def test_streaming_matmul_computes_the_kernel(tasks, name):
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    task = tasks[name]
    target = tvm.target.Target({"kind": "llvm"})
    (_, func), = task.module.functions_items()
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([int(d) for d in info.shape]).astype(info.dtype) for info in ArgInfo.from_prim_func(func)]

    def run(module):
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        tvm.compile(module, target=target).mod["main"](*tensors)
        return tensors[-1].numpy()

    expected = run(task.module)
    found = schedules.candidates(task.module)
    assert {variant.band for variant, _ in found} >= {16, 32}
    for variant, sch in found[:: max(1, len(found) // 3)]:
        assert schedules.MARK in str(sch.trace) and "transform_layout" in str(sch.trace)
        np.testing.assert_allclose(run(sch.mod), expected, rtol=1e-5, atol=1e-5, err_msg=variant.name)

"""Records across CPUs, default CPU schedules, the shipped compact logs, --adapt, interruption."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest

from tvmbert.core.targets import resolve
from tvmbert.ir.tasks import extract_tasks, inference_module
from tvmbert.tuning import catalog, database, record_files
from tvmbert.tuning.catalog import Catalog

from helpers import ALIKE, OTHER_CPU, SMALL_TUNE, tune_in_background

HOST = resolve("llvm").key
# A CPU this machine runs code for, with no logs of its own in these tests' log dirs.
OTHER_TARGET = f"llvm -mcpu={OTHER_CPU}"
SMALL = SMALL_TUNE


def fake_record(*insts):
    return SimpleNamespace(trace=SimpleNamespace(insts=[
        SimpleNamespace(kind=SimpleNamespace(name=kind), attrs=attrs, inputs=inputs) for kind, attrs, inputs in insts]))


def test_nearest_cpu_first_same_isa_level_before_same_vendor_never_another_architecture(tmp_path):
    for key in ("llvm-znver4", "llvm-haswell", "llvm-neoverse-v1", "llvm-icelake-server", "cuda-sm_90"):
        (tmp_path / key).mkdir()
        (tmp_path / key / record_files.COMPACT_FILE).write_bytes(gzip.compress(b""))
    found = Catalog(tmp_path / "llvm-skylake-avx512", "llvm-skylake-avx512", print)
    # AVX-512 Intel, then AVX-512 AMD, then AVX2 Intel; no Arm, no GPU.
    assert [s.key for s in found.others] == ["llvm-icelake-server", "llvm-znver4", "llvm-haswell"]
    arm = Catalog(tmp_path / "llvm-neoverse-n1", "llvm-neoverse-n1", print)
    assert [s.key for s in arm.others] == ["llvm-neoverse-v1"]
    assert catalog.describe("llvm-notacpu") is None


def test_a_record_tensorized_with_a_missing_instruction_never_fits():
    vnni = fake_record(("GetSBlock", [], []), ("Tensorize", ["dot_16x4_vnni", True], ["b0"]))
    auto = fake_record(("Annotate", ["meta_schedule.auto_tensorize"], ["b0", "dot_16x4_avx512"]))
    unknown = fake_record(("Tensorize", ["amx_tile_mystery", True], ["b0"]))
    plain = fake_record(("Split", [True], ["l0"]))
    zen, haswell, skx = (catalog.describe(k) for k in ("llvm-znver4", "llvm-haswell", "llvm-skylake-avx512"))
    assert catalog.fits(vnni, zen) and not catalog.fits(vnni, haswell) and not catalog.fits(vnni, skx)
    assert catalog.fits(auto, skx) and not catalog.fits(auto, haswell)
    assert not catalog.fits(unknown, zen)  # an intrinsic we cannot vouch for is never carried
    assert catalog.fits(plain, haswell)


def test_build_on_a_cpu_without_logs_takes_every_schedule_from_the_nearest_one(tvmbert, tuned_everywhere_alike):
    tuned = tuned_everywhere_alike
    built = tvmbert("build", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--log-dir", str(tuned), "--json")
    assert built.code == 0, built.stderr
    assert built.json["tasks_tuned"] == built.json["tasks_total"] > 0
    assert set(built.json["schedules"].values()) == {f"transferred from {HOST}"}
    assert f"{built.json['tasks_total']} transferred from {HOST}" in built.stderr and "--adapt" in built.stderr
    assert str(tuned / HOST) in built.json["databases_read"]
    verified = tvmbert("verify", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--log-dir", str(tuned), "--json")
    assert verified.code == 0 and verified.json["max_abs_diff"] <= 1e-5


def test_a_change_in_any_database_invalidates_the_build(tvmbert, tuned_everywhere_alike, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(tuned_everywhere_alike, logs)
    first = tvmbert("build", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--log-dir", str(logs), "--json")
    assert set(first.json["schedules"].values()) == {f"transferred from {HOST}"}
    shutil.rmtree(logs / HOST)
    again = tvmbert("build", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--log-dir", str(logs), "--json")
    assert again.code == 0 and not again.json["cached"]
    assert set(again.json["schedules"].values()) == {"default"}


def test_default_schedules_leave_no_kernel_a_naive_loop_nest(tvmbert, workdir, tmp_path):
    import numpy as np
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from tvmbert import Job, JobConfig, optimize
    from tvmbert.ir.files import load_module
    from tvmbert.tuning.default_schedules import default_cpu_schedules

    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir), log_dir=str(tmp_path)))
    module = inference_module(load_module(optimize(job).path), job.target)
    target = job.target.tvm_target()
    rng = np.random.default_rng(0)
    for task in extract_tasks(module, job.target):
        with target:
            scheduled = default_cpu_schedules()(task.module)
        if task.trivial:
            continue
        assert scheduled["main"].attrs.get("tirx.is_scheduled"), task.name
        text = scheduled["main"].script()
        assert "T.parallel" in text or "T.vectorized" in text, task.name
        arrays = [rng.standard_normal([int(d) for d in a.shape]).astype(a.dtype) if "float" in a.dtype
                  else np.zeros([int(d) for d in a.shape], a.dtype) for a in ArgInfo.from_prim_func(task.module["main"])]
        outputs = []
        for mod in (task.module, scheduled):
            tensors = [tvm.runtime.tensor(a) for a in arrays]
            tvm.compile(mod, target=target)(*tensors)
            outputs.append(tensors[-1].numpy())
        np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-5, err_msg=task.name)
    built = tvmbert("build", "bert-tiny", "--log-dir", str(tmp_path), "--json")
    assert built.code == 0 and set(built.json["schedules"].values()) == {"default"}
    verified = tvmbert("verify", "bert-tiny", "--log-dir", str(tmp_path), "--dtype", "float64", "--json")
    assert verified.code == 0, verified.stderr


def test_compact_keeps_the_best_records_and_builds_choose_the_same(tvmbert, tuned, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(tuned, logs)
    history = database.open_database(logs / HOST)
    compacted = tvmbert("compact", "--log-dir", str(logs), "--top-k", "2", "--json", workdir_arg=False)
    assert compacted.code == 0, compacted.stderr
    (summary,) = compacted.json["databases"]
    assert summary["records"] < summary["records_before"]
    for name in (record_files.WORKLOADS_FILE, record_files.RECORDS_FILE):
        (logs / HOST / name).unlink()  # a fresh clone: the shipped file alone
    shipped = database.open_database(logs / HOST)
    for record in history.get_all_tuning_records():
        best = database.valid_records(history, record.workload.mod)[:1]
        again = database.valid_records(shipped, record.workload.mod)[:1]
        assert [str(r.trace) for r in best] == [str(r.trace) for r in again]
    built = tvmbert("build", "bert-tiny", "--log-dir", str(logs), "--json")
    assert built.json["tasks_tuned"] == built.json["tasks_total"] > 0 and set(built.json["schedules"].values()) == {"native"}
    # Done tasks stay done with only the shipped records.
    again = tvmbert("tune", "bert-tiny", *SMALL, "--log-dir", str(logs), "--json")
    assert again.code == 0 and again.json["new_trials"] == 0


def test_compact_carries_over_a_line_this_tvm_cannot_read(tvmbert, tuned, tmp_path):
    """A line that fails to parse here but is not damaged (its trace names an instruction this TVM
    lacks, as a CUDA record named intrinsics a process had not registered) stays in the shipped
    file as it was: compact rewrites the rest around it, and says so."""
    logs = tmp_path / "logs"
    shutil.copytree(tuned, logs)
    tvmbert("compact", "--log-dir", str(logs), "--json", workdir_arg=False)
    shipped = logs / HOST / record_files.COMPACT_FILE
    lines = gzip.decompress(shipped.read_bytes()).decode().splitlines()
    foreign = json.loads(lines[0])
    foreign["records"][0][0][0][0][0] = "AnInstructionOfAnotherTVM"  # the first instruction's kind
    lines[0] = json.dumps(foreign)
    shipped.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    for name in (record_files.WORKLOADS_FILE, record_files.RECORDS_FILE):
        (logs / HOST / name).unlink()  # a fresh clone: the shipped file alone holds that workload's records
    compacted = tvmbert("compact", "--log-dir", str(logs), "--json", workdir_arg=False)
    assert compacted.code == 0, compacted.stderr
    (summary,) = compacted.json["databases"]
    assert summary["unread_lines_kept"] == 1 and "AnInstructionOfAnotherTVM" in compacted.stderr
    after = gzip.decompress(shipped.read_bytes()).decode().splitlines()
    assert lines[0] in after and len(after) == len(lines)


@pytest.mark.slow
def test_records_are_checked_against_their_workload(tvmbert, tuned, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(tuned, logs)
    folder = logs / HOST
    # The history's workload file replaced (here: two lines swapped): records name their workload.
    workloads = (folder / record_files.WORKLOADS_FILE).read_text().splitlines()
    workloads[0], workloads[1] = workloads[1], workloads[0]
    (folder / record_files.WORKLOADS_FILE).write_text("\n".join(workloads) + "\n")
    (folder / record_files.COMPACT_FILE).unlink()
    warnings = []
    records = database.open_database(folder, warn=warnings.append)
    assert warnings and all("was measured on workload" in w for w in warnings)
    for record in records.get_all_tuning_records():
        assert record_files.workload_key(record.workload.mod) in {json.loads(line)[2] for line in
                                                                (folder / record_files.RECORDS_FILE).read_text().splitlines()}
    # A compact line whose IR is not the workload its hash names is refused.
    shutil.rmtree(folder)
    shutil.copytree(tuned / HOST, folder)
    for name in (record_files.WORKLOADS_FILE, record_files.RECORDS_FILE):
        (folder / name).unlink()
    lines = gzip.decompress((folder / record_files.COMPACT_FILE).read_bytes()).decode().splitlines()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    first["mod"] = second["mod"]
    lines[0] = json.dumps(first)
    (folder / record_files.COMPACT_FILE).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    warnings = []
    database.open_database(folder, warn=warnings.append)
    assert len(warnings) == 1 and "reads back as" in warnings[0] and "not its records" in warnings[0]
    # "done" with no readable record is not done: tune spends trials on it again.
    retuned = tvmbert("tune", "bert-tiny", *SMALL, "--log-dir", str(logs), "--json")
    assert retuned.code == 0 and retuned.json["new_trials"] > 0


def test_adapt_makes_another_cpus_records_this_ones(tvmbert, tuned_everywhere_alike, tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(tuned_everywhere_alike, logs)
    adapted = tvmbert("tune", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--adapt", "--trials", "16",
                      "--log-dir", str(logs), "--json")
    assert adapted.code == 0, adapted.stderr
    assert adapted.json["target"] == f"llvm-{OTHER_CPU}" and adapted.json["new_trials"] > adapted.json["tasks_total"]
    assert "ETA" in adapted.stderr
    built = tvmbert("build", "bert-tiny", *ALIKE, "--target", OTHER_TARGET, "--log-dir", str(logs), "--json")
    assert built.code == 0 and set(built.json["schedules"].values()) == {"native"}
    # Measured here, at this machine's core count.
    records = database.open_database(logs / f"llvm-{OTHER_CPU}")
    targets = {str(r.target.attrs["mcpu"]) + "/" + str(r.target.attrs["num-cores"]) for r in records.get_all_tuning_records()}
    assert targets == {f"{OTHER_CPU}/{os.cpu_count()}"}
    assert (logs / f"llvm-{OTHER_CPU}" / record_files.COMPACT_FILE).is_file()
    nothing = tvmbert("tune", "bert-tiny", "--adapt", "--log-dir", str(tmp_path / "empty"))
    assert nothing.code == 2 and "there are no records for bert-tiny" in nothing.stderr


@pytest.mark.slow
def test_interrupted_tune_says_how_to_resume(tmp_path, workdir):
    process, _, records = tune_in_background(tmp_path / "logs", workdir, trials=64, records=16,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: tuning interrupted") and "run the same command again to resume" in last
    assert "internal failure" not in stderr and "Traceback" not in stderr
    assert records.read_text().count("\n") >= 16  # what was measured is kept


pytestmark = pytest.mark.slow

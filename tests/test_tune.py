"""Tuning for real: MetaSchedule on bert-tiny with a few trials, resumable, shared, remote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tvmbert.ir.tasks import LAYOUT_FREE, Task, entry_module, extract_tasks, inference_module, marked_kernels
from tvmbert.tuning import database, record_files
from tvmbert.tuning.catalog import Catalog
from tvmbert.tuning.search import plan

from helpers import NO_KERNELS, SMALL_TUNE, WITHOUT_KERNELS, tune_in_background

pytestmark = pytest.mark.slow

SMALL = SMALL_TUNE


def records_file(log_dir: Path) -> Path:
    (folder,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return folder / record_files.RECORDS_FILE


def test_tune_then_build_has_every_task_tuned(tvmbert, tuned):
    built = tvmbert("build", "bert-tiny", "--log-dir", str(tuned), "--json")
    assert built.code == 0, built.stderr
    assert built.json["tasks_total"] > 0
    assert built.json["tasks_tuned"] == built.json["tasks_total"] and built.json["untuned"] == []
    verified = tvmbert("verify", "bert-tiny", "--log-dir", str(tuned), "--json")
    assert verified.code == 0 and verified.json["max_abs_diff"] <= 1e-5


def test_cpu_kernels_read_weights_prepacked_in_their_tuned_layout(tvmbert, tuned_schedules, workdir):
    from tvmbert import Job, JobConfig, optimize
    from tvmbert.deploy.weights import PARAMS_FILE, load_params
    from tvmbert.ir.files import load_module

    tuned = tuned_schedules
    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir), log_dir=str(tuned), disable=NO_KERNELS))
    module = inference_module(load_module(optimize(job).path), job.target)
    marked = {t.name: [int(i) for i in t.module["main"].attrs.get(LAYOUT_FREE, [])]
              for t in extract_tasks(module, job.target)}
    # The dense layers' weight matrices (argument 1); not the attention matmuls, biases or LayerNorm.
    assert marked["fused_matmul_add2"] == [1] and marked["fused_matmul5_add4"] == [1]
    assert marked["matmul2"] == [] and marked["layer_norm"] == [] and marked["fused_reshape1_add"] == []
    assert "TransformLayout" in records_file(tuned).read_text()
    # Only prepacked records here: every marked kernel keeps its mark. Records of the same kernels
    # measured with the weights as they are, and faster, would take the marks off (build's choice).
    assert Catalog(job.log_dir(), job.target.key, print).prefer_measured_layouts(module, job.target) is module
    built = tvmbert("build", "bert-tiny", *WITHOUT_KERNELS, "--log-dir", str(tuned), "--json")
    assert built.code == 0, built.stderr
    shapes = [w.shape for w in load_params(Path(built.json["artifact"]).parent / PARAMS_FILE).values()]
    assert any(len(shape) >= 3 for shape in shapes), shapes  # tiles of the matrices (2-D as given): repacked once


def test_build_keeps_a_weight_as_it_is_where_such_records_run_faster(tuned_schedules, workdir, tmp_path):
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from tvmbert import Job, JobConfig, optimize
    from tvmbert.ir.files import load_module

    shutil.copytree(tuned_schedules, tmp_path / "logs")
    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir), log_dir=str(tmp_path / "logs"), disable=NO_KERNELS))
    optimized = load_module(optimize(job).path)
    marked = inference_module(optimized, job.target)
    catalog = Catalog(job.log_dir(), job.target.key, print)
    native = catalog.native.database
    # A record of the attention output projection with its weight as it is, faster than any prepacked one.
    plain = next(t for t in extract_tasks(entry_module(optimized, "main"), job.target)
                 if t.name == "fused_matmul3_add4")
    schedule = tvm.s_tir.Schedule(plain.module)
    schedule.get_loops(schedule.get_sblock("matmul"))  # the database skips records with an empty trace
    native.commit_tuning_record(ms.database.TuningRecord(
        schedule.trace, native.commit_workload(plain.module), [1e-9],
        job.target.tvm_target(), ms.arg_info.ArgInfo.from_prim_func(plain.module["main"])))
    chosen = catalog.prefer_measured_layouts(marked, job.target)
    assert marked_kernels(marked) - marked_kernels(chosen) == {"fused_matmul3_add4"}


def test_second_identical_tune_does_zero_trials(tvmbert, tuned, tmp_path):
    import shutil

    shutil.copytree(tuned, tmp_path / "logs")  # a tune locks its logs, which other workers' tests read
    outcome = tvmbert("tune", "bert-tiny", *SMALL, "--log-dir", str(tmp_path / "logs"), "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["new_trials"] == 0
    assert "0 new trials" in outcome.stderr
    assert all(t["best_us"] > 0 for t in outcome.json["tasks"])
    assert len(outcome.json["skipped_trivial"]) > 0


def test_tuned_workloads_are_reused_by_another_model(tvmbert, tuned, tmp_path):
    import shutil

    shutil.copytree(tuned, tmp_path / "logs")
    # Other weights, same architecture and shape: every workload is already in the database.
    outcome = tvmbert("tune", "bert-tiny", "--seed", "5", "--trials", "100", "--log-dir", str(tmp_path / "logs"), "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["new_trials"] == 0


def test_fresh_retune_of_selected_tasks_supersedes_their_old_records(tvmbert, tuned, tmp_path):
    import shutil

    log_dir = tmp_path / "logs"
    shutil.copytree(tuned, log_dir)
    before = tvmbert("tune", "bert-tiny", *SMALL, "--log-dir", str(log_dir), "--json").json
    outcome = tvmbert("tune", "bert-tiny", "--retune", "--fresh", "--kernel", "^fused_matmul", "--trials", "8", "--trials-per-task", "4",
                      "--log-dir", str(log_dir), "--json")
    assert outcome.code == 0, outcome.stderr
    tasks = outcome.json["tasks"]
    assert tasks and all(t["name"].startswith("fused_matmul") for t in tasks)
    assert outcome.json["new_trials"] == sum(t["new_trials"] for t in tasks) > 0
    after = tvmbert("tune", "bert-tiny", *SMALL, "--log-dir", str(log_dir), "--json").json
    assert after["new_trials"] == 0
    records = {t["name"]: t for t in after["tasks"]}
    funded = [t for t in tasks if t["new_trials"]]
    assert funded
    for task in tasks:  # re-measured tasks: only the new records count now; unfunded ones keep theirs
        assert records[task["name"]]["existing"] == (task["new_trials"] or task["existing"])
    untouched = [t for t in before["tasks"] if not t["name"].startswith("fused_matmul")]
    assert all(records[t["name"]]["existing"] == t["existing"] for t in untouched)
    superseded = (records_file(log_dir).parent / record_files.SUPERSEDED_FILE).read_text().splitlines()
    assert len(superseded) == len(funded)


def test_task_pattern_matching_nothing_is_an_input_error(tvmbert, tmp_path):
    outcome = tvmbert("tune", "bert-tiny", "--kernel", "no-such-kernel", "--log-dir", str(tmp_path))
    assert outcome.code == 2 and "matches none of the kernels" in outcome.stderr


def test_task_pattern_that_is_not_a_regex_is_an_input_error(tvmbert, tmp_path):
    outcome = tvmbert("tune", "bert-tiny", "--kernel", "fused_(matmul", "--log-dir", str(tmp_path))
    assert outcome.code == 2 and "is not a regular expression" in outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1


def test_garbage_line_is_skipped_with_a_warning_and_kept(tvmbert, tuned, tmp_path):
    import shutil

    copy = tmp_path / "logs"
    shutil.copytree(tuned, copy)
    path = records_file(copy)
    good = path.read_text()
    with open(path, "a") as handle:
        handle.write('[0, {"truncated": \n')
    built = tvmbert("build", "bert-tiny", "--log-dir", str(copy), "--json")
    assert built.code == 0, built.stderr
    line = len(good.splitlines()) + 1
    assert f"{path}:{line}: skipped an unreadable line" in built.stderr
    assert built.json["tasks_tuned"] == built.json["tasks_total"]
    # A new shape has new workloads: tuning appends after the bad line.
    again = tvmbert("tune", "bert-tiny", "--seq-len", "8", "--trials", "4", "--trials-per-task", "4",
                    "--log-dir", str(copy), "--json")
    assert again.code == 0, again.stderr
    assert 1 <= again.json["new_trials"] <= 4  # the task funded may have fewer candidates than its budget
    text = path.read_text()
    assert text.startswith(good)  # good records never rewritten away
    assert '[0, {"truncated": \n' in text  # nor the bad line: it is skipped, not deleted
    assert len(text.splitlines()) > line


@pytest.mark.slow
def test_kill_9_loses_at_most_the_batch_in_flight(tmp_path, workdir):
    log_dir = tmp_path / "logs"
    process, command, _ = tune_in_background(log_dir, workdir, trials=24, records=16, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
    import psutil

    workers = psutil.Process(process.pid).children(recursive=True)  # TVM's pool workers start sessions of their own
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    before = records_file(log_dir).read_text()
    assert len(before.splitlines()) >= 16
    resumed = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads(resumed.stdout)
    after = records_file(log_dir).read_text()
    assert after.startswith(before.rstrip("\n").rsplit("\n", 1)[0])  # everything measured before the kill is kept
    # The run continued to its budget: every funded task finished (a small search space can end a
    # task below its budget), and what it measured was appended after what was kept.
    assert result["new_trials"] > 0
    assert all(t["status"] == "done" for t in result["tasks"] if t["budget"])
    assert len(after.splitlines()) >= len(before.splitlines()) - 1 + result["new_trials"]


def test_a_cpu_tune_registers_the_x86_tensor_intrinsics_only():
    """TVM's registry of every backend's intrinsics costs a tuning run 20-40 s; a CPU needs x86's."""
    probe = (
        "import sys\n"
        "from tvm.s_tir import TensorIntrin\n"
        "from tvmbert.core.targets import resolve\n"
        "from tvmbert.tuning.intrinsics import register_tensor_intrinsics\n"
        "register_tensor_intrinsics(resolve('llvm -mcpu=sapphirerapids').kind)\n"
        "import tvm.s_tir.tensor_intrin\n"  # what TuneContext imports: the package registered above, as it is
        "TensorIntrin.get('dot_16x4_vnni')\n"
        "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('tvm.s_tir.tensor_intrin.')))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "['x86']"


def test_plan_weights_tasks_by_cost_and_respects_caps():
    tasks = [Task("big", None, 2, 1e6), Task("small", None, 1, 5e5), Task("reshape", None, 4, 0), Task("tiny", None, 1, 1e3)]
    budgets = plan(tasks, 64, None)
    assert "reshape" not in budgets  # trivial: no trials at all
    assert budgets["big"] > budgets["small"] > 0 and sum(budgets.values()) <= 64
    assert plan(tasks, 1000, 100) == {"big": 100, "small": 100, "tiny": 8}
    assert plan(tasks, 0, None) == {"big": 0, "small": 0, "tiny": 0}


def test_a_second_tuner_waits_for_the_lock(tmp_path):
    messages = []
    holding = threading.Event()

    def hold():
        with database.locked(tmp_path):
            holding.set()
            time.sleep(1.0)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait()
    started = time.perf_counter()
    assert database.tuning_active(tmp_path)  # builds see it and do not wait
    with database.locked(tmp_path, say=messages.append):
        waited = time.perf_counter() - started
    thread.join()
    assert waited > 0.5 and messages and "waiting for another" in messages[0]
    assert not database.tuning_active(tmp_path)


def test_unwritable_log_dir_fails_before_tuning(tvmbert, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    outcome = tvmbert("tune", "bert-tiny", "--trials", "8", "--log-dir", str(blocker / "logs"))
    assert outcome.code == 2 and "not writable" in outcome.stderr and "Traceback" not in outcome.stderr


@pytest.mark.parametrize("target", ["rocm", "cuda"])
def test_gpu_tune_without_gpu_or_tracker_stops_at_once(tvmbert, tmp_path, target):
    started = time.perf_counter()
    outcome = tvmbert("tune", "bert-tiny", "--target", target, "--trials", "8", "--log-dir", str(tmp_path))
    assert outcome.code == 2 and "--rpc-tracker" in outcome.stderr and outcome.stderr.strip().count("\n") == 0
    assert time.perf_counter() - started < 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_tracker_is_one_line_within_seconds(tvmbert, tmp_path):
    started = time.perf_counter()
    outcome = tvmbert("tune", "bert-tiny", "--trials", "8", "--rpc-tracker", f"127.0.0.1:{free_port()}", "--rpc-key", "k",
                      "--log-dir", str(tmp_path))
    assert outcome.code == 2 and "unreachable" in outcome.stderr
    assert time.perf_counter() - started < 10


@pytest.fixture
def rpc_cluster():
    """A real TVM RPC tracker and two servers on loopback."""
    port = free_port()
    python = sys.executable
    # Own process groups: an rpc_server leaves children behind unless its whole group is stopped.
    processes = [subprocess.Popen([python, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                                   "--port-end", str(port + 1)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    time.sleep(1.0)
    for _ in range(2):
        processes.append(subprocess.Popen([python, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                                           "--key", "loopback-cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
    from tvmbert.tuning import measure

    deadline = time.time() + 60
    while True:
        try:
            if measure.check_tracker(f"127.0.0.1:{port}", "loopback-cpu", timeout=1.0) >= 2:
                break
        except Exception:
            if time.time() > deadline:
                raise
        time.sleep(0.3)
    yield f"127.0.0.1:{port}"
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
def test_remote_measurement_through_a_loopback_tracker(tvmbert, rpc_cluster, tmp_path):
    unknown = tvmbert("tune", "bert-tiny", "--trials", "8", "--rpc-tracker", rpc_cluster, "--rpc-key", "nope",
                      "--log-dir", str(tmp_path))
    assert unknown.code == 2 and "no device is registered with key 'nope'" in unknown.stderr
    outcome = tvmbert("tune", "bert-tiny", "--trials", "8", "--trials-per-task", "8", "--rpc-tracker", rpc_cluster,
                      "--rpc-key", "loopback-cpu", "--log-dir", str(tmp_path), "--json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.json["new_trials"] == 8
    assert "RPC tracker" in outcome.stderr
    records = [json.loads(line) for line in records_file(tmp_path).read_text().splitlines()]
    assert len(records) == 8 and any(min(r[1][1]) < 1e9 for r in records)

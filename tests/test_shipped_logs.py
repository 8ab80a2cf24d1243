"""The tuning logs that ship as package data, read after the user's own from any folder and any
install; the user's folder (config.user_log_dir), the only one tuning writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tvmbert.core import targets
from tvmbert.core.config import LOG_DIR_VARIABLE, user_log_dir
from tvmbert.ir.files import load_module
from tvmbert.ir.tasks import extract_tasks, inference_module
from tvmbert.stages.job import Job, JobConfig
from tvmbert.stages.optimize import optimize
from tvmbert.tuning import database, record_files
from tvmbert.tuning.catalog import Catalog

from helpers import REPO, SMALL_TUNE

HOST = targets.resolve("llvm").key
SHIPPED = REPO / "tvmbert" / "tuning_logs"
# A target whose records ship, whatever this CPU: build only compiles for it, never runs its code.
SHIPPED_KEY = sorted(p.name for p in SHIPPED.iterdir() if database.holds_records(p))[0]
SHIPPED_TARGET = json.dumps(targets.cpu_of_key(SHIPPED_KEY))


def test_the_users_folder_is_the_variables_else_the_platforms(monkeypatch, tmp_path):
    monkeypatch.setenv(LOG_DIR_VARIABLE, str(tmp_path / "mine"))
    assert user_log_dir() == tmp_path / "mine"
    monkeypatch.delenv(LOG_DIR_VARIABLE)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert user_log_dir() == tmp_path / "data" / "tvmbert" / "tuning_logs"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert user_log_dir() == Path.home() / ".local" / "share" / "tvmbert" / "tuning_logs"


def test_the_users_records_come_before_the_shipped_ones_and_tune_writes_only_theirs(tvmbert, tuned, workdir, tmp_path, monkeypatch):
    """``tuned`` ships here; the user's folder holds a copy of the same records: each task's
    schedule is the user's, the shipped count as tuned, and a tune adds nothing to either."""
    monkeypatch.setenv(database.SHIPPED_VARIABLE, str(tuned))
    mine = tmp_path / "mine"
    shutil.copytree(tuned / HOST, mine / HOST)
    job = Job(JobConfig(model="bert-tiny", workdir=str(workdir), log_dir=str(mine)))
    catalog = Catalog(job.log_dir(), HOST, print)
    assert [str(s.database.log_dir) for s in catalog.sources[:2]] == [str(mine / HOST), str(tuned / HOST)]
    tasks = [t for t in extract_tasks(inference_module(load_module(optimize(job).path), job.target), job.target) if not t.trivial]
    assert all(catalog.nearest([t.module]) is catalog.native for t in tasks)

    empty = tmp_path / "empty"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tuned / HOST).iterdir())
    again = tvmbert("tune", "bert-tiny", *SMALL_TUNE, "--log-dir", str(empty), "--json")
    assert again.code == 0, again.stderr
    assert again.json["new_trials"] == 0 and {t["status"] for t in again.json["tasks"]} == {"done"}
    assert not database.holds_records(empty / HOST)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tuned / HOST).iterdir()) == before


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_builds_with_the_shipped_records(tvmbert, workdir, tmp_path, monkeypatch):
    """The repository as a wheel, installed in a fresh venv (the dependencies from this one, not its
    editable tvmbert) and run from another folder, builds as the repository does: the same tasks
    from the shipped records, read from the installed package, and says where it looked."""
    monkeypatch.delenv(database.SHIPPED_VARIABLE)
    mine = tmp_path / "mine"
    monkeypatch.setenv(LOG_DIR_VARIABLE, str(mine))
    here = tvmbert("build", "bert-tiny", "--target", SHIPPED_TARGET, "--json")
    assert here.code == 0, here.stderr
    assert here.json["databases_read"] == [str(SHIPPED / SHIPPED_KEY)] and here.json["tasks_tuned"] > 0
    assert here.json["databases_missing"] == [str(mine / SHIPPED_KEY)] and f"no such folder: {mine / SHIPPED_KEY}" in here.stderr

    source = tmp_path / "source"
    history = (record_files.WORKLOADS_FILE, record_files.RECORDS_FILE, record_files.SUPERSEDED_FILE, record_files.LOCK_FILE)
    shutil.copytree(REPO / "tvmbert", source / "tvmbert", ignore=shutil.ignore_patterns("__pycache__", *history))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    run(sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    site = Path(run(str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    # This venv's packages as a path only: its .pth files, the editable tvmbert's among them, are not run.
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = (tmp_path / "dist").glob("tvmbert-*.whl")
    run(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", "-q", str(wheel))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = run(str(venv / "bin" / "python"), "-c", "import tvmbert; print(tvmbert.__file__)", cwd=elsewhere, env=environment)
    assert Path(found.stdout.strip()).is_relative_to(site)
    built = run(str(venv / "bin" / "tvmbert"), "build", "bert-tiny", "--target", SHIPPED_TARGET, "--workdir", str(workdir), "--json",
                cwd=elsewhere, env=environment)
    result = json.loads(built.stdout)
    assert result["databases_read"] == [str(site / "tvmbert" / "tuning_logs" / SHIPPED_KEY)]
    assert result["schedules"] == here.json["schedules"] and result["tasks_tuned"] == here.json["tasks_tuned"]


def run(*command: str, **options) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True, **options)

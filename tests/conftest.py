"""Shared fixtures: the real CLI, in-process, against a per-session work directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tvmbert.cli import main

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self):
        return json.loads(self.stdout)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture
def tvmbert(capsys, workdir):
    """Runs `tvmbert ARGS...` in-process with the session's work directory."""

    def run(*args: str, workdir_arg: bool = True) -> Outcome:
        argv = list(args)
        if workdir_arg and "--workdir" not in argv:
            argv += ["--workdir", str(workdir)]
        capsys.readouterr()
        code = main(argv)
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err)

    return run


# 12 non-trivial tasks in bert-tiny, 4 trials each: every task gets a tuned schedule quickly.
SMALL_TUNE = ("--trials", "48", "--trials-per-task", "4")


@pytest.fixture(scope="session")
def tuned(tmp_path_factory, workdir):
    """bert-tiny tuned once into a fresh log dir, under this CPU's key; tests that change the
    logs work on a copy."""
    log_dir = tmp_path_factory.mktemp("logs")
    assert main(["tune", "bert-tiny", *SMALL_TUNE, "--log-dir", str(log_dir), "--workdir", str(workdir), "--json"]) == 0
    return log_dir


def tune_in_background(log_dir: Path, workdir: Path, trials: int, records: int, **popen):
    """`tvmbert tune bert-tiny` in a process of its own (16 trials per task), returned once it has
    appended ``records`` record lines, with the path of its records file."""
    import subprocess
    import sys
    import time

    from tvmbert.tuning import database

    command = [sys.executable, "-m", "tvmbert", "tune", "bert-tiny", "--trials", str(trials), "--trials-per-task", "16",
               "--log-dir", str(log_dir), "--workdir", str(workdir)]
    process = subprocess.Popen(command, **popen)
    deadline = time.time() + 300
    while time.time() < deadline:
        files = list(log_dir.glob("*/" + database.RECORDS_FILE))
        if files and files[0].read_text().count("\n") >= records:
            return process, command, files[0]
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"tune measured fewer than {records} records in 300 s")


def _host_has_amx() -> bool:
    from tvmbert.core import targets
    from tvmbert.kernels import amx

    if not amx.target_has_amx(targets.resolve("llvm")):
        return False
    try:
        amx.request_permission()
    except OSError:
        return False
    return True


HOST_AMX = _host_has_amx()  # --dtype bfloat16 builds for this CPU (it is refused without AMX-BF16)
needs_amx = pytest.mark.skipif(not HOST_AMX, reason="this CPU has no AMX-BF16 (or the kernel does not grant it): "
                                                    "--dtype bfloat16 is refused here")

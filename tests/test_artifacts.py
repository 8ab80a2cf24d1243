"""Artifacts: a stage folder is there whole or not at all, whatever happens to the writer."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tvmbert.core import artifacts
from tvmbert.core.errors import InputError

from helpers import REPO


def test_a_full_disk_during_trace_is_one_line_and_leaves_nothing(tmp_path):
    """torch's zip writer used to abort the process (exit 134, a C++ stack dump)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        outcome = subprocess.run([sys.executable, "-m", "tvmbert", "trace", "bert-tiny", "--workdir", str(disk / "build")],
                                 capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        leftovers = [p for p in disk.rglob("*") if not p.is_dir() or p.name.startswith(".")]
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert outcome.returncode == 2, outcome.stderr
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on the disk that holds" in errors[0] and str(disk) in errors[0]
    assert "frame #" not in outcome.stderr and "Traceback" not in outcome.stderr
    assert leftovers == []


def test_a_failed_write_is_an_input_error_naming_the_folder(tmp_path):
    stage = tmp_path / "model" / "build"
    with pytest.raises(InputError, match=f"no space left on the disk that holds {tmp_path / 'model'}"):
        with artifacts.writing("build", stage, "fp", {}) as tmp:
            (tmp / "model.so").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(InputError, match="cannot write the build artifact into .*: Permission denied"):
        with artifacts.writing("build", stage, "fp", {}):
            raise PermissionError(errno.EACCES, "Permission denied")
    assert list((tmp_path / "model").iterdir()) == []


def test_a_writer_killed_mid_stage_leaves_a_folder_the_next_write_removes(tmp_path):
    stage = tmp_path / "build"
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; from tvmbert.core import artifacts\n"
        "with artifacts.writing('build', Path(sys.argv[1]), 'fp', {}) as tmp:\n"
        "    (tmp / 'model.so').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"), str(stage)], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -9
    (orphan,) = tmp_path.glob(".build.*")
    killed_pid = int(orphan.name.split("-", 1)[1].split("@")[0])
    # A live writer's folder (this process's) is never touched, nor another machine's.
    live = tmp_path / f".build.tmp-{os.getpid()}@{os.uname().nodename}@busy"
    elsewhere = tmp_path / f".build.tmp-{killed_pid}@another-machine@busy"
    live.mkdir(), elsewhere.mkdir()
    with artifacts.writing("build", stage, "fp", {}) as tmp:
        (tmp / "model.so").write_bytes(b"whole")
    assert not orphan.exists() and live.exists() and elsewhere.exists()
    assert (stage / "model.so").read_bytes() == b"whole" and artifacts.read("build", stage).fingerprint == "fp"


def test_the_code_version_covers_every_module_that_decides_an_artifact():
    from tvmbert.core.artifacts import package_sources

    names = {name for name, _ in package_sources()}
    # A kernel, a pass, a stage and the exporter front end: a change to any of them must rebuild.
    assert {"kernels/fma.py", "passes/fma_fp32.py", "stages/build.py", "frontend/models.py", "core/artifacts.py"} <= names

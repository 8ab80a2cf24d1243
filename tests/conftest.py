"""Shared fixtures: the real CLI, in-process, against a per-session work directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tvmbert.cli import main
from tvmbert.core import hosts

from helpers import ALIKE, CUDA_PRESENT, HOST_AMX, HOST_AMX_INT8, HOST_LANES, SMALL_TUNE, WITHOUT_KERNELS


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


@pytest.fixture(scope="session")
def tuned(tmp_path_factory, workdir):
    """bert-tiny tuned once into a fresh log dir, under this CPU's key; tests that change the
    logs work on a copy."""
    log_dir = tmp_path_factory.mktemp("logs")
    assert main(["tune", "bert-tiny", *SMALL_TUNE, "--log-dir", str(log_dir), "--workdir", str(workdir), "--json"]) == 0
    return log_dir


@pytest.fixture(scope="session")
def tuned_everywhere_alike(tmp_path_factory, workdir):
    """bert-tiny at 1 x 16 tuned once into a fresh log dir, under this CPU's key: at 16 rows every
    CPU's pipeline leaves the same kernels to tune (kernels/fma.MIN_ROWS keeps 1 x 14's matmuls and
    layer norms in the graph on a Sapphire Rapids only), so another CPU's build finds each of its
    tasks here."""
    log_dir = tmp_path_factory.mktemp("alike")
    assert main(["tune", "bert-tiny", *ALIKE, *SMALL_TUNE, "--log-dir", str(log_dir), "--workdir", str(workdir), "--json"]) == 0
    return log_dir


@pytest.fixture(scope="session")
def tuned_schedules(tmp_path_factory, workdir):
    """Two of bert-tiny's weight matmuls and its layer norm tuned by MetaSchedule (our kernels left out):
    what the tests of tuned layouts and renamed records read, whatever this CPU's kernels take."""
    log_dir = tmp_path_factory.mktemp("schedules")
    assert main(["tune", "bert-tiny", *WITHOUT_KERNELS, "--kernel", "^fused_matmul5?_add", "--kernel", "^layer_norm", *SMALL_TUNE,
                 "--log-dir", str(log_dir), "--workdir", str(workdir), "--json"]) == 0
    return log_dir


@pytest.fixture
def present_host(monkeypatch):
    """Presents a host (a hosts.KNOWN_HOSTS name, or '<llvm cpu>:<flags>') to this test, as
    TVMBERT_HOST does to a whole command: every 'this CPU' decision reads it."""

    def present(text: str) -> hosts.Host:
        monkeypatch.setenv(hosts.HOST_VARIABLE, text)
        hosts.current.cache_clear()
        return hosts.current()

    yield present
    hosts.current.cache_clear()  # read again, once monkeypatch has restored the environment


def pytest_configure(config):
    config.addinivalue_line("markers", "simd: runs our fp32 kernels on this CPU: needs AVX-512, or AVX2 with FMA")
    config.addinivalue_line("markers", "amx: runs bf16 kernels on AMX: needs AMX-BF16, granted by the kernel")
    config.addinivalue_line("markers", "amx_int8: runs int8 kernels on AMX: needs AMX-INT8, granted by the kernel")
    config.addinivalue_line("markers", "cuda: runs on a CUDA GPU (benchmarks/gpu_run.sh runs them on a lent machine)")


def pytest_collection_modifyitems(config, items):
    """A test marked for hardware this CPU lacks is skipped with the reason, not run: code built
    for instructions the host lacks would kill the process (SIGILL). Tests marked slow go first,
    in their order: with xdist's work stealing (`make test`), the run then ends on short tests on
    both workers, not on one worker finishing a long one alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    lacking = {
        "simd": None if HOST_LANES else "this CPU has neither AVX-512 nor AVX2 with FMA",
        "amx": None if HOST_AMX else "this CPU has no AMX-BF16 (or the kernel does not grant it): --dtype bfloat16 is refused here",
        "amx_int8": None if HOST_AMX_INT8 else "this CPU has no AMX-INT8 (or the kernel does not grant it): int8 runs on vectors here",
        "cuda": None if CUDA_PRESENT else "no CUDA device on this machine",
    }
    for item in items:
        for marker, reason in lacking.items():
            if reason and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))

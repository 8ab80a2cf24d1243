"""tvmbert: HuggingFace BERT encoders from PyTorch into Apache TVM, tuned and benchmarked.

The typed Python API: build a ``Job`` from a ``JobConfig`` and pass it to a stage function.

    from tvmbert import Job, JobConfig, build, verify
    job = Job(JobConfig(model="bert-tiny", target="llvm"))
    print(verify(job).max_abs_diff)

Modules import torch and TVM inside the functions that need them, so `tvmbert --help` and
argument errors answer at once.
"""

from .bench import bench
from .build import build
from .config import BenchOptions, JobConfig, TuneOptions, VerifyOptions
from .config import load as load_config
from .convert import convert
from .errors import CheckFailed, InputError, TvmbertError
from .job import Job
from .optimize import optimize
from .pipeline import run
from .trace import trace
from .training import add_tvm_dispatch, remove_tvm_dispatch
from .tune import tune
from .verify import verify, verify_training

__all__ = [
    "BenchOptions", "CheckFailed", "InputError", "Job", "JobConfig", "TuneOptions", "TvmbertError", "VerifyOptions",
    "add_tvm_dispatch", "bench", "build", "convert", "load_config", "optimize", "remove_tvm_dispatch", "run", "trace",
    "tune", "verify", "verify_training",
]

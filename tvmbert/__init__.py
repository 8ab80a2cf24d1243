"""tvmbert: HuggingFace BERT encoders from PyTorch into Apache TVM, tuned and benchmarked.

The typed Python API: build a ``Job`` from a ``JobConfig`` and pass it to a stage function.

    from tvmbert import Job, JobConfig, build, verify
    job = Job(JobConfig(model="bert-tiny", target="llvm"))
    print(verify(job).max_abs_diff)

Modules import torch and TVM inside the functions that need them, so `tvmbert --help` and
argument errors answer at once, and ``tvmbert.load`` (serving an exported package) needs neither
torch nor transformers.
"""

from tvmbert.core.errors import CheckFailed, InputError, PackageError, TvmbertError
from tvmbert.deploy.package import ExportedModel, load

__all__ = [
    "BenchOptions", "CheckFailed", "ExportOptions", "ExportedModel", "InputError", "Job", "JobConfig", "PackageError",
    "TuneOptions", "TvmbertError", "VerifyOptions", "add_tvm_dispatch", "bench", "build", "convert", "export", "load",
    "load_config", "optimize", "remove_tvm_dispatch", "run", "trace", "tune", "verify", "verify_training",
]

try:
    from tvmbert.core.config import BenchOptions, ExportOptions, JobConfig, TuneOptions, VerifyOptions
    from tvmbert.core.config import load as load_config
    from tvmbert.stages.bench import bench
    from tvmbert.stages.build import build
    from tvmbert.stages.convert import convert
    from tvmbert.stages.export import export
    from tvmbert.stages.job import Job
    from tvmbert.stages.optimize import optimize
    from tvmbert.stages.run import run
    from tvmbert.stages.trace import trace
    from tvmbert.stages.tune import tune
    from tvmbert.stages.verify import verify, verify_training
    from tvmbert.training.dispatch import add_tvm_dispatch, remove_tvm_dispatch
except ModuleNotFoundError as missing:
    # A deployment with TVM and NumPy only (tokenizers for text): `load` serves a package; the
    # toolchain needs its own dependencies (yaml, rich, torch, ...). Eager imports, not a lazy
    # __getattr__: importing the module tvmbert.bench would otherwise shadow the function bench.
    _missing = missing

    def __getattr__(name: str):
        if name in __all__:
            raise ModuleNotFoundError(f"tvmbert.{name} needs the toolchain's dependencies, and {_missing.name} is not "
                                      "installed: here only tvmbert.load works (pip install tvmbert for the rest)")
        raise AttributeError(f"module 'tvmbert' has no attribute {name!r}")

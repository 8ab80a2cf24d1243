"""Typed job configuration: YAML files in configs/ and CLI flags both end up here, validated."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from tvmbert.core.errors import InputError
from tvmbert.core.registry import ENGINES, STAGES

DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8")
# Computed in reduced precision by TVM from a float32 model; PyTorch stays the float32 reference.
MIXED_PRECISION = ("float16", "bfloat16")
# Weight matmuls quantized by TVM from a float32 model (passes/int8_matmuls.py); the rest fp32.
QUANTIZED = ("int8",)


def torch_dtype(dtype: str) -> str:
    """The dtype the PyTorch model is built, traced and compared in."""
    return "float32" if dtype in MIXED_PRECISION + QUANTIZED else dtype


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 0  # 0: tune nothing, build with what the database already has
    trials_per_task: int | None = None
    rpc_tracker: str | None = None  # HOST:PORT
    rpc_key: str | None = None

    def validate(self, where: str) -> None:
        _require(self.trials >= 0, where, "tune.trials", "a number >= 0")
        _require(self.trials_per_task is None or self.trials_per_task > 0, where, "tune.trials_per_task", "a number > 0")
        _require((self.rpc_tracker is None) == (self.rpc_key is None), where, "tune.rpc_key", "given together with tune.rpc_tracker")


@dataclass(frozen=True)
class BenchOptions:
    warmup: int = 3
    repeat: int = 20  # at least this many timed runs per engine...
    min_time_s: float = 1.0  # ...and at least this long
    threads: int | None = None  # default: every core of the machine, for every engine
    engines: tuple[str, ...] | None = None  # default: every engine (tvm is always timed)

    def validate(self, where: str) -> None:
        unknown = [name for name in self.engines or () if name not in ENGINES]
        _require(not unknown, where, "bench.engines", f"names from {', '.join(ENGINES)} (got {', '.join(unknown)})")
        _require(self.warmup >= 0, where, "bench.warmup", "a number >= 0")
        _require(self.repeat >= 1, where, "bench.repeat", "a number >= 1")
        _require(self.min_time_s >= 0, where, "bench.min_time_s", "a number >= 0")
        _require(self.threads is None or self.threads >= 1, where, "bench.threads", "a number >= 1")


@dataclass(frozen=True)
class VerifyOptions:
    samples: int = 3  # inputs compared: the example input, then seeded random ones with padding
    tolerance: float | None = None  # max abs diff allowed; default depends on dtype
    texts: int | None = None  # real sentences measured too (a model with a tokenizer): None, verify's DEFAULT_TEXTS

    def validate(self, where: str) -> None:
        _require(self.samples >= 1, where, "verify.samples", "a number >= 1")
        _require(self.texts is None or self.texts >= 0, where, "verify.texts", "a number >= 0")
        _require(self.tolerance is None or self.tolerance > 0, where, "verify.tolerance", "a number > 0")


@dataclass(frozen=True)
class ExportOptions:
    out_dir: str | None = None  # the package folder (`tvmbert export -o`)
    batches: tuple[int, ...] | None = None  # default: export.DEFAULT_BATCHES
    seq_lens: tuple[int, ...] | None = None  # default: export.DEFAULT_SEQ_LENS up to the model's max positions
    packed: bool = False  # also packed buckets (export.PACKED_FILLS of the tokens) for every batch > 1
    cpus: tuple[str, ...] | None = None  # a build per CPU (native, LLVM CPU names or keys); default: the target alone

    def validate(self, where: str) -> None:
        _require(all(b >= 1 for b in self.batches or ()), where, "export.batches", "numbers >= 1")
        _require(all(s >= 1 for s in self.seq_lens or ()), where, "export.seq_lens", "numbers >= 1")


@dataclass(frozen=True)
class JobConfig:
    """Everything a stage needs to know; artifacts are keyed by the parts that change them."""

    model: str = "bert-tiny"
    task: str | None = None  # the head to compile; default: the one config.json's architectures names
    batch: int = 1
    seq_len: int | None = None  # default: the tokenized text's length, or 14
    tokens: int | None = None  # a packed build of this token capacity (packing.py); None: padded
    text: str | None = None
    dtype: str = "float32"
    fast_math: bool = False  # allow approximations (tanh GELU, fast exp/erf/softmax); exact by default
    cuda_graph: bool = True  # a CUDA build captures its forward in a CUDA graph (one launch a call after the first)
    seed: int = 0
    allow_random_weights: bool = False  # a directory's missing weights drawn from seed (experiments), not refused
    target: str = "llvm"
    passes: tuple[str, ...] | None = None  # None: the default pipeline of the optimize stage (names checked by Job)
    # Passes left out of every stage's pipeline, those a dtype or target adds included (a kernel
    # against MetaSchedule's schedules, say): tune and build then agree on the kernels.
    disable: tuple[str, ...] = ()
    stages: tuple[str, ...] = ("trace", "convert", "optimize", "build", "verify", "bench")
    workdir: str = "build"
    log_dir: str | None = None  # where tune writes and lookups read first; None: user_log_dir()
    tune: TuneOptions = field(default_factory=TuneOptions)
    bench: BenchOptions = field(default_factory=BenchOptions)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    export: ExportOptions = field(default_factory=ExportOptions)

    def validate(self, where: str = "options") -> JobConfig:
        _require(self.batch >= 1, where, "batch", "a number >= 1")
        _require(self.seq_len is None or self.seq_len >= 1, where, "seq_len", "a number >= 1")
        _require(self.tokens is None or self.tokens >= self.batch, where, "tokens", f"a number >= batch ({self.batch})")
        _require(self.text is None or bool(self.text.strip()), where, "text", "a text that is not empty")
        _require(self.dtype in DTYPE_NAMES, where, "dtype", f"one of {', '.join(DTYPE_NAMES)}")
        _require(0 <= self.seed < 2**32, where, "seed", "a number in [0, 2**32)")
        unknown = [s for s in self.stages if s not in STAGES]
        _require(not unknown, where, "stages", f"stage names from {', '.join(STAGES)} (got {', '.join(unknown)})")
        self.tune.validate(where)
        self.bench.validate(where)
        self.verify.validate(where)
        self.export.validate(where)
        _require("export" not in self.stages or self.export.out_dir is not None, where, "export.out_dir",
                 "given when stages lists export")
        return self

    def with_overrides(self, **overrides) -> JobConfig:
        """CLI flags win over the file; None means the flag was not given."""
        top = {k: v for k, v in overrides.items() if v is not None and "." not in k}
        config = replace(self, **top)
        for section in ("tune", "bench", "verify", "export"):
            nested = {k.split(".", 1)[1]: v for k, v in overrides.items() if v is not None and k.startswith(section + ".")}
            if nested:
                config = replace(config, **{section: replace(getattr(config, section), **nested)})
        return config.validate()


def _require(ok: bool, where: str, key: str, expected: str) -> None:
    if not ok:
        raise InputError(f"{where}: '{key}' must be {expected}")


LOG_DIR_VARIABLE = "TVMBERT_LOG_DIR"


def user_log_dir() -> Path:
    """Where this user's own tuning records go, whatever the folder tvmbert runs from:
    TVMBERT_LOG_DIR, else the platform's per-user data folder (hours of measurements are data,
    not a cache to clear)."""
    if value := os.environ.get(LOG_DIR_VARIABLE):
        return Path(value).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "tvmbert" / "tuning_logs"


def load(path: str | Path) -> JobConfig:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read as a YAML text file ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise InputError(f"{path}:{line} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of keys at the top level")
    return _from_mapping(JobConfig, data, str(path), "").validate(str(path))


def _from_mapping(cls, data: dict, where: str, prefix: str):
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise InputError(f"{where}: unknown key '{prefix}{key}' (known: {', '.join(known)})")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise InputError(f"{where}: '{prefix}{key}' must be a mapping")
            values[name] = _from_mapping(hint, value, where, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, hint, where, f"{prefix}{key}")
    return cls(**values)


def _coerce(value, hint, where: str, key: str):
    """Checks a YAML value against a field's annotation (int, float, str, tuple[str, ...], optional)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise InputError(f"{where}: '{key}' must not be empty")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if typing.get_origin(option) is tuple and isinstance(value, list):
            item = typing.get_args(option)[0]
            if all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                return tuple(value)
    names = " or ".join(("a list of numbers" if typing.get_args(o)[0] is int else "a list of names") if typing.get_origin(o) is tuple else getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    raise InputError(f"{where}: '{key}' must be {names}, got {value!r}")

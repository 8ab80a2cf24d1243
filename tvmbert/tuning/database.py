"""The tuning database: one MetaSchedule JSON database per target, shared by every model.

A workload tuned for one model is found again, structurally, in every other model and shape that
contains it, which is what makes tuning logs reusable across bert-base, bert-large, and so on.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from tvmbert.ir.tasks import Task
from tvmbert.tuning.record_files import (
    COMPACT_FILE,
    COMPACT_TOP_K,
    DONE_FILE,
    LOCK_FILE,
    RECORDS_FILE,
    SUPERSEDED_FILE,
    WORKLOADS_FILE,
    record_as_json,
    workload_key,
)

# The records that ship inside the package (package data), one folder per target key as under a
# user's log root; read after the user's, never written by a tune.
PACKAGE_LOGS = Path(__file__).resolve().parent.parent / "tuning_logs"
SHIPPED_VARIABLE = "TVMBERT_SHIPPED_LOGS"


def shipped_root() -> Path | None:
    """The shipped records' root: the package's, or TVMBERT_SHIPPED_LOGS's folder; set empty, none
    (a test suite or an experiment that must see only its own records)."""
    value = os.environ.get(SHIPPED_VARIABLE)
    if value is None:
        return PACKAGE_LOGS
    return Path(value).expanduser() if value else None


def log_roots(user_root: Path) -> list[Path]:
    """Every root a lookup reads, the user's first: their records win over the shipped ones."""
    shipped = shipped_root()
    same = shipped is not None and shipped.resolve() == user_root.resolve()  # `--log-dir tvmbert/tuning_logs`: tuning what ships
    return [user_root] + ([shipped] if shipped is not None and not same else [])


def shipped_folders(log_dir: Path) -> tuple[Path, ...]:
    """The target's shipped database folder, if records ship for it: what a lookup in the user's
    ``log_dir`` (where tune writes) reads after it (open_database's ``read_also``)."""
    return tuple(folder for root in log_roots(log_dir.parent)[1:] if (folder := root / log_dir.name).is_dir())


def holds_records(folder: Path) -> bool:
    """Whether a database folder holds records (shipped or measured)."""
    return any((folder / name).is_file() for name in (COMPACT_FILE, RECORDS_FILE))


def state(log_roots: list[Path]) -> list:
    """What a build's cache key needs: the sizes and times of every database under the log roots
    (a build may take records from any of them)."""
    files = [f for root in log_roots for name in (COMPACT_FILE, WORKLOADS_FILE, RECORDS_FILE, SUPERSEDED_FILE)
             for f in sorted(root.glob(f"*/{name}"))]
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


@contextmanager
def locked(log_dir: Path, say=None):
    """Held by a tuning run for its whole length: a second tuner of the same folder waits, and says so."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say:
                say(f"waiting for another tvmbert process that is tuning into {log_dir}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tuning_active(log_dir: Path) -> bool:
    """Whether a tuning run is appending to this folder right now (readers never wait for it)."""
    try:
        with open(log_dir / LOCK_FILE) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:
        pass
    return False


def open_database(log_dir: Path, warn=None, live: bool = False, read_also: tuple[Path, ...] = ()):
    """The target's database (empty when nothing was tuned for it yet); ``read_also``: folders
    whose shipped files it reads too (shipped_folders), never writes."""
    from tvmbert.tuning.log_database import LogDatabase

    return LogDatabase(log_dir, warn or (lambda message: print(f"warning: {message}", file=sys.stderr)), live, read_also)


def best_seconds(database, task: Task) -> float | None:
    """The mean time of the record a build applies (MetaSchedule's best by mean)."""
    return mean_seconds(valid_records(database, task.module))


def mean_seconds(records) -> float | None:
    """The mean time of the first of ``records`` (best first); None when there is none."""
    return sum(float(s) for s in records[0].run_secs) / len(records[0].run_secs) if records else None


def valid_records(database, mod) -> list:
    """A workload's measured records that ran, best first."""
    if not database.has_workload(mod):
        return []
    from tvm.s_tir import meta_schedule as ms

    return [r for r in database.get_top_k(ms.database.Workload(mod), 1 << 30)
            if r.run_secs and float(r.run_secs[0]) < 1e9]


def compact(log_dir: Path, top_k: int = COMPACT_TOP_K, warn=None) -> dict:
    """Rewrites the shipped file from everything the folder holds: each workload's best ``top_k``
    records that ran, with the trials spent on it, and, as they were, its lines this process could
    not read (another TVM's, say: only a damaged line is dropped). The history files are left as they are."""
    import tvm_ffi

    database = open_database(log_dir, warn)
    workloads = {int(tvm_ffi.structural_hash(record.workload.mod)): record.workload
                 for record in database.get_all_tuning_records()}
    lines, kept = [], 0
    for digest in sorted(workloads):
        workload = workloads[digest]
        best = valid_records(database, workload.mod)[:top_k]
        if not best:
            continue
        kept += len(best)
        lines.append(json.dumps({"workload": f"{digest:x}", "trials": database.trials_spent(workload.mod),
                                 "mod": workload.as_json(), "records": [record_as_json(r) for r in best]}))
    workloads_kept = len(lines)
    lines += database.unread_compact_lines  # never dropped for being unreadable here
    path = log_dir / COMPACT_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            handle.write("".join(line + "\n" for line in lines).encode())
        with open(tmp, "rb") as raw:
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"database": str(log_dir), "workloads": workloads_kept, "records": kept,
            "records_before": len(database.get_all_tuning_records()), "unread_lines_kept": len(database.unread_compact_lines),
            "bytes": path.stat().st_size}


def done_keys(log_dir: Path) -> set[str]:
    """The workloads whose tuning budget was spent: not tuned again unless asked."""
    done = set()
    path = log_dir / DONE_FILE
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                done.add(json.loads(line)["workload"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line only means that task is resumed instead of skipped
    return done


def mark_done(log_dir: Path, task: Task, trials: int) -> None:
    with open(log_dir / DONE_FILE, "a") as handle:
        handle.write(json.dumps({"workload": workload_key(task.module), "task": task.name, "trials": trials}) + "\n")

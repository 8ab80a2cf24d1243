"""The tuning database: one MetaSchedule JSON database per target, shared by every model.

A workload tuned for one model is found again, structurally, in every other model and shape that
contains it, which is what makes tuning logs reusable across bert-base, bert-large, and so on.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import re
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from tvmbert.ir.tasks import Task

# What ships: per workload, its IR (with its structural hash, checked on load) and its best
# COMPACT_TOP_K records; what build, --adapt and a warm-started tune read. Written by `tvmbert
# compact` and at the end of every tune.
COMPACT_FILE = "records.jsonl.gz"
COMPACT_TOP_K = 8
# The full history, local to the machine that tuned: MetaSchedule's JSON database format, appended
# to while tuning; each record line also names its workload's structural hash (checked on load).
WORKLOADS_FILE = "database_workload.json"
RECORDS_FILE = "database_tuning_record.json"
# One JSON object per line: {"workload": structural hash, "before_line": n}. `tune --retune --fresh` starts a
# task's search over; its earlier records (up to line n of the records file) stay in the file,
# append-only, but no longer count (e.g. measured hot, before CPU tuning measured cold).
SUPERSEDED_FILE = "superseded.json"
DONE_FILE = "tasks_done.json"  # one JSON object per line: {"workload": structural hash, "task", "trials"}
LOCK_FILE = ".lock"


def state(log_root: Path) -> list:
    """What a build's cache key needs: the sizes and times of every database under the log root
    (a build may take records from any of them)."""
    files = sorted(log_root.glob(f"*/{COMPACT_FILE}")) + sorted(log_root.glob(f"*/{WORKLOADS_FILE}")) \
        + sorted(log_root.glob(f"*/{RECORDS_FILE}")) + sorted(log_root.glob(f"*/{SUPERSEDED_FILE}"))
    return [[str(f.relative_to(log_root)), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


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


def workload_key(mod) -> str:
    import tvm_ffi

    return f"{int(tvm_ffi.structural_hash(mod)):x}"


def _superseded(log_dir: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for _, line in _lines(log_dir / SUPERSEDED_FILE):
        try:
            entry = json.loads(line)
            found[entry["workload"]] = max(found.get(entry["workload"], 0), int(entry["before_line"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn line: those records keep counting, which only loses a re-measurement
    return found


def _lines(path: Path):
    if not path.is_file():
        return
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            yield from enumerate(handle, 1)
    except (OSError, EOFError) as exc:  # a torn or foreign .gz: what was read stays, the rest is reported
        yield 0, f"<{path.name} is damaged: {exc}>"


def _checked_hash(mod, expected: str) -> int:
    """The workload's structural hash, which must be the one its records were measured on."""
    import tvm_ffi

    digest = int(tvm_ffi.structural_hash(mod))
    if f"{digest:x}" != expected:
        raise ValueError(f"workload {expected} reads back as {digest:x}: not its records")
    return digest


def _database_class():
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    @derived_object
    class LogDatabase(ms.database.PyDatabase):
        """MetaSchedule's JSON database format, read forgivingly and appended durably.

        Stock JSONDatabase aborts on a garbage or truncated line (and crashes on an empty one);
        here such a line is skipped with a warning naming file and line, the good records are
        kept, and the files are only ever appended to, never rewritten, so nothing is lost.
        """

        def __init__(self, log_dir: Path, warn, live: bool = False):
            super().__init__()
            # While a tuner appends, the last line may be a write in flight, not damage.
            self.live = live
            self.log_dir = log_dir
            self.memory = ms.database.MemoryDatabase(module_equality="structural")
            self.line_of: dict[int, list] = {}  # structural hash -> [(workload module, line index)]
            self.workload_lines = 0
            self.record_lines = 0
            self.problems: list[str] = []
            self.seen: set = set()  # (workload hash, trace): a record the compact file and the history both hold
            self.trials: dict[int, int] = {}  # workload hash -> trials the compact file says were spent on it
            superseded = _superseded(log_dir)
            self._load_compact(warn, superseded)
            self._load_history(warn, superseded)

        def _load_compact(self, warn, superseded: dict[str, int]):
            for number, line in _lines(self.log_dir / COMPACT_FILE):
                try:
                    entry = json.loads(line)
                    if entry["workload"] in superseded:
                        continue  # its search was started over here: only the history after that counts
                    workload = ms.database.Workload.from_json(entry["mod"])
                    digest = _checked_hash(workload.mod, entry["workload"])
                    workload = self.memory.commit_workload(workload.mod)
                    self.trials[digest] = max(self.trials.get(digest, 0), int(entry.get("trials", 0)))
                    for record_json in entry["records"]:
                        self._commit_once(digest, ms.database.TuningRecord.from_json(record_json, workload), record_json)
                except Exception as exc:  # noqa: BLE001 - any unreadable line is skipped, whatever the cause
                    self._problem(warn, COMPACT_FILE, number, exc)

        def _load_history(self, warn, superseded: dict[str, int]):
            workloads, digests, superseded_before = [], [], []
            for number, line in _lines(self.log_dir / WORKLOADS_FILE):
                try:
                    workload = ms.database.Workload.from_json(json.loads(line))
                    digest = self._remember(workload.mod, number - 1)
                    workloads.append(self.memory.commit_workload(workload.mod))
                    digests.append(digest)
                    superseded_before.append(superseded.get(f"{digest:x}", 0))
                except Exception as exc:  # noqa: BLE001
                    workloads.append(None)
                    digests.append(None)
                    superseded_before.append(0)
                    self._problem(warn, WORKLOADS_FILE, number, exc)
            self.workload_lines = len(workloads)
            for number, line in _lines(self.log_dir / RECORDS_FILE):
                self.record_lines = number
                if self.live and not line.endswith("\n"):
                    break
                try:
                    index, record_json, *named = json.loads(line)
                    workload = workloads[index] if isinstance(index, int) and 0 <= index < len(workloads) else None
                    if workload is None:
                        raise ValueError(f"refers to workload line {index!r}, which is not readable")
                    if named and named[0] != f"{digests[index]:x}":
                        raise ValueError(f"was measured on workload {named[0]}, but line {index + 1} of "
                                         f"{WORKLOADS_FILE} is workload {digests[index]:x} (was that file replaced?)")
                    if number <= superseded_before[index]:
                        continue
                    self._commit_once(digests[index], ms.database.TuningRecord.from_json(record_json, workload), record_json)
                except Exception as exc:  # noqa: BLE001
                    self._problem(warn, RECORDS_FILE, number, exc)

        def _commit_once(self, digest: int, record, record_json) -> None:
            # The same schedule measured on another core count is another measurement.
            key = (digest, json.dumps(record_json[0]), json.dumps(record_json[2].get("num-cores")
                                                                  if isinstance(record_json[2], dict) else None))
            if key not in self.seen:
                self.seen.add(key)
                self.memory.commit_tuning_record(record)

        def trials_spent(self, mod) -> int:
            """Trials measured for a workload: its records, or what the compact file says was spent."""
            import tvm_ffi

            records = len(self.get_top_k(self.memory.commit_workload(mod), 1 << 30)) if self.has_workload(mod) else 0
            return max(records, self.trials.get(int(tvm_ffi.structural_hash(mod)), 0))

        def supersede(self, mod) -> None:
            """From now on, only records measured after this call count for ``mod``'s workload
            (takes effect when the database is opened again)."""
            with open(self.log_dir / SUPERSEDED_FILE, "a") as handle:
                handle.write(json.dumps({"workload": workload_key(mod), "before_line": self.record_lines}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())

        def _problem(self, warn, name, number, exc):
            message = f"{self.log_dir / name}:{number}: skipped an unreadable line ({type(exc).__name__}: {str(exc)[:160]})"
            self.problems.append(message)
            warn(message)

        def _remember(self, mod, index) -> int:
            import tvm_ffi

            digest = int(tvm_ffi.structural_hash(mod))
            self.line_of.setdefault(digest, []).append((mod, index))
            return digest

        def _index(self, mod):
            import tvm_ffi

            for known, index in self.line_of.get(int(tvm_ffi.structural_hash(mod)), []):
                if tvm_ffi.structural_equal(known, mod):
                    return index
            return None

        def _append(self, name: str, text: str) -> None:
            path = self.log_dir / name
            with open(path, "ab+") as handle:
                handle.seek(0, os.SEEK_END)
                if handle.tell() > 0:
                    handle.seek(-1, os.SEEK_END)
                    if handle.read(1) != b"\n":  # a truncated last line stays a line of its own
                        handle.write(b"\n")
                handle.write(text.encode() + b"\n")
                handle.flush()
                os.fsync(handle.fileno())

        def has_workload(self, mod) -> bool:
            return self.memory.has_workload(mod)

        def commit_workload(self, mod):
            """The workload of ``mod`` as the caller names its blocks (an equal one stored from
            another model may name them otherwise: records are renamed on the way in and out)."""
            if self._index(mod) is None:
                workload = self.memory.commit_workload(mod)
                self._append(WORKLOADS_FILE, json.dumps(workload.as_json()))
                self._remember(mod, self.workload_lines)
                self.workload_lines += 1
                return workload
            stored = self.memory.commit_workload(mod)
            return stored if block_names(stored.mod) == block_names(mod) else ms.database.Workload(mod)

        def commit_tuning_record(self, record) -> None:
            self.commit_workload(record.workload.mod)
            workload = self.memory.commit_workload(record.workload.mod)
            record = for_module(record, workload.mod, workload) or record  # never lose a measurement
            record_json = _record_json(record)
            digest = workload_key(workload.mod)
            self._append(RECORDS_FILE, json.dumps([self._index(workload.mod), record_json, digest]))
            self.record_lines += 1
            self._commit_once(int(digest, 16), record, record_json)

        def get_top_k(self, workload, top_k: int):
            """The best records, their traces naming blocks as ``workload.mod`` does."""
            stored = self.memory.commit_workload(workload.mod)
            renamed = (for_module(record, workload.mod) for record in self.memory.get_top_k(stored, top_k))
            return [record for record in renamed if record is not None]

        def get_all_tuning_records(self):
            return self.memory.get_all_tuning_records()

        def query_tuning_record(self, mod, target, workload_name=None):
            return self.memory.query_tuning_record(mod, target, workload_name)

        def query_schedule(self, mod, target, workload_name=None):
            return self.memory.query_schedule(mod, target, workload_name)

        def query_ir_module(self, mod, target, workload_name=None):
            return self.memory.query_ir_module(mod, target, workload_name)

        def __len__(self) -> int:
            return len(self.memory)

    return LogDatabase


def _record_json(record):
    """A record as MetaSchedule's own JSONDatabase writes it. TuningRecord.as_json() cannot: it
    fails on a trace that changes a weight's layout (an IndexMap), which C++ saves as a JSON graph."""
    import tvm
    from tvm.ir import Array, Map
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.tirx import FloatImm, IntImm

    def plain(obj):
        if obj is None or isinstance(obj, (int, float)):
            return obj
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (IntImm, FloatImm)):
            return obj.value
        if isinstance(obj, Array):
            return [plain(item) for item in obj]
        if isinstance(obj, Map):
            return {plain(key): plain(value) for key, value in obj.items()}
        return tvm.ir.save_json(obj)

    return plain(_ffi_api.TuningRecordAsJSON(record))


def open_database(log_dir: Path, warn=None, live: bool = False):
    """The target's database (empty when nothing was tuned for it yet)."""
    return _database_class()(log_dir, warn or (lambda message: print(f"warning: {message}", file=sys.stderr)), live)


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


@lru_cache(maxsize=4096)
def block_names(mod) -> tuple[str, ...]:
    """The blocks of a kernel in program order: two structurally equal kernels have theirs in
    the same order, under names that may differ. (Cached per module object: a build asks for
    the same few hundred.)"""
    return tuple(re.findall(r'T\.sblock\("([^"]+)"\)', mod.script(show_meta=False)))


def for_module(record, mod, workload=None):
    """``record`` with its trace naming blocks as ``mod`` does (None if it then does not apply). MetaSchedule matches a workload by
    structural equality, which ignores block names, but a trace finds blocks by name; legalized
    kernels name blocks after Relax variables (layer_norm's ``lv14_sum``), so an equal kernel of
    another model (or the same model optimized otherwise) would not find them."""
    from tvm.s_tir import meta_schedule as ms

    theirs, ours = block_names(record.workload.mod), block_names(mod)
    workload = workload or ms.database.Workload(mod)
    if theirs == ours:
        return record if workload is record.workload else ms.database.TuningRecord(
            record.trace, workload, record.run_secs, record.target, record.args_info)
    # Blocks a schedule makes are named after the block they come from (rfactor's
    # ``lv14_sum_rf``, cache stages, blockize's ``_o``): renamed by that prefix, longest first.
    renames = sorted(((t, o) for t, o in zip(theirs, ours) if t != o), key=lambda pair: -len(pair[0]))
    as_json = _record_json(record)
    for kind, _, attrs, _ in as_json[0][0]:
        if kind == "GetSBlock":
            old, new = next(((t, o) for t, o in renames if attrs[0] == t or attrs[0].startswith(t + "_")), (None, None))
            if old is not None:
                attrs[0] = new + attrs[0][len(old):]
    try:
        return ms.database.TuningRecord.from_json(as_json, workload)  # replays the trace: it must fit
    except Exception:  # noqa: BLE001 - a ScheduleError of any kind: a record that does not fit is not used
        return None


def compact(log_dir: Path, top_k: int = COMPACT_TOP_K, warn=None) -> dict:
    """Rewrites the shipped file from everything the folder holds: each workload's best ``top_k``
    records that ran, with the trials spent on it. The history files are left as they are."""
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
                                 "mod": workload.as_json(), "records": [_record_json(r) for r in best]}))
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
    return {"database": str(log_dir), "workloads": len(lines), "records": kept,
            "records_before": len(database.get_all_tuning_records()), "bytes": path.stat().st_size}


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

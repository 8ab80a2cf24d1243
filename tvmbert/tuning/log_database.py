"""The tuning database as MetaSchedule reads and writes it: its JSON format, read forgivingly and
appended durably. Imports TVM when imported: ``database.open_database`` imports it when asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmbert.core.targets import kind_of_key
from tvmbert.tuning.intrinsics import register_tensor_intrinsics
from tvmbert.tuning.record_files import (
    COMPACT_FILE,
    RECORDS_FILE,
    SUPERSEDED_FILE,
    WORKLOADS_FILE,
    DamagedLine,
    block_names,
    checked_hash,
    for_module,
    lines,
    record_as_json,
    superseded_workloads,
    workload_key,
)


@derived_object
class LogDatabase(ms.database.PyDatabase):
    """MetaSchedule's JSON database format, read forgivingly and appended durably.

    Stock JSONDatabase aborts on a garbage or truncated line (and crashes on an empty one);
    here such a line is skipped with a warning naming file and line, the good records are
    kept, and the files are only ever appended to, never rewritten, so nothing is lost.
    """

    def __init__(self, log_dir: Path, warn, live: bool = False, read_also: tuple[Path, ...] = ()):
        super().__init__()
        # While a tuner appends, the last line may be a write in flight, not damage.
        self.live = live
        self.log_dir = log_dir
        self.memory = ms.database.MemoryDatabase(module_equality="structural")
        self.line_of: dict[int, list] = {}  # structural hash -> [(workload module, line index)]
        self.workload_lines = 0
        self.record_lines = 0
        self.problems: list[str] = []
        # This folder's compact lines that this process could not read, though not damaged (a trace
        # naming an instruction or intrinsic this TVM lacks): compact carries them over as they are.
        self.unread_compact_lines: list[str] = []
        self.seen: set = set()  # (workload hash, trace): a record the compact file and the history both hold
        self.trials: dict[int, int] = {}  # workload hash -> trials the compact file says were spent on it
        # A folder is named by its target's key; its records' traces name that kind's tensor intrinsics.
        register_tensor_intrinsics(kind_of_key(log_dir.name))
        superseded = superseded_workloads(log_dir)
        for folder in (log_dir, *read_also):  # a search started over here (--fresh) drops the shipped records too
            self._load_compact(folder / COMPACT_FILE, warn, superseded)
        self._load_history(warn, superseded)

    def _load_compact(self, path: Path, warn, superseded: dict[str, int]):
        for number, line in lines(path):
            try:
                entry = json.loads(line)
                if entry["workload"] in superseded:
                    continue  # its search was started over here: only the history after that counts
                workload = ms.database.Workload.from_json(entry["mod"])
                digest = checked_hash(workload.mod, entry["workload"])
                workload = self.memory.commit_workload(workload.mod)
                self.trials[digest] = max(self.trials.get(digest, 0), int(entry.get("trials", 0)))
                for record_json in entry["records"]:
                    self._commit_once(digest, ms.database.TuningRecord.from_json(record_json, workload), record_json)
            except Exception as exc:  # noqa: BLE001 - any unreadable line is skipped, whatever the cause
                self._problem(warn, path, number, exc)
                damaged = isinstance(exc, (json.JSONDecodeError, KeyError, TypeError, DamagedLine)) or number == 0
                if path.parent == self.log_dir and not damaged:
                    self.unread_compact_lines.append(line.rstrip("\n"))

    def _load_history(self, warn, superseded: dict[str, int]):
        workloads, digests, superseded_before = [], [], []
        for number, line in lines(self.log_dir / WORKLOADS_FILE):
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
                self._problem(warn, self.log_dir / WORKLOADS_FILE, number, exc)
        self.workload_lines = len(workloads)
        for number, line in lines(self.log_dir / RECORDS_FILE):
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
                self._problem(warn, self.log_dir / RECORDS_FILE, number, exc)

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

    def _problem(self, warn, path: Path, number, exc):
        message = f"{path}:{number}: skipped an unreadable line ({type(exc).__name__}: {str(exc)[:160]})"
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
        record_json = record_as_json(record)
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

"""The files of a tuning database and how a record is read and written: shared by the
MetaSchedule database class (``log_database``) and the database's other users (``database``)."""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

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


def workload_key(mod) -> str:
    import tvm_ffi

    return f"{int(tvm_ffi.structural_hash(mod)):x}"


def superseded_workloads(log_dir: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for _, line in lines(log_dir / SUPERSEDED_FILE):
        try:
            entry = json.loads(line)
            found[entry["workload"]] = max(found.get(entry["workload"], 0), int(entry["before_line"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn line: those records keep counting, which only loses a re-measurement
    return found


def lines(path: Path):
    if not path.is_file():
        return
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            yield from enumerate(handle, 1)
    except (OSError, EOFError) as exc:  # a torn or foreign .gz: what was read stays, the rest is reported
        yield 0, f"<{path.name} is damaged: {exc}>"


class DamagedLine(ValueError):
    """A line that no process can read as what it says it is (its IR is not its workload)."""


def checked_hash(mod, expected: str) -> int:
    """The workload's structural hash, which must be the one its records were measured on."""
    import tvm_ffi

    digest = int(tvm_ffi.structural_hash(mod))
    if f"{digest:x}" != expected:
        raise DamagedLine(f"workload {expected} reads back as {digest:x}: not its records")
    return digest


def record_as_json(record):
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
    as_json = record_as_json(record)
    for kind, _, attrs, _ in as_json[0][0]:
        if kind == "GetSBlock":
            old, new = next(((t, o) for t, o in renames if attrs[0] == t or attrs[0].startswith(t + "_")), (None, None))
            if old is not None:
                attrs[0] = new + attrs[0][len(old):]
    try:
        return ms.database.TuningRecord.from_json(as_json, workload)  # replays the trace: it must fit
    except Exception:  # noqa: BLE001 - a ScheduleError of any kind: a record that does not fit is not used
        return None

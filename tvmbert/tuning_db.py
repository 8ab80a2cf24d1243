"""The tuning database: one MetaSchedule JSON database per target, shared by every model.

A workload tuned for one model is found again, structurally, in every other model and shape that
contains it, which is what makes tuning logs reusable across bert-base, bert-large, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WORKLOADS_FILE = "database_workload.json"
RECORDS_FILE = "database_tuning_record.json"


@dataclass(frozen=True)
class Task:
    name: str
    module: object  # the IRModule MetaSchedule tunes (one fused PrimFunc)
    weight: int  # how many times main calls it
    flops: float

    @property
    def trivial(self) -> bool:
        """No arithmetic (reshape, take, cast...): not worth a trial."""
        return self.flops == 0


def inference_module(module):
    """main alone: the weight transforms run once at build time and are not worth tuning."""
    import tvm
    from tvm import relax

    only_main = tvm.IRModule({gv: func for gv, func in module.functions_items() if gv.name_hint != "main_transform_params"})
    return relax.transform.DeadCodeElimination(["main"])(only_main)


def extract_tasks(module, target) -> list[Task]:
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    tasks = []
    for extracted in ms.relax_integration.extract_tasks(inference_module(module), target.tvm_target()):
        workload = extracted.dispatched[0]
        try:
            flops = float(estimate_tir_flops(workload))
        except Exception:  # an analysis that cannot read a kernel should not stop the stage
            flops = -1.0
        tasks.append(Task(extracted.task_name, workload, int(extracted.weight), flops))
    return tasks


def state(log_dir: Path) -> list:
    """What a build's cache key needs: the database files' sizes and times."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in (log_dir / WORKLOADS_FILE, log_dir / RECORDS_FILE) if f.is_file()]


def open_database(log_dir: Path):
    """The target's database, or None when nothing was tuned for it yet."""
    from tvm.s_tir import meta_schedule as ms

    if not (log_dir / WORKLOADS_FILE).is_file() or not (log_dir / RECORDS_FILE).is_file():
        return None
    return ms.database.JSONDatabase(
        path_workload=str(log_dir / WORKLOADS_FILE), path_tuning_record=str(log_dir / RECORDS_FILE), allow_missing=False
    )


def is_tuned(database, task: Task, target) -> bool:
    return database is not None and database.has_workload(task.module) and bool(
        database.get_top_k(database.commit_workload(task.module), 1)
    )

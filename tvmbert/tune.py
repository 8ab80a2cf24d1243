"""Stage 4: MetaSchedule tuning of the optimized module's tasks into the target's database."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from . import tuning_db
from .convert import load_module
from .errors import InputError
from .job import Job
from .optimize import optimize
from .targets import cpu_count


@dataclass
class TuneResult:
    database: str
    target: str
    tasks_total: int
    trivial: list[str]
    already_tuned: list[str]
    tuned_now: list[str]
    new_trials: int
    seconds: float
    best_us: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def tune(job: Job) -> TuneResult:
    options = job.config.tune
    optimized = job.upstream("optimize", optimize)
    log_dir = job.log_dir()
    if job.target.is_gpu and not job.target.device_present() and options.rpc_tracker is None:
        raise InputError(f"tuning measures candidates on the device: this machine has no {job.target.kind} GPU; "
                         "pass --rpc-tracker HOST:PORT --rpc-key KEY of a tracker that has one")
    tasks = tuning_db.extract_tasks(load_module(optimized.path), job.target)
    database = tuning_db.open_database(log_dir)
    target = job.target.tvm_target()
    trivial = [t.name for t in tasks if t.trivial]
    already = [t.name for t in tasks if not t.trivial and tuning_db.is_tuned(database, t, target)]
    todo = [t for t in tasks if not t.trivial and t.name not in already]
    started = time.perf_counter()
    if todo and options.trials > 0:
        per_task = options.trials_per_task or max(1, math.ceil(options.trials / len(todo)))
        job.say(f"tune: {len(todo)} tasks, {options.trials} trials (at most {per_task} per task) into {log_dir}")
        _run_metaschedule(todo, target, log_dir, options.trials, per_task)
    else:
        job.say(f"tune: nothing to tune ({len(already)} tasks already tuned, {len(trivial)} trivial)")
    database = tuning_db.open_database(log_dir)
    return TuneResult(
        database=str(log_dir),
        target=job.target.key,
        tasks_total=len(tasks),
        trivial=trivial,
        already_tuned=already,
        tuned_now=[t.name for t in todo if tuning_db.is_tuned(database, t, target)],
        new_trials=0,
        seconds=round(time.perf_counter() - started, 1),
    )


def _run_metaschedule(tasks, target, log_dir, trials: int, per_task: int) -> None:
    from tvm.s_tir import meta_schedule as ms

    log_dir.mkdir(parents=True, exist_ok=True)
    contexts = [
        ms.TuneContext(mod=t.module, target=target, space_generator="post-order-apply", search_strategy="evolutionary",
                       task_name=t.name, num_threads=cpu_count())
        for t in tasks
    ]
    ms.tune_tasks(tasks=contexts, task_weights=[t.weight for t in tasks], work_dir=str(log_dir),
                  max_trials_global=trials, max_trials_per_task=per_task, num_trials_per_iter=16)

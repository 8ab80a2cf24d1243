"""Stage 4: MetaSchedule tuning of the optimized module's tasks into the target's database.

Tasks are tuned one after another, the costliest first, each with its share of the budget;
every measured record is appended to the database at once, so an interrupted run loses at most
the batch in flight. A task whose budget was spent is marked done in ``tasks_done.json``: it is
not tuned again (for this model or any other that contains it) unless ``--retune`` asks. A task
that has records but is not marked done was interrupted, and resumes with what is left.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import measure, tuning_db
from .convert import load_module
from .errors import InputError
from .job import Job
from .optimize import optimize
from .targets import cpu_count

DONE_FILE = "tasks_done.json"  # one JSON object per line: {"workload": structural hash, "task", "trials"}
TRIALS_PER_BATCH = 16  # candidates built and measured together; what an interruption can lose
MIN_TRIALS_PER_TASK = 8  # below this a task's search has hardly started (unless --trials-per-task is lower)


@dataclass
class TaskProgress:
    name: str
    flops: float
    weight: int
    budget: int  # trials this task gets in the plan
    existing: int  # records already in the database
    status: str  # "trivial", "done", "todo", "no budget"
    new_trials: int = 0
    best_us: float | None = None

    def remaining(self, retune: bool) -> int:
        """Trials still owed: a resumed task continues; --retune spends the whole budget again."""
        return self.budget - (0 if retune else self.existing)


@dataclass
class TuneResult:
    database: str
    target: str
    tasks_total: int
    new_trials: int
    seconds: float
    trials_per_minute: float | None
    estimated_e2e_ms: float | None  # sum of the best kernel times x calls, tuned tasks only
    tasks: list[TaskProgress] = field(default_factory=list)
    skipped_trivial: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _done_keys(log_dir: Path) -> set[str]:
    done = set()
    path = log_dir / DONE_FILE
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                done.add(json.loads(line)["workload"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line only means that task is resumed instead of skipped
    return done


def _mark_done(log_dir: Path, task: tuning_db.Task, trials: int) -> None:
    with open(log_dir / DONE_FILE, "a") as handle:
        handle.write(json.dumps({"workload": tuning_db.workload_key(task.module), "task": task.name, "trials": trials}) + "\n")


def plan(tasks: list[tuning_db.Task], trials: int, per_task: int | None) -> dict[str, int]:
    """Trials per task, in proportion to its cost (flops x calls), capped by ``per_task``.

    Computed over every non-trivial task, tuned or not, so that a resumed run plans the same
    shares as the run it continues.
    """
    costly = sorted((t for t in tasks if not t.trivial), key=lambda t: -t.cost)
    cap = per_task or trials
    floor = min(MIN_TRIALS_PER_TASK, cap) or 1
    funded = costly[: min(len(costly), trials // floor)]
    total_cost = sum(t.cost for t in funded) or 1.0
    spare = trials - floor * len(funded)
    budgets = {t.name: 0 for t in costly}
    for task in funded:
        share = int(spare * task.cost / total_cost)
        budgets[task.name] = min(cap, floor + share)
    return budgets


def _check_writable(log_dir: Path) -> None:
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=log_dir, prefix=".probe-")
        probe.close()
    except OSError as exc:
        raise InputError(f"tuning log directory {log_dir} is not writable: {exc.strerror or exc}") from None


def tune(job: Job, retune: bool = False, train: bool = False, only: tuple[str, ...] = (), fresh: bool = False) -> TuneResult:
    """Tunes the job's inference kernels, or with ``train`` the forward and backward kernels of its
    first encoder layer (what ``add_tvm_dispatch`` compiles for ``bench --train``); ``only``:
    regular expressions, the tasks whose names match one of them (the trials go where the time is).

    ``retune`` spends the budget again on tasks already tuned, searching on from their records;
    ``fresh`` (implies ``retune``) starts their search over: their earlier records stop counting
    (kept in the file, superseded), e.g. records measured hot before CPU tuning measured cold."""
    retune = retune or fresh
    try:
        patterns = [re.compile(pattern) for pattern in only]
    except re.error as exc:
        raise InputError(f"--task {exc.pattern!r} is not a regular expression: {exc}") from None
    options = job.config.tune
    log_dir = job.log_dir()
    servers = 0
    if options.rpc_tracker:
        servers = measure.check_tracker(options.rpc_tracker, options.rpc_key)
    elif job.target.is_gpu and not job.target.device_present():
        raise InputError(f"tuning measures candidates on the device, and this machine has no {job.target.kind} GPU: "
                         "pass --rpc-tracker HOST:PORT --rpc-key KEY of a tracker that serves one")
    _check_writable(log_dir)
    if train:
        from . import training

        tasks = training.layer_tasks(job)
    else:
        optimized = job.upstream("optimize", optimize)
        tasks = tuning_db.extract_tasks(tuning_db.inference_module(load_module(optimized.path), job.target), job.target)
    if only:
        selected = [t for t in tasks if any(p.search(t.name) for p in patterns)]
        if not selected:
            raise InputError(f"--task {' '.join(only)} matches none of the tasks: {', '.join(t.name for t in tasks)}")
        tasks = selected
    started = time.perf_counter()
    with tuning_db.locked(log_dir, say=job.say):
        database = tuning_db.open_database(log_dir, warn=lambda message: job.say(f"warning: {message}"))
        budgets = plan(tasks, options.trials, options.trials_per_task)
        done = _done_keys(log_dir)
        progress = []
        for task in tasks:
            existing = database.trials_spent(task.module)
            if task.trivial:
                status = "trivial"
            elif tuning_db.workload_key(task.module) in done and existing and not retune:
                status = "done"
            else:
                status = "todo"
            state = TaskProgress(task.name, task.flops, task.weight, budgets.get(task.name, 0), existing, status,
                                 best_us=_best_us(database, task))
            if state.status == "todo" and state.remaining(retune) <= 0:
                state.status = "done" if existing else "no budget"
            progress.append(state)
        todo = [(task, p) for task, p in zip(tasks, progress) if p.status == "todo"]
        if fresh and any(p.existing for _, p in todo):
            for task, state in todo:
                database.supersede(task.module)
                state.existing, state.best_us = 0, None
            database = tuning_db.open_database(log_dir, warn=lambda message: None)
        if todo:
            _run(job, todo, database, log_dir, servers, retune, progress, started)
        else:
            unfunded = sum(p.status == "no budget" for p in progress)
            job.say(f"tune: 0 new trials: {sum(p.status == 'done' for p in progress)} tasks already tuned in {log_dir}, "
                    f"{sum(p.status == 'trivial' for p in progress)} trivial ones need none"
                    + (f", {unfunded} get no trials from --trials {options.trials}" if unfunded else ""))
    seconds = time.perf_counter() - started
    new_trials = sum(p.new_trials for p in progress)
    tuned = [p for p in progress if p.best_us is not None]
    return TuneResult(
        database=str(log_dir),
        target=job.target.key,
        tasks_total=len(tasks),
        new_trials=new_trials,
        seconds=round(seconds, 1),
        trials_per_minute=round(new_trials * 60 / seconds, 1) if new_trials else None,
        estimated_e2e_ms=round(sum(p.best_us * p.weight for p in tuned) / 1000, 3) if tuned else None,
        tasks=[p for p in progress if p.status != "trivial"],
        skipped_trivial=[p.name for p in progress if p.status == "trivial"],
    )


def _best_us(database, task) -> float | None:
    best = tuning_db.best_seconds(database, task)
    return round(best * 1e6, 2) if best is not None else None


def _run(job: Job, todo, database, log_dir: Path, servers: int, retune: bool, progress, started: float) -> None:
    from tvm.s_tir import meta_schedule as ms

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    target = job.target.tvm_target()
    remote = job.config.tune.rpc_tracker is not None
    builder = measure.make_builder(cpu=job.target.kind == "llvm", workers=cpu_count())
    cold = not job.target.is_gpu
    runner = measure.make_rpc_runner(job.config.tune.rpc_tracker, job.config.tune.rpc_key, servers, cold) if remote \
        else measure.make_local_runner(cold)
    planned = sum(p.remaining(retune) for _, p in todo)
    where = f"RPC tracker {job.config.tune.rpc_tracker} ({servers} '{job.config.tune.rpc_key}' devices)" if remote else "this machine"
    job.say(f"tune: {len(todo)} tasks, {planned} trials, measured on {where}, into {log_dir}")
    scratch = Path(tempfile.mkdtemp(prefix="tvmbert-tune-"))
    view = _ProgressView(progress, planned, started)
    try:
        with Live(view.table(), console=Console(stderr=True), refresh_per_second=2, transient=False) as live:
            for task, state in sorted(todo, key=lambda item: -item[0].cost):
                remaining = state.remaining(retune)
                state.status = "tuning"
                live.update(view.table())

                def counted(results, state=state, task=task):
                    state.new_trials += len(results)
                    state.best_us = _best_us(database, task)
                    live.update(view.table())

                context = ms.TuneContext(mod=task.module, target=target, space_generator="post-order-apply",
                                         search_strategy="evolutionary", task_name=task.name, num_threads=cpu_count())
                ms.tune_tasks(
                    tasks=[context], task_weights=[float(task.weight)], work_dir=str(scratch),
                    max_trials_global=remaining, max_trials_per_task=remaining,
                    num_trials_per_iter=min(TRIALS_PER_BATCH, remaining), builder=builder, runner=runner,
                    database=database, cost_model="xgb",
                    measure_callbacks=[*ms.MeasureCallback.create("default"), _progress_callback(counted)],
                )
                state.best_us, state.status = _best_us(database, task), "done"
                _mark_done(log_dir, task, state.existing + state.new_trials)
                live.update(view.table())
    finally:
        builder.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


def _progress_callback(on_batch):
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    @derived_object
    class Progress(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            on_batch(runner_results)

    return Progress()


class _ProgressView:
    def __init__(self, progress: list[TaskProgress], planned: int, started: float):
        self.progress, self.planned, self.started = progress, planned, started

    def table(self) -> Table:
        rows = [p for p in self.progress if p.status != "trivial"]
        trials = sum(p.new_trials for p in rows)
        elapsed = time.perf_counter() - self.started
        eta = (self.planned - trials) * elapsed / trials if trials else None
        tuned = [p for p in rows if p.best_us is not None]
        e2e = sum(p.best_us * p.weight for p in tuned) / 1000
        done = sum(p.status == "done" for p in rows)
        caption = (f"tasks {done}/{len(rows)} · trials {trials}/{self.planned} · elapsed {elapsed:,.0f} s"
                   + (f" · ETA {eta:,.0f} s" if eta is not None else "")
                   + (f" · est. end-to-end {e2e:.3f} ms over {len(tuned)} tuned tasks" if tuned else ""))
        table = Table(title="MetaSchedule tuning", caption=caption)
        for column in ("task", "MFLOP x calls", "trials", "best µs", "status"):
            table.add_column(column, justify="left" if column in ("task", "status") else "right")
        for p in rows:
            table.add_row(p.name, f"{p.flops / 1e6:.2f} x {p.weight}", f"{p.existing + p.new_trials}/{p.budget}",
                          f"{p.best_us:.1f}" if p.best_us is not None else "-", p.status)
        return table

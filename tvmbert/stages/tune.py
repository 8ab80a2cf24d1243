"""Stage 4: MetaSchedule tuning of the optimized module's tasks into the target's database.

Tasks are tuned one after another, the costliest first, each with its share of the budget;
every measured record is appended to the database at once, so an interrupted run loses at most
the batch in flight. A task whose budget was spent is marked done in ``tasks_done.json``: it is
not tuned again (for this model or any other that contains it) unless ``--retune`` asks. A task
that has records but is not marked done was interrupted, and resumes with what is left.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tvmbert.core import artifacts
from tvmbert.core.errors import InputError
from tvmbert.core.targets import cpu_count
from tvmbert.ir.files import load_module
from tvmbert.ir.tasks import extract_tasks, inference_module, marked_kernels, without_marks
from tvmbert.stages.job import Job
from tvmbert.stages.optimize import optimize
from tvmbert.tuning import database, measure, record_files
from tvmbert.tuning.catalog import Catalog
from tvmbert.tuning.search import (
    Session,
    TaskProgress,
    best_us,
    estimate_ms,
    fastest,
    fund_where_the_time_is,
    plan,
)

ADAPT_CANDIDATES = 3  # --adapt: the best records per kernel taken from each other CPU database, measured here
ADAPT_TRIALS = 320  # --adapt: seeded search trials after measuring (about 4 minutes on 2 cores)


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


def _prepare(job: Job) -> tuple[Path, int]:
    """The database folder, checked writable, and the RPC servers to measure on (0: this machine)."""
    options = job.config.tune
    servers = 0
    if options.rpc_tracker:
        servers = measure.check_tracker(options.rpc_tracker, options.rpc_key)
    elif job.target.is_gpu and not job.target.device_present():
        raise InputError(f"tuning measures candidates on the device, and this machine has no {job.target.kind} GPU: "
                         "pass --rpc-tracker HOST:PORT --rpc-key KEY of a tracker that serves one")
    log_dir = job.log_dir()
    artifacts.check_writable_folder(log_dir, "--log-dir")
    return log_dir, servers


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
        raise InputError(f"--kernel {exc.pattern!r} is not a regular expression: {exc}") from None
    options = job.config.tune
    log_dir, servers = _prepare(job)
    if train:
        from tvmbert.training import dispatch

        tasks = dispatch.layer_tasks(job)
    else:
        optimized = job.upstream("optimize", optimize)
        tasks = extract_tasks(inference_module(load_module(optimized.path), job.target), job.target)
    if only:
        selected = [t for t in tasks if any(p.search(t.name) for p in patterns)]
        if not selected:
            raise InputError(f"--kernel {' '.join(only)} matches none of the kernels: {', '.join(t.name for t in tasks)}")
        tasks = selected
    started = time.perf_counter()
    # The shipped records count as tuned and seed the search; what this run measures goes to log_dir alone.
    shipped = database.shipped_folders(log_dir)
    with database.locked(log_dir, say=job.say):
        records = database.open_database(log_dir, warn=lambda message: job.say(f"warning: {message}"), read_also=shipped)
        budgets = plan(tasks, options.trials, options.trials_per_task)
        done = set().union(*(database.done_keys(folder) for folder in (log_dir, *shipped)))
        progress = []
        for task in tasks:
            existing = records.trials_spent(task.module)
            if task.trivial:
                status = "trivial"
            elif record_files.workload_key(task.module) in done and existing and not retune:
                status = "done"
            else:
                status = "todo"
            state = TaskProgress(task.name, task.flops, task.weight, budgets.get(task.name, 0), existing, status,
                                 best_us=best_us(records, task))
            if state.status == "todo" and state.remaining(retune) <= 0:
                state.status = "done" if existing else "no budget"
            progress.append(state)
        todo = [(task, p) for task, p in zip(tasks, progress) if p.status == "todo"]
        if fresh and any(p.existing for _, p in todo):
            for task, state in todo:
                records.supersede(task.module)
                state.existing, state.best_us = 0, None
            records = database.open_database(log_dir, warn=lambda message: None, read_also=shipped)
        if todo:
            with Session(job.target, job.config.tune, job.say, records, log_dir, servers, progress, sum(p.remaining(retune) for _, p in todo), started) as session:
                session.search(todo, retune)
            _compact(job, log_dir)
        else:
            unfunded = sum(p.status == "no budget" for p in progress)
            job.say(f"tune: 0 new trials: {sum(p.status == 'done' for p in progress)} tasks already tuned in {log_dir}, "
                    f"{sum(p.status == 'trivial' for p in progress)} trivial ones need none"
                    + (f", {unfunded} get no trials from --trials {options.trials}" if unfunded else ""))
    return _result(job, log_dir, tasks, progress, started)


def adapt(job: Job) -> TuneResult:
    """Makes other CPUs' records this CPU's own: measures, cold and at this machine's core count,
    the best ADAPT_CANDIDATES records of every kernel from each other CPU database that fits,
    keeps them under this CPU's key, then spends ``--trials`` (default ADAPT_TRIALS) of seeded
    search on the kernels where the end-to-end time is, in proportion to their share of it.
    Kernels that already have records of their own are left as they are; nothing is marked done,
    so a full tune still tunes everything."""
    log_dir, servers = _prepare(job)
    optimized = job.upstream("optimize", optimize)
    module = inference_module(load_module(optimized.path), job.target)
    marked = marked_kernels(module)
    kernels = [t for t in extract_tasks(module, job.target) if not t.trivial]
    # Both layouts of a kernel that may lay its weight out: the build picks whichever measures faster here.
    variants = kernels + [t for t in extract_tasks(without_marks(module, marked), job.target)
                          if t.name in marked]
    started = time.perf_counter()
    with database.locked(log_dir, say=job.say):
        catalog = Catalog(log_dir, job.target.key, warn=lambda message: job.say(f"warning: {message}"),
                          cores=cpu_count())
        native = catalog.native.database
        # This CPU's records measured on another core count are measured again, as other CPUs' are.
        candidates = [(task, [r for source in catalog.sources for r in catalog.records(source, task.module)[:ADAPT_CANDIDATES]])
                      for task in variants if not catalog.measured_here(task.module)]
        if not any(records for _, records in candidates) and not any(catalog.measured_here(t.module) for t in variants):
            raise InputError(f"--adapt measures other CPUs' records here, and there are no records for {job.config.model} from a "
                             f"CPU that fits {job.target.key} in {' or '.join(map(str, database.log_roots(log_dir.parent)))}")
        candidates = [(task, records) for task, records in candidates if records]
        progress = [TaskProgress(t.name, t.flops, t.weight, len(records), 0, "todo") for t, records in candidates]
        trials = job.config.tune.trials or ADAPT_TRIALS
        with Session(job.target, job.config.tune, job.say, native, log_dir, servers, progress, sum(p.budget for p in progress) + trials, started) as session:
            for (task, records), state in zip(candidates, progress):
                session.measure_records(task, state, records)
            todo = fund_where_the_time_is(kernels, variants, native, trials, session.view.progress)
            session.search(todo, retune=True, mark_done=False)
        _compact(job, log_dir)
    return _result(job, log_dir, variants, progress, started)


def _result(job: Job, log_dir: Path, tasks, progress: list[TaskProgress], started: float) -> TuneResult:
    seconds = time.perf_counter() - started
    new_trials = sum(p.new_trials for p in progress)
    tuned = fastest(progress)
    return TuneResult(
        database=str(log_dir),
        target=job.target.key,
        tasks_total=len(tasks),
        new_trials=new_trials,
        seconds=round(seconds, 1),
        trials_per_minute=round(new_trials * 60 / seconds, 1) if new_trials else None,
        estimated_e2e_ms=round(estimate_ms(tuned), 3) if tuned else None,
        tasks=[p for p in progress if p.status != "trivial"],
        skipped_trivial=[p.name for p in progress if p.status == "trivial"],
    )


def _compact(job: Job, log_dir: Path) -> None:
    """Keeps the user's compact file current with what this run measured (tvmbert compact's file)."""
    summary = database.compact(log_dir, warn=lambda message: None)
    job.say(f"tune: {summary['records']} best records of {summary['workloads']} workloads in {log_dir / record_files.COMPACT_FILE}")



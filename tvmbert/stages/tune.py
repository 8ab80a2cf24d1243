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
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tvmbert.core import artifacts
from tvmbert.core.errors import InputError, Interrupted
from tvmbert.core.targets import cpu_count
from tvmbert.ir.files import load_module
from tvmbert.ir.tasks import Task, extract_tasks, inference_module, marked_kernels, without_marks
from tvmbert.stages.job import Job
from tvmbert.stages.optimize import optimize
from tvmbert.tuning import database, measure
from tvmbert.tuning.catalog import Catalog

DONE_FILE = "tasks_done.json"  # one JSON object per line: {"workload": structural hash, "task", "trials"}
TRIALS_PER_BATCH = 16  # candidates built and measured together; what an interruption can lose
MIN_TRIALS_PER_TASK = 8  # below this a task's search has hardly started (unless --trials-per-task is lower)
ADAPT_CANDIDATES = 3  # --adapt: the best records per kernel taken from each other CPU database, measured here
ADAPT_TRIALS = 320  # --adapt: seeded search trials after measuring (about 4 minutes on 2 cores)


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


def _mark_done(log_dir: Path, task: Task, trials: int) -> None:
    with open(log_dir / DONE_FILE, "a") as handle:
        handle.write(json.dumps({"workload": database.workload_key(task.module), "task": task.name, "trials": trials}) + "\n")


def plan(tasks: list[Task], trials: int, per_task: int | None) -> dict[str, int]:
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
    with database.locked(log_dir, say=job.say):
        records = database.open_database(log_dir, warn=lambda message: job.say(f"warning: {message}"))
        budgets = plan(tasks, options.trials, options.trials_per_task)
        done = _done_keys(log_dir)
        progress = []
        for task in tasks:
            existing = records.trials_spent(task.module)
            if task.trivial:
                status = "trivial"
            elif database.workload_key(task.module) in done and existing and not retune:
                status = "done"
            else:
                status = "todo"
            state = TaskProgress(task.name, task.flops, task.weight, budgets.get(task.name, 0), existing, status,
                                 best_us=_best_us(records, task))
            if state.status == "todo" and state.remaining(retune) <= 0:
                state.status = "done" if existing else "no budget"
            progress.append(state)
        todo = [(task, p) for task, p in zip(tasks, progress) if p.status == "todo"]
        if fresh and any(p.existing for _, p in todo):
            for task, state in todo:
                records.supersede(task.module)
                state.existing, state.best_us = 0, None
            records = database.open_database(log_dir, warn=lambda message: None)
        if todo:
            with _Session(job, records, log_dir, servers, progress, sum(p.remaining(retune) for _, p in todo), started) as session:
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
            raise InputError(f"--adapt measures other CPUs' records here, and {log_dir.parent} holds no records for "
                             f"{job.config.model} from a CPU that fits {job.target.key}")
        candidates = [(task, records) for task, records in candidates if records]
        progress = [TaskProgress(t.name, t.flops, t.weight, len(records), 0, "todo") for t, records in candidates]
        trials = job.config.tune.trials or ADAPT_TRIALS
        with _Session(job, native, log_dir, servers, progress, sum(p.budget for p in progress) + trials, started) as session:
            for (task, records), state in zip(candidates, progress):
                session.measure_records(task, state, records)
            todo = _where_the_time_is(kernels, variants, native, trials, session.view.progress)
            session.search(todo, retune=True, mark_done=False)
        _compact(job, log_dir)
    return _result(job, log_dir, variants, progress, started)


def _where_the_time_is(kernels, variants, records, trials: int, progress: list[TaskProgress]):
    """Per kernel, its faster measured layout, funded in proportion to its share of the estimated
    end-to-end time (kernels below MIN_TRIALS_PER_TASK trials of it get none)."""
    times = {}
    for task in variants:
        seconds = database.best_seconds(records, task)
        if seconds is not None and (task.name not in times or seconds < times[task.name][0]):
            times[task.name] = (seconds, task)
    shares = sorted(((times[k.name][0] * k.weight, times[k.name][1]) for k in kernels if k.name in times),
                    key=lambda item: -item[0])
    total = sum(share for share, _ in shares) or 1.0
    todo = []
    for share, task in shares:
        budget = int(trials * share / total)
        if budget >= MIN_TRIALS_PER_TASK:
            state = TaskProgress(task.name, task.flops, task.weight, budget, 0, "todo",
                                 best_us=_best_us(records, task))
            progress.append(state)
            todo.append((task, state))
    return todo


def _result(job: Job, log_dir: Path, tasks, progress: list[TaskProgress], started: float) -> TuneResult:
    seconds = time.perf_counter() - started
    new_trials = sum(p.new_trials for p in progress)
    tuned = _fastest(progress)
    return TuneResult(
        database=str(log_dir),
        target=job.target.key,
        tasks_total=len(tasks),
        new_trials=new_trials,
        seconds=round(seconds, 1),
        trials_per_minute=round(new_trials * 60 / seconds, 1) if new_trials else None,
        estimated_e2e_ms=round(_estimate_ms(tuned), 3) if tuned else None,
        tasks=[p for p in progress if p.status != "trivial"],
        skipped_trivial=[p.name for p in progress if p.status == "trivial"],
    )


def _fastest(progress: list[TaskProgress]) -> list[TaskProgress]:
    """The measured tasks, a kernel measured in two layouts once, at its faster."""
    best: dict[str, TaskProgress] = {}
    for p in progress:
        if p.best_us is not None and (p.name not in best or p.best_us < best[p.name].best_us):
            best[p.name] = p
    return list(best.values())


def _estimate_ms(tuned: list[TaskProgress]) -> float:
    """The end-to-end time the kernels' best records add up to (their time x calls)."""
    return sum(p.best_us * p.weight for p in tuned) / 1000


def _best_us(records, task) -> float | None:
    best = database.best_seconds(records, task)
    return round(best * 1e6, 2) if best is not None else None


class _Session:
    """One tuning run's builder, runner and live progress table; records go to ``database`` as
    they are measured. Interrupted (Ctrl-C), it says what was kept and how to resume."""

    def __init__(self, job: Job, records, log_dir: Path, servers: int, progress: list[TaskProgress], planned: int,
                 started: float):
        self.job, self.records, self.log_dir, self.servers = job, records, log_dir, servers
        self.view = _ProgressView(progress, planned, started)
        self.target = job.target.tvm_target()

    def __enter__(self):
        logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
        options = self.job.config.tune
        self.builder = measure.make_builder(cpu=not self.job.target.is_gpu, workers=cpu_count())
        cold = not self.job.target.is_gpu
        self.runner = measure.make_rpc_runner(options.rpc_tracker, options.rpc_key, self.servers, cold) \
            if options.rpc_tracker else measure.make_local_runner(cold)
        where = (f"RPC tracker {options.rpc_tracker} ({self.servers} '{options.rpc_key}' devices)" if options.rpc_tracker
                 else f"this machine ({cpu_count()} cores)")
        self.job.say(f"tune: {self.view.planned} trials, measured on {where}, into {self.log_dir}")
        self.scratch = Path(tempfile.mkdtemp(prefix="tvmbert-tune-"))
        self.interrupted = _StopRequest(self.job.say)
        self.console = Console(stderr=True)
        self.live = Live(self.view.table(), console=self.console, refresh_per_second=2, transient=False)
        self.live.__enter__()
        return self

    def __exit__(self, kind, exc, tb):
        self.live.__exit__(kind, exc, tb)
        if not self.console.is_terminal:
            self.console.line()  # the last frame ends mid-line when stderr is a file or a pipe
        self.builder.shutdown()
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.interrupted.restore()
        if kind is not None and (issubclass(kind, KeyboardInterrupt) or self.interrupted.fired):
            kept = sum(p.new_trials for p in self.view.progress)
            raise Interrupted(f"tuning interrupted: the {kept} trials measured in this run are kept in {self.log_dir}; "
                              "run the same command again to resume where it stopped") from None
        return False

    def refresh(self) -> None:
        self.live.update(self.view.table())

    def search(self, todo, retune: bool, mark_done: bool = True) -> None:
        """MetaSchedule's evolutionary search per task, costliest first, seeded by the database's records."""
        from tvm.s_tir import meta_schedule as ms

        for task, state in sorted(todo, key=lambda item: -item[0].cost):
            self.interrupted.check()
            remaining = state.remaining(retune)
            state.status = "tuning"
            self.refresh()

            def counted(results, state=state, task=task):
                state.new_trials += len(results)
                state.best_us = _best_us(self.records, task)
                self.refresh()
                self.interrupted.check()

            context = ms.TuneContext(mod=task.module, target=self.target, space_generator="post-order-apply",
                                     search_strategy="evolutionary", task_name=task.name, num_threads=cpu_count())
            ms.tune_tasks(
                tasks=[context], task_weights=[float(task.weight)], work_dir=str(self.scratch),
                max_trials_global=remaining, max_trials_per_task=remaining,
                num_trials_per_iter=min(TRIALS_PER_BATCH, remaining), builder=self.builder, runner=self.runner,
                database=self.records, cost_model="xgb",
                measure_callbacks=[*ms.MeasureCallback.create("default"), _progress_callback(counted)],
            )
            state.best_us, state.status = _best_us(self.records, task), "done"
            if mark_done:
                _mark_done(self.log_dir, task, state.existing + state.new_trials)
            self.refresh()

    def measure_records(self, task: Task, state: TaskProgress, records: list) -> None:
        """Times other CPUs' records of ``task`` here, cold, and stores them as this CPU's."""
        import tvm
        from tvm.s_tir import meta_schedule as ms
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        state.status = "measuring"
        self.refresh()
        workload = self.records.commit_workload(task.module)
        device = self.job.target.device_type
        for start in range(0, len(records), TRIALS_PER_BATCH):
            batch = records[start:start + TRIALS_PER_BATCH]
            modules = []
            for record in batch:
                schedule = tvm.s_tir.Schedule(task.module)
                record.trace.apply_to_schedule(schedule, remove_postproc=False)
                modules.append(schedule.mod)
            # As MetaSchedule measures: a weight the schedule lays out anew arrives in that layout.
            args = [ArgInfo.from_entry_func(mod, remove_preproc=True) for mod in modules]
            built = self.builder.build([ms.builder.BuilderInput(mod, self.target) for mod in modules])
            inputs = [ms.runner.RunnerInput(b.artifact_path, device, a) for b, a in zip(built, args) if b.error_msg is None]
            results = iter([future.result() for future in self.runner.run(inputs)])
            for record, outcome, arg_info in zip(batch, built, args):
                result = next(results) if outcome.error_msg is None else None
                if result is not None and result.error_msg is None and result.run_secs:
                    self.records.commit_tuning_record(ms.database.TuningRecord(
                        record.trace, workload, result.run_secs, self.target, arg_info))
            state.new_trials += len(batch)
            state.best_us = _best_us(self.records, task)
            self.refresh()
            self.interrupted.check()
        state.status = "measured"
        self.refresh()


class _StopRequest:
    """Ctrl-C while tuning: raising in the middle of MetaSchedule's C++ can abort the process,
    so the first Ctrl-C only asks the run to stop after the batch in flight (the next progress
    callback raises); a second one stops at once."""

    def __init__(self, say):
        self.fired = False
        self.say = say
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.fired:
            raise KeyboardInterrupt
        self.fired = True
        self.say("tune: interrupted; stopping after the batch being measured (Ctrl-C again to stop at once)")

    def check(self) -> None:
        if self.fired:
            raise KeyboardInterrupt

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _compact(job: Job, log_dir: Path) -> None:
    """Keeps the shipped file current with what this run measured."""
    summary = database.compact(log_dir, warn=lambda message: None)
    job.say(f"tune: {summary['records']} best records of {summary['workloads']} workloads in {log_dir / database.COMPACT_FILE}")


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
        tuned = _fastest(rows)
        e2e = _estimate_ms(tuned)
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

"""MetaSchedule's search as tune runs it: the plan of trials per task, a session's builder,
runner and live progress table, and what an interruption keeps."""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tvmbert.core.errors import Interrupted
from tvmbert.core.targets import cpu_count
from tvmbert.ir.tasks import Task
from tvmbert.tuning import database, measure
from tvmbert.tuning.intrinsics import register_tensor_intrinsics

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


def fund_where_the_time_is(kernels, variants, records, trials: int, progress: list[TaskProgress]):
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
                                 best_us=best_us(records, task))
            progress.append(state)
            todo.append((task, state))
    return todo


def fastest(progress: list[TaskProgress]) -> list[TaskProgress]:
    """The measured tasks, a kernel measured in two layouts once, at its faster."""
    best: dict[str, TaskProgress] = {}
    for p in progress:
        if p.best_us is not None and (p.name not in best or p.best_us < best[p.name].best_us):
            best[p.name] = p
    return list(best.values())


def estimate_ms(tuned: list[TaskProgress]) -> float:
    """The end-to-end time the kernels' best records add up to (their time x calls)."""
    return sum(p.best_us * p.weight for p in tuned) / 1000


def best_us(records, task) -> float | None:
    best = database.best_seconds(records, task)
    return round(best * 1e6, 2) if best is not None else None


class Session:
    """One tuning run's builder, runner and live progress table; records go to ``database`` as
    they are measured. Interrupted (Ctrl-C), it says what was kept and how to resume."""

    def __init__(self, target, options, say, records, log_dir: Path, servers: int, progress: list[TaskProgress], planned: int,
                 started: float):
        """``target``: the TargetSpec measured for; ``options``: the TuneOptions; ``say``: progress lines."""
        self.spec, self.options, self.say = target, options, say
        self.records, self.log_dir, self.servers = records, log_dir, servers
        self.view = _ProgressView(progress, planned, started)
        self.target = target.tvm_target()

    def __enter__(self):
        logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
        register_tensor_intrinsics(self.spec.kind)
        options = self.options
        self.builder = measure.make_builder(workers=cpu_count())
        cold = not self.spec.is_gpu
        self.runner = measure.make_rpc_runner(options.rpc_tracker, options.rpc_key, self.servers, cold) \
            if options.rpc_tracker else measure.make_local_runner(cold)
        where = (f"RPC tracker {options.rpc_tracker} ({self.servers} '{options.rpc_key}' devices)" if options.rpc_tracker
                 else f"this machine ({cpu_count()} cores)")
        self.say(f"tune: {self.view.planned} trials, measured on {where}, into {self.log_dir}")
        self.scratch = Path(tempfile.mkdtemp(prefix="tvmbert-tune-"))
        self.interrupted = _StopRequest(self.say)
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
                state.best_us = best_us(self.records, task)
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
            state.best_us, state.status = best_us(self.records, task), "done"
            if mark_done:
                database.mark_done(self.log_dir, task, state.existing + state.new_trials)
            self.refresh()

    def measure_records(self, task: Task, state: TaskProgress, records: list) -> None:
        """Times other CPUs' records of ``task`` here, cold, and stores them as this CPU's."""
        import tvm
        from tvm.s_tir import meta_schedule as ms
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        state.status = "measuring"
        self.refresh()
        workload = self.records.commit_workload(task.module)
        device = self.spec.device_type
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
            state.best_us = best_us(self.records, task)
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
        tuned = fastest(rows)
        e2e = estimate_ms(tuned)
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

"""Dynamic batching: requests that arrive while a batch runs are merged into the next one, oldest
first, up to a token budget counted as TEI counts it (``--max-batch-tokens``: rows x the longest
row, the tokens a padded run computes), and run as one call of the package, whose planner spreads
the rows over its buckets. The call runs on one worker thread, never on the event loop (one call
already uses every core). ``max_wait_s`` (Triton's maximum queue delay) lets a request wait that
long after it arrived for others to join it, unless the budget fills first; 0 never delays one.
A request whose client went away is cancelled and left out of every batch after."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tvmbert.serve.metrics import Metrics


@dataclass
class Pending:
    encodings: list
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def longest(self) -> int:
        return max(len(e.ids) for e in self.encodings)


def padded_tokens(rows: int, longest: int) -> int:
    """TEI's count of a batch's tokens: every row as long as the longest."""
    return rows * longest


class Batcher:
    def __init__(self, run: Callable[[list], dict], max_batch_tokens: int, max_wait_s: float, metrics: Metrics):
        self.run, self.max_batch_tokens, self.max_wait_s, self.metrics = run, max_batch_tokens, max_wait_s, metrics
        self.waiting: deque[Pending] = deque()
        self.arrived = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tvmbert-batch")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """After the server has answered its requests in flight: no batch is left to run."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def submit(self, encodings: list) -> dict:
        """Per-input outputs of one request's ``encodings``, once its batch has run. Cancelled
        (its client gone), it is left out of the batches still to be taken."""
        pending = Pending(encodings, asyncio.get_running_loop().create_future())
        self.waiting.append(pending)
        self.metrics.set_gauge("tvmbert_queue_requests", len(self.waiting))
        self.arrived.set()
        return await pending.future

    async def _loop(self) -> None:
        while True:
            await self.arrived.wait()
            await self._wait_for_company()
            batch = self._take()
            if self.waiting:  # left for the next batch: run it next, whatever cleared the event while waiting
                self.arrived.set()
            else:
                self.arrived.clear()
            if batch:
                await self._run(batch)

    async def _wait_for_company(self) -> None:
        """Until the oldest waiting request has waited max_wait_s, or the budget is full."""
        while self.max_wait_s > 0 and self.waiting and not self._full():
            remaining = self.waiting[0].enqueued + self.max_wait_s - time.perf_counter()
            if remaining <= 0:
                return
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)

    def _full(self) -> bool:
        live = [p for p in self.waiting if not p.future.done()]
        rows = sum(len(p.encodings) for p in live)
        return bool(live) and padded_tokens(rows, max(p.longest for p in live)) >= self.max_batch_tokens

    def _take(self) -> list[Pending]:
        """The waiting requests, oldest first, while the batch stays within the budget (the
        first one always: a request over the budget alone runs alone)."""
        batch, rows, longest = [], 0, 0
        while self.waiting:
            pending = self.waiting[0]
            if pending.future.done():  # cancelled: its client went away
                self.waiting.popleft()
                continue
            grown = padded_tokens(rows + len(pending.encodings), max(longest, pending.longest))
            if batch and grown > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
            rows, longest = rows + len(pending.encodings), max(longest, pending.longest)
        self.metrics.set_gauge("tvmbert_queue_requests", len(self.waiting))
        return batch

    async def _run(self, batch: list[Pending]) -> None:
        started = time.perf_counter()
        for pending in batch:
            self.metrics.observe("tvmbert_queue_seconds", started - pending.enqueued)
        encodings = [e for pending in batch for e in pending.encodings]
        self.metrics.observe("tvmbert_batch_size", len(encodings))
        self.metrics.observe("tvmbert_batch_tokens", sum(len(e.ids) for e in encodings))
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.executor, self.run, encodings)
        except Exception as exc:  # noqa: BLE001 - every request of the batch answers with it
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)
            return
        finally:
            self.metrics.observe("tvmbert_compute_seconds", time.perf_counter() - started)
        start = 0
        for pending in batch:
            end = start + len(pending.encodings)
            if not pending.future.done():
                pending.future.set_result({name: values[start:end] for name, values in results.items()})
            start = end

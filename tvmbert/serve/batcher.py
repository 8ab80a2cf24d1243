"""Dynamic batching: the requests that arrive while a batch runs are merged into the next one, up
to a token budget (TEI's --max-batch-tokens), and run as one call of the package, whose planner
spreads them over its buckets. The call runs on one worker thread, never on the event loop (the
package already uses every core for one call). ``max_wait_s`` lets the first request of an idle
server wait for company; 0 (the default) never delays it."""

from __future__ import annotations

import asyncio
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
    def tokens(self) -> int:
        return sum(len(e.ids) for e in self.encodings)


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
        """After the server has drained its requests: no batch is left to run."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def submit(self, encodings: list) -> dict:
        """Per-input outputs of ``encodings`` (one request's), once its batch has run."""
        pending = Pending(encodings, asyncio.get_running_loop().create_future())
        self.waiting.append(pending)
        self.arrived.set()
        return await pending.future  # cancelled with the request: the batch leaves it out

    async def _loop(self) -> None:
        while True:
            await self.arrived.wait()
            if self.max_wait_s > 0 and self._tokens_waiting() < self.max_batch_tokens:
                await asyncio.sleep(self.max_wait_s)
            batch = self._take()
            if not self.waiting:
                self.arrived.clear()
            if batch:
                await self._run(batch)

    def _tokens_waiting(self) -> int:
        return sum(p.tokens for p in self.waiting)

    def _take(self) -> list[Pending]:
        """The waiting requests, oldest first, within the token budget (at least one)."""
        batch, tokens = [], 0
        while self.waiting:
            pending = self.waiting[0]
            if pending.future.done():  # its client went away
                self.waiting.popleft()
                continue
            if batch and tokens + pending.tokens > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += pending.tokens
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
        except Exception as exc:  # noqa: BLE001 - each request of the batch answers with it
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

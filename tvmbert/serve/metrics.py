"""The server's counters, gauges and histograms in Prometheus' text format (what TEI's /metrics
gives): requests by route and status (499: the client went away first), requests in flight and
queued, queue time, batch size, tokens per batch, compute time."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GAUGES = {"tvmbert_requests_in_flight": "Requests admitted and not yet answered",
          "tvmbert_queue_requests": "Requests waiting for a batch"}


class Histogram:
    def __init__(self, name: str, help_text: str, bounds: tuple):
        self.name, self.help, self.bounds = name, help_text, bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def lines(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.bounds, "+Inf"), self.counts):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        return [*lines, f"{self.name}_sum {self.total:.6f}", f"{self.name}_count {running}"]


class Metrics:
    """Shared by the event loop and the batch worker: one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> count
        self.gauges = dict.fromkeys(GAUGES, 0)
        self.histograms = {h.name: h for h in (
            Histogram("tvmbert_queue_seconds", "Time a request waited for its batch to start", SECONDS),
            Histogram("tvmbert_compute_seconds", "Time a batch took to run", SECONDS),
            Histogram("tvmbert_batch_size", "Inputs per batch run", SIZES),
            Histogram("tvmbert_batch_tokens", "Tokens per batch run", TOKENS),
        )}

    def count(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[route, status] += 1

    def set_gauge(self, name: str, value: int) -> None:
        with self.lock:
            self.gauges[name] = value

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.histograms[name].observe(value)

    def text(self) -> str:
        with self.lock:
            lines = ["# HELP tvmbert_requests_total Requests answered, by route and status", "# TYPE tvmbert_requests_total counter"]
            lines += [f'tvmbert_requests_total{{route="{route}",status="{status}"}} {n}'
                      for (route, status), n in sorted(self.requests.items())]
            for name, value in self.gauges.items():
                lines += [f"# HELP {name} {GAUGES[name]}", f"# TYPE {name} gauge", f"{name} {value}"]
            for histogram in self.histograms.values():
                lines += histogram.lines()
        return "\n".join(lines) + "\n"

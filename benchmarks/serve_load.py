"""Load on `tvmbert serve` as users put it: an async HTTP client on loopback, one text a request
(real sentences cut to 8-N tokens), at several concurrencies: throughput, p50 and p99; and, for
concurrency 1, the same texts through `tvmbert.load` called directly (what the server adds).

    python benchmarks/serve_load.py PACKAGE [--concurrency 1,8,32,128] [--requests 200] [--url http://127.0.0.1:PORT]

Without --url it starts `tvmbert serve PACKAGE` itself on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

WORDS = ("the quick brown fox jumps over a lazy dog while people in the park watch and talk about "
         "museums paintings centuries rivers mountains trains music science history and the weather").split()


def texts(count: int, most_tokens: int, seed: int = 0) -> list[str]:
    """Texts of 6 to most_tokens - 2 words (8 to most_tokens tokens with [CLS] and [SEP], about)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, max(7, most_tokens - 2))))) for _ in range(count)]


async def post(host: str, port: int, path: str, payload: dict) -> tuple[int, bytes]:
    """One POST on a connection of its own (HTTP/1.1, Connection: close)."""
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(payload).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)
    await writer.drain()
    response = await reader.read()
    writer.close()
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1]


async def load(host: str, port: int, sample: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    statuses: list[int] = []
    queue = list(enumerate(sample))

    async def worker():
        while queue:
            _, text = queue.pop()
            started = time.perf_counter()
            status, _ = await post(host, port, "/embed", {"inputs": text})
            latencies.append((time.perf_counter() - started) * 1e3)
            statuses.append(status)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": len(sample), "ok": statuses.count(200), "per_s": round(len(sample) / seconds, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1), "p99_ms": round(float(np.percentile(latencies, 99)), 1)}


def direct(package: str, sample: list[str]) -> dict:
    """The same texts, one call each, through tvmbert.load in this process."""
    from tvmbert import load as load_package

    model = load_package(package)
    for text in sample[:5]:
        model.encode([text])
    latencies = []
    for text in sample:
        started = time.perf_counter()
        model.encode([text])
        latencies.append((time.perf_counter() - started) * 1e3)
    return {"requests": len(sample), "p50_ms": round(float(np.percentile(latencies, 50)), 1),
            "per_s": round(len(sample) / (sum(latencies) / 1e3), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--url")
    args = parser.parse_args()
    manifest = json.loads((Path(args.package) / "manifest.json").read_text())
    longest = max(b["seq_len"] for v in manifest.get("variants", [manifest]) for b in v["buckets"])
    sample = texts(args.requests, longest)
    server = None
    if args.url:
        url = urlparse(args.url)
        host, port = url.hostname, url.port
    else:
        server = subprocess.Popen([sys.executable, "-m", "tvmbert", "serve", args.package, "--port", "0"], stderr=subprocess.PIPE, text=True)
        host, port = "127.0.0.1", int(re.search(r":(\d+)$", server.stderr.readline().strip()).group(1))
    try:
        rows = [asyncio.run(load(host, port, sample, int(c))) for c in args.concurrency.split(",")]
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    print(json.dumps({"package": args.package, "served": rows, "direct": direct(args.package, sample)}, indent=1))


if __name__ == "__main__":
    main()

"""Load on embedding servers as users put it: an async HTTP client (httpx, keep-alive
connections) on 127.0.0.1, one text a request, texts of real English (the model's README prose)
cut to 8-256 tokens, at several concurrencies: throughput, p50 and p99 per server.
`tvmbert serve PACKAGE` against infinity-emb serving the package's source folder (its torch
engine, and its optimum engine on an ONNX export of it), all started here on free ports at once,
then each level in rounds with the servers in turn (who goes first rotating), so that the
machine's other load falls on all alike; at concurrency 1, the same texts through
`tvmbert.load` called directly in the same rounds, one at a time (what the server adds). Before
timing, each server's vectors for the same texts are compared with tvmbert's (cosine).

    python benchmarks/serve_load.py PACKAGE [--concurrency 1,8,32,128] [--requests 200]
        [--infinity /tmp/infvenv/bin/infinity_emb] [--engines torch,optimum] [--onnx-folder DIR]
        [--ray-replicas 1,2] [--out results.json] [--plot results.png]
    python benchmarks/serve_load.py results.json --from-json --plot results.png

infinity-emb pins transformers 4.x: install it in a virtual environment of its own
(docs/serving.md). Every level is bounded: --requests each (at least 4 x the concurrency), and
--max-seconds of sending per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHORTEST, LONGEST = 8, 256


def corpus(folder: Path) -> list[str]:
    """The words of the model's README prose (code blocks, front matter and markup left out)."""
    text = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    text = re.sub(r"^---.*?^---", " ", text, flags=re.S | re.M)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)|[#*`|<>]", r" \1 ", text)
    words = text.split()
    if len(words) < 200:
        raise SystemExit(f"{folder}/README.md has too little prose to cut texts from")
    return words


def texts(words: list[str], tokenizer, count: int, seed: int = 0) -> list[str]:
    """``count`` texts, each a run of the corpus from a random word, as long as a uniform draw of
    SHORTEST..LONGEST tokens ([CLS] and [SEP] included), cut at a word."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        wanted = int(rng.integers(SHORTEST, LONGEST + 1))
        start = int(rng.integers(0, len(words)))
        run = (words[start:] + words[:start]) * 2
        low, high = 1, min(len(run), wanted)  # the most words whose tokens fit
        while low < high:
            middle = (low + high + 1) // 2
            if len(tokenizer.encode(" ".join(run[:middle])).ids) <= wanted:
                low = middle
            else:
                high = middle - 1
        out.append(" ".join(run[:low]))
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    """A server process on 127.0.0.1 and the route that embeds."""

    def __init__(self, name: str, command: list[str], port: int, route: str, env: dict | None = None, cwd: str | None = None):
        self.name, self.port, self.route = name, port, route
        self.log = open(f"/tmp/serve_load-{name}.log", "w")  # closed in stop()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.process.returncode}); see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not ready after {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def embed(client, served: Served, batch: list[str]) -> np.ndarray:
    response = await client.post(served.route, json={"input": batch, "model": "minilm"})
    response.raise_for_status()
    return np.array([d["embedding"] for d in sorted(response.json()["data"], key=lambda d: d["index"])])


async def level(served: Served, sample: list[str], concurrency: int, max_seconds: float) -> dict:
    """``sample`` sent one text a request by ``concurrency`` workers sharing one client (after a
    warm-up): the latencies of the answered ones, the failures, the seconds it took."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=served.url, limits=limits, timeout=600) as client:
        warm = sample[: min(len(sample), 2 * concurrency, 64)]
        await asyncio.gather(*(client.post(served.route, json={"input": t, "model": "minilm"}) for t in warm))
        latencies, failures, queue = [], [], list(reversed(sample))
        started = time.perf_counter()

        async def worker():
            while queue and time.perf_counter() - started < max_seconds:
                text = queue.pop()
                sent = time.perf_counter()
                try:
                    response = await client.post(served.route, json={"input": text, "model": "minilm"})
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                (latencies if ok else failures).append((time.perf_counter() - sent) * 1e3)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {"latencies": latencies, "failed": len(failures), "seconds": time.perf_counter() - started}


def summary(concurrency: int, runs: list[dict]) -> dict:
    latencies = [ms for run in runs for ms in run["latencies"]]
    return {"concurrency": concurrency, "requests": len(latencies) + sum(r["failed"] for r in runs),
            "failed": sum(r["failed"] for r in runs), "per_s": round(len(latencies) / sum(r["seconds"] for r in runs), 1),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1), "p99_ms": round(float(np.percentile(latencies, 99)), 1)}


async def same_vectors(served: Served, reference: np.ndarray | None, probe: list[str]) -> tuple[np.ndarray, float | None]:
    import httpx

    async with httpx.AsyncClient(base_url=served.url, timeout=600) as client:
        vectors = await embed(client, served, probe)
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors, None if reference is None else round(float((vectors * reference).sum(axis=1).min()), 6)


def direct(model, sample: list[str]) -> dict:
    """The same texts, one call each, through tvmbert.load's model in this process (a level's
    shape, so that ``summary`` takes it)."""
    for text in sample[:8]:
        model.encode([text])
    latencies = []
    for text in sample:
        started = time.perf_counter()
        model.encode([text])
        latencies.append((time.perf_counter() - started) * 1e3)
    return {"latencies": latencies, "failed": 0, "seconds": sum(latencies) / 1e3}


def cpu() -> str:
    fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if ":" in line)
    get = lambda key: fields.get(key, "?").strip()
    return f"{get('Model name')} (family {get('CPU family')} model {get('Model')}), {get('CPU(s)')} CPUs"


def servers(args, source: Path) -> list[tuple[str, list[str], str, dict, str | None]]:
    """(name, command, embeddings route, environment, working folder) of each server to measure,
    in order. infinity's optimum engine runs in the ONNX folder with --model-id . (infinity-emb
    0.0.78 names the ONNX file by the path it found it at, which optimum 2.x matches against bare
    file names: an absolute path is never found), and is told to pool by the mean."""
    ours = [sys.executable, "-m", "tvmbert", "serve", str(Path(args.package).resolve()), "--port", "{port}"]
    found = [("tvmbert", ours, "/v1/embeddings", {}, None)]
    for replicas in [int(n) for n in args.ray_replicas.split(",")] if args.ray_replicas else ():
        # Each on a local Ray cluster of its own, its replicas sharing this machine's cores.
        cpus = max(1, (os.cpu_count() or 1) // replicas)
        found.append((f"tvmbert-ray-{replicas}", [*ours, "--ray", "--replicas", str(replicas), "--replica-cpus", str(cpus)],
                      "/v1/embeddings", {}, None))
    quiet = {"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    for engine in args.engines.split(",") if args.infinity else ():
        if engine == "optimum" and not args.onnx_folder:
            raise SystemExit("infinity's optimum engine needs --onnx-folder (optimum-cli export onnx --model FOLDER OUT)")
        # Its optimum engine pools the first token unless told (cosine 0.38 to the model's own vectors).
        folder, cwd, pooling = (".", args.onnx_folder, ["--pooling-method", "mean"]) if engine == "optimum" else (str(source), None, [])
        found.append((f"infinity-{engine}", [args.infinity, "v2", "--model-id", folder, "--engine", engine, "--device", "cpu",
                                             "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "minilm", *pooling],
                      "/embeddings", quiet, cwd))
    return found


def plot(results: dict, path: str) -> None:
    """Throughput against p99 per server, a point per concurrency (labelled): up and to the left
    is better. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, server in results["servers"].items():
        levels = server["levels"]
        axes.plot([lv["per_s"] for lv in levels], [lv["p99_ms"] for lv in levels], marker="o", label=name)
        for lv in levels:
            axes.annotate(f"c={lv['concurrency']}", (lv["per_s"], lv["p99_ms"]), textcoords="offset points", xytext=(4, 4),
                          fontsize=7)
    axes.set_yscale("log")
    axes.set_xlabel("requests / s")
    axes.set_ylabel("p99 latency, ms (log)")
    axes.set_title(f"{Path(results['command'].split()[1]).name}: {results['cpu']}", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    temporary = Path(path).with_suffix(".tmp.png")
    figure.savefig(temporary, dpi=120)
    temporary.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--requests", type=int, default=200, help="per level (at least 4 x its concurrency)")
    parser.add_argument("--max-seconds", type=float, default=120, help="of sending, per level and server")
    parser.add_argument("--rounds", type=int, default=2, help="each level's requests split into rounds, the servers in turn")
    parser.add_argument("--infinity", help="infinity_emb's command (its own virtual environment)")
    parser.add_argument("--engines", default="torch,optimum", help="infinity's engines to measure")
    parser.add_argument("--onnx-folder", help="the model folder with an ONNX export, for infinity's optimum engine")
    parser.add_argument("--ray-replicas", help="also `tvmbert serve --ray` with each of these replica counts, e.g. 1,2")
    parser.add_argument("--out", help="write the results here as JSON too")
    parser.add_argument("--plot", help="draw throughput against p99 into this PNG")
    parser.add_argument("--from-json", action="store_true", help="PACKAGE is an earlier run's --out: only draw --plot")
    args = parser.parse_args()
    if args.from_json:
        plot(json.loads(Path(args.package).read_text()), args.plot or "serve_load.png")
        return

    from tokenizers import Tokenizer

    manifest = json.loads((Path(args.package) / "manifest.json").read_text())
    source = Path(manifest["model"]["name"])
    tokenizer = Tokenizer.from_file(str(Path(args.package) / manifest["tokenizer"]))
    tokenizer.no_truncation()
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads every text to 128
    words = corpus(source)
    levels = [int(c) for c in args.concurrency.split(",")]
    sample = texts(words, tokenizer, max(args.requests, 4 * max(levels)))
    tokens = [len(tokenizer.encode(t).ids) for t in sample]
    probe = sample[:4]
    results = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "cpu": cpu(), "date": time.strftime("%Y-%m-%d"),
               "texts": {"count": len(sample), "tokens_min": min(tokens), "tokens_median": int(np.median(tokens)),
                         "tokens_max": max(tokens)}, "servers": {}}
    # Every server up at once (an idle one waits on its socket), then each level in rounds, the
    # servers in turn, who goes first rotating: the machine's other load falls on all alike.
    from tvmbert import load

    model, direct_runs, running = load(args.package), [], []
    try:
        for name, command, route, env, cwd in servers(args, source):
            port = free_port()
            running.append(Served(name, [part.replace("{port}", str(port)) for part in command], port, route, env, cwd))
        reference = None
        for served in running:
            served.wait_ready()
            vectors, cosine = asyncio.run(same_vectors(served, reference, probe))
            reference = vectors if reference is None else reference
            results["servers"][served.name] = {"min_cosine_to_tvmbert": cosine, "levels": []}
        for concurrency in levels:
            count = max(args.requests, 4 * concurrency)
            share = -(-count // args.rounds)
            runs: dict[str, list] = {served.name: [] for served in running}
            load = [round(os.getloadavg()[0], 2)]  # the machine's other work shows here
            for round_index in range(args.rounds):
                order = running[round_index % len(running):] + running[: round_index % len(running)]
                part = sample[round_index * share : (round_index + 1) * share]
                for served in order:
                    runs[served.name].append(asyncio.run(level(served, part, concurrency, args.max_seconds / args.rounds)))
                if concurrency == 1:  # in the same rounds: the same load
                    direct_runs.append(direct(model, part))
            load.append(round(os.getloadavg()[0], 2))
            for served in running:
                row = {**summary(concurrency, runs[served.name]), "load_average": load}
                results["servers"][served.name]["levels"].append(row)
                print(served.name, row, file=sys.stderr, flush=True)
    finally:
        for served in running:
            served.stop()
    if direct_runs:
        results["direct"] = summary(1, direct_runs)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        temporary = Path(args.out).with_suffix(".tmp")
        temporary.write_text(text)
        temporary.replace(args.out)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

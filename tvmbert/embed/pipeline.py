"""`tvmbert embed`: a corpus's texts into vectors, a shard at a time, on this machine.

A shard's texts are tokenized in a thread of their own while TVM embeds the shard before (the
queue between them holds one shard: memory stays at about three shards' texts and tokens,
whatever the corpus's size), sorted by token count so that each run of the package fills its
compiled shapes with little padding, pooled as the package's sentence-transformers layer says
(as ``serve`` pools), put back in corpus order and written (``shards``)."""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from tvmbert.core.errors import InputError, Interrupted
from tvmbert.deploy import sentences
from tvmbert.embed.corpus import Corpus, Fields, Record
from tvmbert.embed.shards import OUTPUT_KEY, Output

FORMAT = 1  # the output's columns: "row" (the record's index), "id" with --id-field, "embedding"


@dataclass(frozen=True)
class Options:
    fields: Fields = Fields()
    precision: str = "float32"  # sentences.PRECISIONS
    dimensions: int | None = None  # a Matryoshka model's first dimensions, renormalized where the model normalizes
    prompt: str | None = None  # put before every text, as sentence-transformers' encode(prompt=...)
    prompt_name: str | None = None  # one of the package's config_sentence_transformers.json prompts
    pooling: str | None = None  # default: the package's, as serve
    normalize: bool | None = None  # default: the package's
    shard_rows: int = 4096  # records a shard: what resuming may redo, and the window texts are sorted in
    max_batch_tokens: int = 16384  # rows x the longest in one call of the package
    truncate: bool = True  # a text over the package's longest input is cut to it, as sentence-transformers cuts; else bad
    skip_bad: bool = False  # a bad row counted and listed in the side file; else it stops the job
    overwrite: bool = False


@dataclass
class Tokenized:
    """A shard's records, with the encodings of those that are texts."""

    shard: int
    records: list[Record]
    encodings: list  # one per good record, in order
    bad: list[dict] = field(default_factory=list)
    truncated: int = 0
    reached: int = 0  # how far into the corpus's size reading got at the shard's end
    begun: int = 0  # and at its start


class Embedder:
    """A package, and what turns a shard's records into its table of vectors."""

    def __init__(self, package, options: Options, id_type: str | None = None, ranges=None):
        from tvmbert.deploy.package import load

        self.options = options
        self.model = load(package)
        if self.model.task != "feature-extraction":
            raise InputError(f"{package}: its model ({self.model.task}) gives no last_hidden_state, so no embeddings: "
                             "export the encoder (--task feature-extraction)")
        packaged_pooling, packaged_normalize = sentences.recorded_pooling(self.model.manifest)
        self.pooling = options.pooling or packaged_pooling
        self.normalize = packaged_normalize if options.normalize is None else options.normalize
        if options.precision not in sentences.PRECISIONS:
            raise InputError(f"--precision must be one of {', '.join(sentences.PRECISIONS)}, got {options.precision!r}")
        self.prompt = self._prompt(package)
        size = sentences.vector_size(self.model)
        sentences.check_dimensions(options.dimensions, size)
        self.dimensions = options.dimensions or size
        self.id_type = id_type
        self.ranges = None if ranges is None else np.asarray(ranges, np.float32)

    def _prompt(self, package) -> str:
        if self.options.prompt is not None and self.options.prompt_name is not None:
            raise InputError("--prompt and --prompt-name are one or the other")
        if self.options.prompt is not None:
            return self.options.prompt
        prompts, default = sentences.recorded_prompts(self.model.manifest)
        name = self.options.prompt_name or default  # as encode applies default_prompt_name
        if name is None:
            return ""
        if name not in prompts:
            raise InputError(f"--prompt-name {name}: {package}'s config_sentence_transformers.json names {', '.join(prompts) or 'none'}")
        return prompts[name]

    def job(self, corpus: Corpus) -> dict:
        """What the output is of: a rerun of another is refused (``shards.Output.begin``)."""
        fields = self.options.fields
        return {"format": FORMAT, "package": self.model.manifest["files"], "corpus": corpus.fingerprint(),
                "text_field": fields.text, "id_field": fields.id, "id_type": self.id_type, "precision": self.options.precision,
                "dimensions": self.dimensions, "prompt": self.prompt, "pooling": self.pooling, "normalize": self.normalize,
                "shard_rows": self.options.shard_rows, "truncate": self.options.truncate}

    def describes(self) -> dict:
        """What every output file's footer says of its vectors."""
        return {"model": self.model.manifest["model"]["name"], "dtype": self.model.manifest.get("dtype"),
                "precision": self.options.precision, "dimensions": self.dimensions, "pooling": self.pooling,
                "normalize": self.normalize, "prompt": self.prompt,
                "ranges": None if self.ranges is None else self.ranges.tolist()}

    # ---- a shard ------------------------------------------------------------------------------

    def tokenize(self, shard: int, records: list[Record], reached: int) -> Tokenized:
        bad = [_bad(r, r.problem) for r in records if r.problem]
        good = [r for r in records if not r.problem]
        encodings = self.model.tokenize([self.prompt + r.text for r in good], truncate=True) if good else []
        truncated = [i for i, e in enumerate(encodings) if e.overflowing]
        if truncated and not self.options.truncate:
            limit = self.model.max_seq_len
            too_long = {i: f"more tokens than the package's longest input ({limit}); without --no-truncate it is cut to them"
                        for i in truncated}
            bad = sorted([*bad, *(_bad(good[i], reason) for i, reason in too_long.items())], key=lambda b: b["row"])
            encodings = [e for i, e in enumerate(encodings) if i not in too_long]
            good = [r for i, r in enumerate(good) if i not in too_long]
        return Tokenized(shard, good, encodings, bad, len(truncated) if self.options.truncate else 0, reached)

    def vectors(self, encodings: list) -> tuple[np.ndarray, int, int]:
        """[texts, dimensions] float32 in the encodings' order; the tokens, and the tokens run
        (padding included). Longest first, in calls of at most ``max_batch_tokens``."""
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        found = np.zeros((len(encodings), self.dimensions), np.float32)
        order = np.argsort(-lengths, kind="stable")
        capacity, start = 0, 0
        while start < len(order):
            rows = max(1, min(len(order) - start, self.options.max_batch_tokens // int(lengths[order[start]])))
            chunk = order[start : start + rows]
            chunk_encodings = [encodings[i] for i in chunk]
            chunk_lengths = [int(lengths[i]) for i in chunk]
            plan = self.model.plan(chunk_lengths)
            capacity += sum(self.model.buckets[b].capacity for b, _ in plan)
            hidden = self.model.run_encodings(chunk_encodings, plan)["last_hidden_state"]
            found[chunk] = sentences.sentence_vectors(hidden, self.pooling, self.normalize, self.options.dimensions)
            start += rows
        return found, int(lengths.sum()), capacity

    def shard(self, tokenized: Tokenized):
        """(the table, its bad rows, its counts). int8 and uint8 take their calibration ranges
        from the first shard's vectors, and keep them for every later one."""
        import pyarrow as pa

        if tokenized.encodings:
            floats, tokens, capacity = self.vectors(tokenized.encodings)
        else:
            floats, tokens, capacity = np.zeros((0, self.dimensions), np.float32), 0, 0
        precision = self.options.precision
        if precision in ("int8", "uint8") and self.ranges is None:
            if len(floats) < 2:  # one vector's least and greatest are itself: every level collapses
                raise InputError(f"{precision} vectors are calibrated on the first shard's, and it has {len(floats)} text: "
                                 "raise --shard-rows")
            self.ranges = sentences.quantization_ranges(floats)
        stored = sentences.quantized(floats, precision, self.ranges)
        width = sentences.stored_size(precision, self.dimensions)
        values = pa.array(stored.reshape(-1), type=pa.from_numpy_dtype(np.dtype(sentences.stored_dtype(precision))))
        columns = {"row": pa.array([r.index for r in tokenized.records], pa.int64())}
        if self.options.fields.id is not None:
            columns["id"] = pa.array([r.id for r in tokenized.records], pa.int64() if self.id_type == "int64" else pa.string())
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(values, width)
        table = pa.table(columns).replace_schema_metadata({OUTPUT_KEY: json.dumps(self.describes()).encode()})
        counts = {"rows_in": len(tokenized.records) + len(tokenized.bad), "rows_out": len(tokenized.records),
                  "bad": len(tokenized.bad), "tokens": tokens, "tokens_run": capacity, "truncated": tokenized.truncated}
        return table, tokenized.bad, counts

    def check_ids(self, tokenized: Tokenized) -> Tokenized:
        """Ids of another type than the corpus's first are bad rows (a column has one type)."""
        if self.id_type is None:
            return tokenized
        wanted = int if self.id_type == "int64" else str
        wrong = [i for i, r in enumerate(tokenized.records) if not isinstance(r.id, wanted) or isinstance(r.id, bool)]
        if not wrong:
            return tokenized
        kind = "an integer" if wanted is int else "a string"
        bad = [_bad(tokenized.records[i], f"the id is not {kind}, as the corpus's first id is") for i in wrong]
        wrong = set(wrong)
        keep = [i for i in range(len(tokenized.records)) if i not in wrong]
        return replace(tokenized, records=[tokenized.records[i] for i in keep], encodings=[tokenized.encodings[i] for i in keep],
                       bad=sorted([*tokenized.bad, *bad], key=lambda b: b["row"]))


def _bad(record: Record, reason: str) -> dict:
    return {"file": record.file, "line": record.line, "row": record.index, "reason": reason}


def check_calibrated(job: dict, done: set[int], precision: str) -> None:
    """int8 and uint8 shards written without their ranges recorded (a job of an older tvmbert)
    cannot be matched by later ones."""
    if precision in ("int8", "uint8") and done and job.get("ranges") is None:
        raise InputError(f"the output's {len(done)} finished shards have no recorded {precision} calibration: --overwrite "
                         "to start again")


def stop_at_bad(tokenized: Tokenized, output: Output) -> None:
    if tokenized.bad:
        first = tokenized.bad[0]
        where = f"{first['file']}:{first['line']}" if not first["file"].endswith(".parquet") else f"{first['file']} row {first['line']}"
        raise InputError(f"{where}: {first['reason']} (--skip-bad counts such rows and lists them in {output.bad_file})")


@dataclass
class Started:
    """A job begun on this output (``start``), the same on one machine and on Ray."""

    corpus: Corpus
    out: Output
    embedder: Embedder
    job: dict  # as recorded in the output, with what it has learnt (int8's ranges)
    done: set[int]  # the shards a killed run finished

    def write(self, tokenized: Tokenized) -> dict:
        """A shard's table made and written (a bad row stops it, unless --skip-bad); its counts.
        int8's calibration, made by the first shard, is recorded before that shard is written: a
        job killed between the two finds it again."""
        options = self.embedder.options
        if not options.skip_bad:
            stop_at_bad(tokenized, self.out)
        had_ranges = self.embedder.ranges is not None
        table, bad, counts = self.embedder.shard(tokenized)
        if self.embedder.ranges is not None and not had_ranges:
            self.job = {**self.job, "ranges": self.embedder.ranges.tolist()}
            self.out.learn(self.job)
        self.out.write(tokenized.shard, table, bad, counts)
        return counts

    def interrupted(self) -> Interrupted:
        return Interrupted(f"interrupted: {len(self.out.done())} shards of {self.embedder.options.shard_rows} rows are kept in "
                           f"{self.out.parts}; the same command resumes from them")


def start(package, source, output, options: Options) -> Started:
    """The corpus, the output checked and the package loaded, the job recorded or resumed."""
    try:
        import pyarrow  # noqa: F401 - said here, before any work: every output is Parquet
    except ImportError:
        raise InputError("tvmbert embed writes Parquet with pyarrow: pip install 'tvmbert[embed]'") from None
    corpus = Corpus(source, options.fields)
    out = Output(output, options.overwrite, source)
    embedder = Embedder(package, options, corpus.id_type())
    job = out.begin(embedder.job(corpus))
    embedder.ranges = None if job.get("ranges") is None else np.asarray(job["ranges"], np.float32)
    done = out.done()
    check_calibrated(job, done, options.precision)
    return Started(corpus, out, embedder, job, done)


# ---- the job -------------------------------------------------------------------------------------


@dataclass
class Tally:
    """This run's progress, for a progress bar: rows and tokens embedded, the time it took, and
    how far through the corpus it is (``fraction``, from where this run began: ``start``)."""

    rows: int = 0
    tokens: int = 0
    bad: int = 0
    seconds: float = 0.0
    fraction: float = 0.0
    start: float = 0.0
    shards: int = 0

    def eta_s(self) -> float | None:
        moved = self.fraction - self.start
        return None if moved <= 0 else self.seconds * (1 - self.fraction) / moved

    def add(self, counts: dict, fraction: float, started: float) -> None:
        """A shard done (its counts), the corpus ``fraction`` done with it, since ``started``."""
        self.rows += int(counts["rows_out"])
        self.tokens += int(counts["tokens"])
        self.bad += int(counts["bad"])
        self.shards += 1
        self.fraction = fraction
        self.seconds = time.perf_counter() - started


SENTINEL = object()


def embed_corpus(package, source, output, options: Options = Options(), progress=None) -> dict:
    """Embeds every text of ``source`` into ``output`` (``shards.Output``), resuming from the
    shards a killed run finished; returns the summary. ``progress(tally)`` after each shard."""
    begun = start(package, source, output, options)
    corpus, out, embedder, done = begun.corpus, begun.out, begun.embedder, begun.done
    size = max(1, corpus.size())
    tally = Tally()
    started = time.perf_counter()
    items: queue.Queue = queue.Queue(maxsize=1)
    stopping = threading.Event()

    def put(item) -> None:
        while not stopping.is_set():
            try:
                items.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def tokenized(shard: int, records: list, begun: int, ended: int) -> Tokenized:
        found = embedder.check_ids(embedder.tokenize(shard, records, ended))
        found.begun = begun
        return found

    def read() -> None:
        try:
            shard, records, begun, ended = 0, [], 0, 0
            for record, reached in corpus.records():
                if stopping.is_set():  # the job failed or was stopped: nothing more to read
                    return
                current = record.index // options.shard_rows
                if current != shard:
                    if shard not in done:
                        put(tokenized(shard, records, begun, ended))
                    shard, records, begun = current, [], ended
                if current not in done:
                    records.append(record)
                ended = reached
            if shard not in done:  # the last shard; an empty corpus's one empty shard
                put(tokenized(shard, records, begun, size))
            put(SENTINEL)
        except BaseException as exc:  # the main thread raises it
            put(exc)

    reader = threading.Thread(target=read, name="tokenize", daemon=True)
    reader.start()
    shards = max(done, default=-1) + 1
    try:
        while (item := items.get()) is not SENTINEL:
            if isinstance(item, BaseException):
                raise item
            counts = begun.write(item)
            shards = max(shards, item.shard + 1)
            if not tally.shards:
                tally.start = item.begun / size
            tally.add(counts, item.reached / size, started)
            if progress:
                progress(tally)
    except KeyboardInterrupt:
        raise begun.interrupted() from None
    finally:
        stopping.set()
    summary = _summary(out, shards, tally, time.perf_counter() - started, embedder)
    out.finish(shards, summary)
    return summary


def _summary(out: Output, shards: int, tally: Tally, seconds: float, embedder: Embedder) -> dict:
    """The whole output's counts (shards of an earlier, killed run included) and this run's speed."""
    totals = {"rows_in": 0, "rows_out": 0, "bad": 0, "tokens": 0, "tokens_run": 0, "truncated": 0}
    for shard in range(shards):
        for key, value in out.counts(shard).items():
            totals[key] = totals.get(key, 0) + value
    return {"output": str(out.path), "bad_rows_file": str(out.bad_file) if totals["bad"] else None,
            "texts": totals["rows_out"], "rows_in": totals["rows_in"], "rows_out": totals["rows_out"], "bad": totals["bad"],
            "tokens": totals["tokens"], "truncated": totals["truncated"],
            "padding": 0.0 if not totals["tokens_run"] else round(1 - totals["tokens"] / totals["tokens_run"], 4),
            "shards": shards, "resumed_shards": shards - tally.shards, "seconds": round(seconds, 3),
            "texts_per_s": round(tally.rows / seconds, 1) if seconds else None,
            "tokens_per_s": round(tally.tokens / seconds, 1) if seconds else None,
            **embedder.describes(), "max_rss_mb": _max_rss_mb()}


def _max_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

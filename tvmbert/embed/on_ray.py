"""`tvmbert embed --ray`: the same shards as on one machine, embedded by Ray Data actors.

The driver reads the corpus once for where each shard starts (``Corpus.positions``), then Ray
Data maps the shards still to do over ``concurrency`` actors, each loading the package once
(``num_cpus`` each, and as many TVM threads). An actor reads its shard from the corpus itself
and writes it as the single-machine job does (atomically, into the output's parts): the output
is the same, row for row, and a killed cluster job resumes from its finished shards as a local
one does. Ray's own ``write_parquet`` is not used: its files are named per run, written in
place, and cannot be resumed from.

On a cluster the package, the corpus and the output must be at the same path on every node
(shared storage), or the package shipped in a runtime_env (docs/embed.md)."""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np

from tvmbert.core.errors import InputError, Interrupted, first_line
from tvmbert.embed.corpus import Corpus, Position
from tvmbert.embed.pipeline import Embedder, Options, Tally, _summary, check_calibrated, stop_at_bad
from tvmbert.embed.shards import Output


class ShardEmbedder:
    """A Ray Data actor: the package loaded once; each batch names shards to read, embed and write."""

    def __init__(self, package: str, source: str, shown: str, output: str, options: Options, id_type, ranges):
        self.corpus = Corpus(source, options.fields, shown)
        self.out = Output.resumed(output)
        self.embedder = Embedder(package, options, id_type, ranges)
        self.options = options

    def __call__(self, batch: dict) -> dict:
        counts = []
        for shard, file, offset, line, index in zip(batch["shard"], batch["file"], batch["offset"], batch["line"], batch["index"]):
            counts.append(embed_shard(self.embedder, self.corpus, self.out, int(shard),
                                      Position(int(file), int(offset), int(line), int(index)), self.options))
        return {key: np.array([c[key] for c in counts]) for key in counts[0]}


def embed_shard(embedder: Embedder, corpus: Corpus, out: Output, shard: int, start: Position, options: Options,
                before_write=None) -> dict:
    """One shard read from ``start``, embedded and written (``before_write()`` called between:
    int8's calibration recorded before the shard that made it); its counts and number."""
    records = [record for record, _ in corpus.records(start, options.shard_rows)]
    tokenized = embedder.check_ids(embedder.tokenize(shard, records, 0))
    if not options.skip_bad:
        stop_at_bad(tokenized, out)
    table, bad, counts = embedder.shard(tokenized)
    if before_write is not None:
        before_write()
    out.write(shard, table, bad, counts)
    return {**counts, "shard": shard}


def embed_on_ray(package, source, output, options: Options, address: str | None, actors: int, actor_cpus: float,
                 progress=None) -> dict:
    """``pipeline.embed_corpus`` on Ray Data (a running cluster at ``address``, else a local one)."""
    import ray

    corpus = Corpus(source, options.fields)
    out = Output(output, options.overwrite, source)
    embedder = Embedder(package, options, corpus.id_type())
    job = out.begin(embedder.job(corpus))
    embedder.ranges = None if job.get("ranges") is None else np.asarray(job["ranges"], np.float32)
    starts = corpus.positions(options.shard_rows) or [Position(0, 0, 1, 0)]  # an empty corpus: one empty shard
    done = out.done()
    check_calibrated(job, done, options.precision)
    todo = [k for k in range(len(starts)) if k not in done]
    # Progress in shards: the actors finish them out of order, so how far into the corpus's bytes
    # the last one ends says nothing of how much is done.
    tally, started = Tally(start=1 - len(todo) / len(starts), fraction=1 - len(todo) / len(starts)), time.perf_counter()

    def count(counts: dict) -> None:
        tally.rows += int(counts["rows_out"])
        tally.tokens += int(counts["tokens"])
        tally.bad += int(counts["bad"])
        tally.shards += 1
        tally.fraction += 1 / len(starts)
        tally.seconds = time.perf_counter() - started
        if progress:
            progress(tally)

    try:
        if embedder.ranges is None and options.precision in ("int8", "uint8") and 0 in todo:
            # int8's calibration comes from the first shard: it is done here, before the actors start.
            count(embed_shard(embedder, corpus, out, 0, starts[0], options,
                              before_write=lambda: out.learn({**job, "ranges": embedder.ranges.tolist()})))
            todo.remove(0)
        if todo:
            started_here = _ray_started(ray, address)
            items = [{"shard": k, "file": starts[k].file, "offset": starts[k].offset, "line": starts[k].line,
                      "index": starts[k].index} for k in todo]
            dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
                ShardEmbedder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=actor_cpus,
                fn_constructor_kwargs={"package": os.path.abspath(package), "source": os.path.abspath(source),
                                       "shown": str(source), "output": os.path.abspath(output), "options": options, "id_type": embedder.id_type,
                                       "ranges": embedder.ranges},
                runtime_env={"env_vars": {"TVM_NUM_THREADS": str(max(1, int(actor_cpus)))}})
            try:
                for row in dataset.iter_rows():
                    count(row)
            except InputError as exc:  # a bad row an actor found (raised as itself: _ray_started): one line, as on one machine
                raise InputError(first_line(getattr(exc, "cause", None) or exc)) from None
            finally:
                if started_here:
                    ray.shutdown()
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: {len(out.done())} shards of {options.shard_rows} rows are kept in {out.parts}; the same "
                          "command resumes from them") from None
    summary = _summary(out, len(starts), tally, time.perf_counter() - started, embedder)
    out.finish(len(starts), summary)
    return {**summary, "ray": {"actors": actors, "actor_cpus": actor_cpus, "address": address or "local"}}


def _ray_started(ray, address: str | None) -> bool:
    """Connected to the cluster at ``address`` (None: a local one, started here); whether this
    call connected (and so disconnects at the end)."""
    if ray.is_initialized():
        return False
    ours = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="warning")
    except ConnectionError as exc:
        raise InputError(f"--ray {address}: no Ray cluster there ({exc})") from None
    finally:
        signal.signal(signal.SIGTERM, ours)  # Ray's exits at once; the command's keeps the finished shards and says so
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the command's own progress says it
    context.print_on_execution_start = False
    context.raise_original_map_exception = True  # a bad row's InputError as itself, not wrapped in Ray's own
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)  # its account of a failed shard: the command says it in one line
    return True

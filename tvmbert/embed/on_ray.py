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

from tvmbert.core.errors import InputError, first_line
from tvmbert.embed.corpus import Corpus, Position
from tvmbert.embed.pipeline import Embedder, Options, Started, Tally, _summary, start
from tvmbert.embed.shards import Output


class ShardEmbedder:
    """A Ray Data actor: the package loaded once; each batch names shards to read, embed and write."""

    def __init__(self, package: str, source: str, shown: str, output: str, options: Options, id_type, ranges):
        # The driver began the job and found int8's ranges: an actor only writes shards of it.
        self.started = Started(Corpus(source, options.fields, shown), Output.resumed(output),
                               Embedder(package, options, id_type, ranges), {}, set())

    def __call__(self, batch: dict) -> dict:
        counts = []
        for shard, file, offset, line, index in zip(batch["shard"], batch["file"], batch["offset"], batch["line"], batch["index"]):
            counts.append(embed_shard(self.started, int(shard), Position(int(file), int(offset), int(line), int(index))))
        return {key: np.array([c[key] for c in counts]) for key in counts[0]}


def embed_shard(started: Started, shard: int, at: Position) -> dict:
    """One shard read from ``at``, embedded and written (``Started.write``); its counts and number."""
    embedder = started.embedder
    records = [record for record, _ in started.corpus.records(at, embedder.options.shard_rows)]
    return {**started.write(embedder.check_ids(embedder.tokenize(shard, records, 0))), "shard": shard}


def embed_on_ray(package, source, output, options: Options, address: str | None, actors: int, actor_cpus: float,
                 progress=None) -> dict:
    """``pipeline.embed_corpus`` on Ray Data (a running cluster at ``address``, else a local one)."""
    import ray

    begun = start(package, source, output, options)
    corpus, out, embedder = begun.corpus, begun.out, begun.embedder
    starts = corpus.positions(options.shard_rows) or [Position(0, 0, 1, 0)]  # an empty corpus: one empty shard
    todo = [k for k in range(len(starts)) if k not in begun.done]
    # Progress in shards: the actors finish them out of order, so how far into the corpus's bytes
    # the last one ends says nothing of how much is done.
    tally, started = Tally(start=1 - len(todo) / len(starts), fraction=1 - len(todo) / len(starts)), time.perf_counter()

    def count(counts: dict) -> None:
        tally.add(counts, tally.fraction + 1 / len(starts), started)
        if progress:
            progress(tally)

    try:
        if embedder.ranges is None and options.precision in ("int8", "uint8") and 0 in todo:
            # int8's calibration comes from the first shard: it is done here, before the actors start.
            count(embed_shard(begun, 0, starts[0]))
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
        raise begun.interrupted() from None
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

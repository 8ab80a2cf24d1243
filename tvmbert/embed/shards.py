"""The job's output in shards: shard k holds the vectors of the corpus's records k*S to (k+1)*S,
each written atomically (a temporary file, fsync, rename) with its bad rows beside it, so that a
job killed at any instant keeps every finished shard and the same command resumes from them.

``-o OUT.parquet`` is one file: the shards live in ``OUT.parquet.parts/`` until the last is done,
then are merged into OUT.parquet (atomically too) and removed. Any other ``-o`` is a folder: the
shards are the output, a Parquet dataset (``part-00000.parquet``, ...) that pyarrow, pandas, Spark
and Ray read as one table, with ``_SUCCESS.json`` (the summary) once complete. The job's
description (``_job.json``) is written first: a rerun with another package, corpus or option is
refused rather than mixing vectors of two jobs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tvmbert.core import artifacts
from tvmbert.core.errors import InputError

JOB_FILE = "_job.json"
DONE_FILE = "_SUCCESS.json"
SHARD_KEY = b"tvmbert.shard"  # a shard's counts, in its Parquet footer
OUTPUT_KEY = b"tvmbert.embed"  # what the vectors are (model, precision, ranges), in every file's footer
LEARNT = ("ranges",)  # what a job adds to its record as it runs


class Output:
    def __init__(self, path: str | Path, overwrite: bool, source: str | Path):
        """The output at ``path`` checked for a new or resumed job of the corpus at ``source``
        (``overwrite``: what a job wrote there is removed, by ``begin``, once the job is known good)."""
        self._at(path)
        self.overwrite = overwrite
        artifacts.check_writable_folder(self.path.parent, "-o")
        output, corpus = self.path.resolve(), Path(source).resolve()
        if output == corpus or corpus in output.parents or output in corpus.parents:
            raise InputError(f"-o {self.path} and the corpus {source} overlap: write the vectors elsewhere")
        if self.one_file and self.path.is_dir():
            raise InputError(f"-o {self.path} is a folder: a .parquet output is one file (name a folder without the suffix "
                             "for a folder of shards)")
        if not self.one_file and self.path.is_file():
            raise InputError(f"-o {self.path} is a file: name a .parquet file, or a folder for the shards")
        if not self.one_file and self.path.is_dir() and any(self.path.iterdir()) and not (self.path / JOB_FILE).is_file():
            raise InputError(f"-o {self.path} is a folder of other files (no {JOB_FILE}: not a job's output): name an empty "
                             "or new folder")
        if self.complete() and not overwrite:
            raise InputError(f"{self.path} is already complete; --overwrite to embed again")

    def _at(self, path: str | Path) -> None:
        self.path = Path(path)
        self.one_file = self.path.suffix.lower() == ".parquet"
        self.parts = self.path.with_name(self.path.name + ".parts") if self.one_file else self.path
        self.bad_file = self.path.with_name(self.path.name + ".bad.jsonl")

    @classmethod
    def resumed(cls, path: str | Path) -> Output:
        """The output a driver began (another process's view of it: a Ray actor writes shards only)."""
        output = cls.__new__(cls)
        output._at(path)
        return output

    def complete(self) -> bool:
        return self.path.is_file() if self.one_file else (self.path / DONE_FILE).is_file()

    def _remove(self) -> None:
        if self.one_file:
            self.path.unlink(missing_ok=True)
        if self.parts.is_dir():
            shutil.rmtree(self.parts)
        self.bad_file.unlink(missing_ok=True)

    # ---- the job and where it stands ------------------------------------------------------------

    def begin(self, job: dict) -> dict:
        """The job as recorded (``job``, or the one a killed run recorded, with what it learnt
        since, such as int8's calibration ranges). A different job there is refused."""
        if self.overwrite:
            self._remove()
        recorded = self.job()
        for left in self.parts.glob(".part-*") if self.parts.is_dir() else ():  # a shard a killed run was writing
            left.unlink(missing_ok=True)
        if recorded is None:
            self.parts.mkdir(parents=True, exist_ok=True)
            artifacts.write_json(self.parts / JOB_FILE, job)
            return job
        differing = sorted(key for key in set(job) | set(recorded) if key not in LEARNT and job.get(key) != recorded.get(key))
        if differing:
            raise InputError(f"{self.parts} holds a run of another job ({', '.join(differing)} differ): rerun it as it was to "
                             "resume, or --overwrite to start again")
        return recorded

    def job(self) -> dict | None:
        try:
            return json.loads((self.parts / JOB_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.parts / JOB_FILE} cannot be read ({exc}): --overwrite to start again") from None

    def learn(self, job: dict) -> None:
        artifacts.write_json(self.parts / JOB_FILE, job)

    def shard_path(self, shard: int) -> Path:
        return self.parts / f"part-{shard:05d}.parquet"

    def bad_path(self, shard: int) -> Path:
        return self.parts / f"_bad-{shard:05d}.jsonl"

    def done(self) -> set[int]:
        """The shards finished (a shard's file exists only once whole)."""
        found = set()
        for path in self.parts.glob("part-*.parquet") if self.parts.is_dir() else ():
            stem = path.stem.removeprefix("part-")
            if stem.isdigit():
                found.add(int(stem))
        return found

    # ---- writing ----------------------------------------------------------------------------------

    def write(self, shard: int, table, bad: list[dict], counts: dict) -> None:
        """The shard's bad rows, then its vectors: the vectors' file is what marks it done."""
        artifacts.write_text(self.bad_path(shard), "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in bad))
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), SHARD_KEY: json.dumps(counts).encode()})
        _write_table(self.shard_path(shard), table)

    def counts(self, shard: int) -> dict:
        import pyarrow.parquet as pq

        return json.loads(pq.read_schema(self.shard_path(shard)).metadata[SHARD_KEY])

    def finish(self, shards: int, summary: dict) -> None:
        """Every shard's bad rows into one side file (none: no file), then the output made whole."""
        bad = [self.bad_path(k) for k in range(shards) if self.bad_path(k).is_file()]
        text = "".join(path.read_text() for path in bad)
        if text:
            artifacts.write_text(self.bad_file, text)
        else:
            self.bad_file.unlink(missing_ok=True)
        if self.one_file:
            _merge([self.shard_path(k) for k in range(shards)], self.path)
            shutil.rmtree(self.parts)
        else:  # done first: a run killed before the shards' lists go rebuilds the side file from them
            artifacts.write_json(self.path / DONE_FILE, summary)
            for path in bad:
                path.unlink()


def _write_table(path: Path, table) -> None:
    import pyarrow.parquet as pq

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        _renamed(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _renamed(tmp: str, path: Path) -> None:
    """``tmp``'s bytes on disk, then renamed to ``path``, the rename itself on disk (the folder
    synced): after a power cut the shard is there whole or not at all."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _merge(parts: list[Path], path: Path) -> None:
    """The shards' row groups copied in order into one file, a shard in memory at a time (a job
    has one shard at least: an empty corpus's is empty), under the footer that says what its
    vectors are, without a shard's counts."""
    import pyarrow.parquet as pq

    first = pq.read_schema(parts[0])
    schema = first.remove_metadata().with_metadata({OUTPUT_KEY: first.metadata[OUTPUT_KEY]})
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for part in parts:
                writer.write_table(pq.read_table(part).replace_schema_metadata(schema.metadata))
        _renamed(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""A corpus's texts, read as a stream: one record at a time from JSONL, CSV/TSV, Parquet or
text files (one text a line), or a folder of them in name order. Every record keeps its place
(its index over the whole corpus, its file and line), so that a bad one is named where it is,
and a shard of records can be read again from where it starts (``Position``) on another machine."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tvmbert.core.errors import InputError

# The suffix says the format; a folder's files of other suffixes are not read (and are listed in
# the error when it has none of these).
SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".txt")
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as Excel and Notepad start a file: not part of its first line
INT64 = (-(2**63), 2**63 - 1)  # the ids a Parquet int64 column holds
CSV_FIELD_BYTES = 2**30  # the csv module's default, 128 KiB, refuses a long document in one field


@dataclass(frozen=True)
class Fields:
    text: str = "text"  # JSONL's key, CSV's column, Parquet's column; a .txt line is the text
    id: str | None = None  # the same for each record's id; None: the record's index is its id


@dataclass(frozen=True)
class Record:
    """One row of the corpus: its text, or why it has none (``problem``: a bad row)."""

    index: int  # over the whole corpus, in reading order, bad rows counted
    file: str
    line: int  # 1-based: a text file's line, a Parquet file's row
    text: str | None
    id: int | str | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Position:
    """Where a record starts: its file (an index into the corpus's files), the byte offset in it
    (a Parquet file's row), its line, and its index over the corpus."""

    file: int
    offset: int
    line: int
    index: int


class Corpus:
    """The files of ``source`` (a file, or a folder's files of the known suffixes in name order),
    read for ``fields``; a bad row names its file from ``shown`` (the path as the user gave it:
    a Ray actor reads the absolute one)."""

    def __init__(self, source: str | Path, fields: Fields, shown: str | Path | None = None):
        self.source = Path(source)
        self.shown = Path(shown) if shown is not None else self.source
        self.fields = fields
        if self.source.is_dir():
            self.files = sorted(p for p in self.source.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                                and not any(part.startswith((".", "_")) for part in p.relative_to(self.source).parts))
            if not self.files:
                raise InputError(f"{self.source} holds no {', '.join(SUFFIXES)} file")
        elif self.source.is_file():
            if self.source.suffix.lower() not in SUFFIXES:
                raise InputError(f"{self.source}: a corpus file is {', '.join(SUFFIXES)} (the suffix says which)")
            self.files = [self.source]
        else:
            raise InputError(f"{self.source}: no such file or folder")
        self.readers = [READERS[path.suffix.lower()](path, self._name(path), fields) for path in self.files]

    def _name(self, path: Path) -> str:
        return str(self.shown if path == self.source else self.shown / path.relative_to(self.source))

    def fingerprint(self) -> dict:
        """What identifies these files' contents without reading them: names, sizes, times."""
        stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        return {"files": len(stats), "sha256": hashlib.sha256(json.dumps(stats).encode()).hexdigest()}

    def size(self) -> int:
        """Bytes (text files) and rows (Parquet) in all: what progress is a fraction of."""
        return sum(reader.size() for reader in self.readers)

    def records(self, start: Position | None = None, count: int | None = None) -> Iterator[tuple[Record, int]]:
        """(record, how far into ``size()`` reading it has come), from ``start`` (the first
        record) on, at most ``count`` of them."""
        start = start or Position(0, 0, 1, 0)
        done_before = sum(reader.size() for reader in self.readers[: start.file])
        index, left = start.index, count
        for number in range(start.file, len(self.readers)):
            reader = self.readers[number]
            first = start if number == start.file else Position(number, 0, 1, index)
            for record, at in reader.records(first.offset, first.line, index):
                if left is not None and left <= 0:
                    return
                yield record, done_before + at
                index += 1
                if left is not None:
                    left -= 1
            done_before += reader.size()

    def positions(self, every: int) -> list[Position]:
        """Where each run of ``every`` records starts (the corpus read once, its texts not kept):
        where another process starts reading a shard."""
        found = []
        index = 0
        for number, reader in enumerate(self.readers):
            for offset, line in reader.starts():
                if index % every == 0:
                    found.append(Position(number, offset, line, index))
                index += 1
        return found

    def id_type(self) -> str | None:
        """The type of the corpus's ids, "int64" or "string", from the first record that has one
        (every later id must be of it); None without an id field."""
        if self.fields.id is None:
            return None
        for reader in self.readers:
            found = reader.id_type()
            if found:
                return found
        return "string"


def _text_problem(text) -> str | None:
    if text is None:
        return "no text (null)"
    if not isinstance(text, str):
        return f"the text is {_what(text)}, not a string"
    if not text.strip():
        return "an empty text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not Unicode text (a lone surrogate at character {exc.start})"
    return None


def _what(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _id_problem(value, field: str) -> str | None:
    if value is None:
        return f"no id ('{field}')"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"the id '{field}' is {_what(value)}, not a string or an integer"
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        return f"the id '{field}' is an integer past 64 bits"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"the id '{field}' is not Unicode text (a lone surrogate at character {exc.start})"
    return None


def _decoded(line: bytes) -> tuple[str | None, str | None]:
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte 0x{line[exc.start]:02x} at byte {exc.start + 1} of the line)"


class _Lines:
    """A text file read a line at a time from a byte offset: (line without its end, offset after it)."""

    def __init__(self, path: Path, name: str, fields: Fields):
        self.path, self.name, self.fields = path, name, fields

    def size(self) -> int:
        return self.path.stat().st_size

    def lines(self, offset: int) -> Iterator[tuple[bytes, int]]:
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            for raw in handle:
                start, offset = offset, offset + len(raw)
                line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw
                yield line[len(BOM):] if start == 0 and line.startswith(BOM) else line, offset

    def starts(self) -> Iterator[tuple[int, int]]:
        """(offset, line) of each record."""
        offset = 0
        for line, (_, end) in enumerate(self.lines(0), 1):
            yield offset, line
            offset = end

    def id_type(self) -> str | None:
        return None


class TextLines(_Lines):
    """.txt: every line one text (an empty line is a bad row: a file of paragraphs is not read as one)."""

    def records(self, offset: int, line: int, index: int) -> Iterator[tuple[Record, int]]:
        for number, (raw, end) in enumerate(self.lines(offset), line):
            text, problem = _decoded(raw)
            problem = problem or _text_problem(text)
            yield Record(index, self.name, number, None if problem else text, index, problem), end
            index += 1


class JsonLines(_Lines):
    """.jsonl: one JSON object a line, its ``fields.text`` the text."""

    def _parsed(self, raw: bytes) -> tuple[dict | None, str | None]:
        text, problem = _decoded(raw)
        if problem:
            return None, problem
        if not text.strip():
            return None, "an empty line (not a JSON object)"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"not JSON ({exc.msg} at column {exc.colno})"
        except (ValueError, RecursionError) as exc:  # a number past Python's digit limit; nesting past its stack
            return None, f"not JSON this reader takes ({type(exc).__name__}: {str(exc)[:80]})"
        if not isinstance(value, dict):
            return None, f"{_what(value)}, not a JSON object"
        return value, None

    def records(self, offset: int, line: int, index: int) -> Iterator[tuple[Record, int]]:
        text_field, id_field = self.fields.text, self.fields.id
        for number, (raw, end) in enumerate(self.lines(offset), line):
            value, problem = self._parsed(raw)
            text = key = None
            if value is not None:
                if text_field not in value:
                    problem = f"no field '{text_field}'"
                else:
                    text = value[text_field]
                    problem = _text_problem(text)
                if id_field is not None and not problem:
                    key = value.get(id_field)
                    problem = _id_problem(key, id_field)
            yield Record(index, self.name, number, None if problem else text, index if id_field is None else key, problem), end
            index += 1

    def id_type(self) -> str | None:
        for raw, _ in self.lines(0):
            value, _problem = self._parsed(raw)
            key = value.get(self.fields.id) if value else None
            if _id_problem(key, self.fields.id or "") is None:
                return "int64" if isinstance(key, int) else "string"
        return None


class Delimited(_Lines):
    """.csv: a header row naming the columns, then one record a row, a quoted field spanning
    lines where it holds them (strictly: a quote left open is an error, never the rest of the
    file read as one text). .tsv: the same with tabs, and no quoting (tab-separated corpora
    such as MS MARCO's quote nothing: a text's quotes are its own). A blank line is no record."""

    def __init__(self, path: Path, name: str, fields: Fields):
        super().__init__(path, name, fields)
        tabs = path.suffix.lower() == ".tsv"
        self.dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tabs else {"delimiter": ",", "strict": True}
        with open(path, "rb") as handle:
            first = handle.readline()
        self.header_end = len(first)
        header, problem = _decoded(first.rstrip(b"\r\n").removeprefix(BOM))
        if problem:
            raise InputError(f"{name}:1: the header row is {problem}")
        self.columns = next(csv.reader([header], **self.dialect), [])
        for field in filter(None, (fields.text, fields.id)):
            if field not in self.columns:
                raise InputError(f"{name}: no column '{field}' (its header has {', '.join(map(repr, self.columns)) or 'none'}); "
                                 "--text-field and --id-field name them")

    def _rows(self, offset: int, line: int) -> Iterator[tuple[list[str], int, int, str | None]]:
        """(fields, first line, offset after it, a decoding problem) per record; bytes that are
        not UTF-8 are carried through as surrogates and reported, never replaced."""
        offset = max(offset, self.header_end)
        line = max(line, 2)
        consumed = {"offset": offset, "line": line - 1, "bad": None}

        def lines():
            for raw, end in self.lines(offset):
                consumed["offset"], consumed["line"] = end, consumed["line"] + 1
                try:
                    yield raw.decode("utf-8") + "\n"
                except UnicodeDecodeError as exc:
                    consumed["bad"] = consumed["bad"] or f"not UTF-8 (byte 0x{raw[exc.start]:02x} at line {consumed['line']})"
                    yield raw.decode("utf-8", "surrogateescape") + "\n"

        csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_BYTES))
        reader = csv.reader(lines(), **self.dialect)
        first_line = line
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                raise InputError(f"{self.name}:{first_line}: not {self.path.suffix[1:].upper()} ({exc})") from None
            bad, consumed["bad"] = consumed["bad"], None
            if fields or bad:
                yield fields, first_line, consumed["offset"], bad
            first_line = consumed["line"] + 1

    def records(self, offset: int, line: int, index: int) -> Iterator[tuple[Record, int]]:
        text_at = self.columns.index(self.fields.text)
        id_at = self.columns.index(self.fields.id) if self.fields.id else None
        for fields, number, end, problem in self._rows(offset, line):
            text = key = None
            if not problem and len(fields) != len(self.columns):
                problem = f"{len(fields)} fields where the header has {len(self.columns)}"
            if not problem:
                text = fields[text_at]
                problem = _text_problem(text)
            if id_at is not None and not problem:
                key = fields[id_at]
                problem = None if key else f"no id ('{self.fields.id}' is empty)"
            yield Record(index, self.name, number, None if problem else text, index if id_at is None else key, problem), end
            index += 1

    def starts(self) -> Iterator[tuple[int, int]]:
        offset = self.header_end
        for _, number, end, _ in self._rows(self.header_end, 2):
            yield offset, number
            offset = end

    def id_type(self) -> str | None:
        return "string"


class ParquetRows:
    """.parquet: the text column (and the id column) read a row batch at a time."""

    BATCH_ROWS = 4096

    def __init__(self, path: Path, name: str, fields: Fields):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path, self.name, self.fields = path, name, fields
        try:  # the footer only: a folder of a thousand part files holds no file open
            self.metadata = pq.read_metadata(path)
            schema = self.metadata.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{name}: not a Parquet file ({exc})") from None
        for field in filter(None, (fields.text, fields.id)):
            if field not in schema.names:
                raise InputError(f"{name}: no column '{field}' (it has {', '.join(map(repr, schema.names))}); "
                                 "--text-field and --id-field name them")
        text_type = schema.field(fields.text).type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
            raise InputError(f"{name}: column '{fields.text}' holds {text_type}, not strings")
        self._id_type = None
        if fields.id:
            kind = schema.field(fields.id).type
            if pa.types.is_integer(kind):
                self._id_type = "int64"
            elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
                self._id_type = "string"
            else:
                raise InputError(f"{name}: id column '{fields.id}' holds {kind}, not integers or strings")

    def size(self) -> int:
        return self.metadata.num_rows

    def starts(self) -> Iterator[tuple[int, int]]:
        for row in range(self.size()):
            yield row, row + 1

    def id_type(self) -> str | None:
        return self._id_type

    def records(self, offset: int, line: int, index: int) -> Iterator[tuple[Record, int]]:
        columns = [c for c in (self.fields.text, self.fields.id) if c]
        groups, first, ends = [], 0, 0  # the row groups from the one holding row ``offset`` on; the row they start at
        for group in range(self.metadata.num_row_groups):
            starts, ends = ends, ends + self.metadata.row_group(group).num_rows
            if ends > offset:
                groups.append(group)
                first = starts if len(groups) == 1 else first
        if not groups:
            return
        import pyarrow.parquet as pq

        # A file of its own, opened here: a reading left unfinished (a shard read to its end)
        # leaves a ParquetFile's reader where it stopped, and the next would start there.
        with pq.ParquetFile(self.path) as file:
            yield from self._rows(file.iter_batches(self.BATCH_ROWS, row_groups=groups, columns=columns), first, offset, index)

    def _rows(self, batches, row: int, offset: int, index: int) -> Iterator[tuple[Record, int]]:
        for batch in batches:
            texts = batch.column(self.fields.text).to_pylist()
            keys = batch.column(self.fields.id).to_pylist() if self.fields.id else [None] * len(texts)
            for text, key in zip(texts, keys):
                if row >= offset:
                    problem = _text_problem(text) or (_id_problem(key, self.fields.id) if self.fields.id else None)
                    yield Record(index, self.name, row + 1, None if problem else text, index if self.fields.id is None else key,
                                 problem), row + 1
                    index += 1
                row += 1


READERS = {".jsonl": JsonLines, ".ndjson": JsonLines, ".csv": Delimited, ".tsv": Delimited, ".parquet": ParquetRows,
           ".txt": TextLines}

"""The work directory: one folder per stage and job, written atomically, reused when unchanged.

Layout: ``<workdir>/<model-key>/b<batch>-s<seq>-<dtype>/<stage>/`` for the target-independent
stages (trace, convert, optimize) and ``.../<target-key>/<stage>/`` for the rest. Each folder ends
with ``stage.json``, written last: a folder without it (a crash mid-write) is never trusted.
A stage is written into a hidden sibling named after this machine and process; one left behind
by a process that died (kill -9) is removed by the next write of that stage.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tvmbert.core.errors import InputError, MissingArtifactError

STAGE_FILE = "stage.json"
FORMAT_VERSION = 1  # bump when an artifact's files change meaning


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of tvmbert's own source, subpackages too: a changed pass or exporter invalidates what it produced."""
    digest = hashlib.sha256()
    for name, source in package_sources():
        digest.update(name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def package_sources() -> list[tuple[str, Path]]:
    """Every Python file of the tvmbert package, by its path in it (this module is in ``core/``)."""
    root = Path(__file__).resolve().parents[1]
    return [(source.relative_to(root).as_posix(), source) for source in sorted(root.rglob("*.py"))]


def fingerprint(**inputs) -> str:
    """A stable hash of everything that decides a stage's output."""
    blob = json.dumps({"format": FORMAT_VERSION, "code": code_version(), **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Artifact:
    stage: str
    path: Path
    fingerprint: str
    meta: dict
    cached: bool

    def file(self, name: str) -> Path:
        return self.path / name


def artifact_summary(artifact: Artifact) -> dict:
    """An artifact as JSON: its meta, where it is and whether it was reused."""
    meta = {k: v for k, v in artifact.meta.items() if k not in ("fingerprint", "stage")}
    return {"artifact": meta.pop("artifact", str(artifact.path)), "cached": artifact.cached, **meta}


def read(stage: str, path: Path) -> Artifact | None:
    try:
        meta = json.loads((path / STAGE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return Artifact(stage, path, meta.get("fingerprint", ""), meta, cached=True)


def cached(stage: str, path: Path, expected: str) -> Artifact | None:
    artifact = read(stage, path)
    return artifact if artifact is not None and artifact.fingerprint == expected else None


def require(stage: str, path: Path, hint: str) -> Artifact:
    artifact = read(stage, path)
    if artifact is None:
        raise MissingArtifactError(f"no {stage} artifact at {path}: run `{hint}` first (or drop --no-deps)")
    return artifact


DISK_FULL_BYTES = 1 << 20  # less than this free after a failed write: the disk is why it failed


@contextmanager
def writing(stage: str, path: Path, fp: str, meta: dict):
    """Yields a fresh temporary folder; on success it replaces ``path`` whole, never half-written.
    A write that fails for want of disk space (or permission) is one InputError naming the folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
    with scratch_beside(path) as tmp:
        try:
            yield tmp
            write_json(tmp / STAGE_FILE, {"stage": stage, "fingerprint": fp, **meta})
            if path.exists():
                old = path.with_name(f".{path.name}.old-{_owner()}")
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(path)
        except Exception as exc:
            # Checked before the partial folder is removed: a writer that ran out of space may fail
            # with anything (torch's zip writer, a compiler), not only OSError(ENOSPC).
            free = shutil.disk_usage(path.parent).free
            if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < DISK_FULL_BYTES:
                raise InputError(f"no space left on the disk that holds {path.parent} ({free // 1024} KiB free): "
                                 f"the {stage} artifact was not written") from None
            if isinstance(exc, OSError):
                raise InputError(f"cannot write the {stage} artifact into {path.parent}: {exc.strerror or exc}") from None
            raise


@contextmanager
def scratch_beside(path: Path):
    """A fresh hidden folder beside ``path`` to write it in, removed when the block ends. Its name
    says which process on which machine made it, so that the next write of ``path`` removes it
    if that process died first (SIGKILL, a power cut), and leaves a live writer's alone."""
    _remove_orphans(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{_owner()}", dir=path.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _owner() -> str:
    return f"{os.getpid()}@{socket.gethostname()}@"  # '@' is in no host name


def _remove_orphans(path: Path) -> None:
    """Removes the hidden folders of writes of ``path`` whose process, on this machine, is gone;
    another machine's (a shared work directory) are left to it."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:tmp|old)-(?P<pid>\d+)@(?P<host>[^@]*)@")
    host = socket.gethostname()
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*"):
        match = pattern.match(sibling.name)
        if match and match["host"] == host and not _alive(int(match["pid"])):
            shutil.rmtree(sibling, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_json(path: Path, data) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Atomic: a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable_folder(path: Path, option: str) -> None:
    """A folder that exists or can be made there, and written: not a file, nor below one, nor in a
    read-only folder. Checked before the work whose results it keeps."""
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise InputError(f"{option} {path} is not writable: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise InputError(f"{option} {path} is not writable: this user may not write in {folder}")
            return


def check_output_file(path: Path, option: str) -> None:
    """An output file that can be written, checked before the work whose results it keeps (click
    itself refuses a folder)."""
    check_writable_folder(path.parent, option)

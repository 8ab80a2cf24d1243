"""Real English sentences with no download: the prose of the standard library's docstrings,
which every Python ships. What verify measures a model's accuracy on when it has a tokenizer."""

from __future__ import annotations

import importlib
import inspect
import re

from tvmbert.core.errors import InputError

# Modules whose docstrings are mostly prose, in a fixed order: the same sentences on every run
# of one Python version.
MODULES = ("argparse", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "concurrent.futures",
           "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
           "enum", "fileinput", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq",
           "hmac", "html.parser", "http.client", "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress",
           "json", "locale", "logging", "logging.handlers", "mailbox", "mimetypes", "multiprocessing.pool", "netrc",
           "numbers", "operator", "optparse", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint",
           "queue", "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
           "socketserver", "sqlite3", "ssl", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
           "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest", "urllib.parse",
           "urllib.request", "uuid", "warnings", "weakref", "webbrowser", "wave", "xml.dom.minidom", "zipfile")
_SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"^[A-Z][A-Za-z ,;:'()-]*[a-z][.!?]$")  # words and punctuation only: no code, paths or markup


def _docstrings(module):
    yield inspect.getdoc(module) or ""
    for _, member in sorted(vars(module).items()):
        if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(member, "__module__", None) == module.__name__:
            yield inspect.getdoc(member) or ""
            if inspect.isclass(member):
                for _, method in sorted(vars(member).items()):
                    if inspect.isfunction(method):
                        yield inspect.getdoc(method) or ""


def reference_sentences(count: int) -> list[str]:
    """``count`` distinct sentences of 6 to 40 words, in a fixed order: the modules taken in
    turn, a sentence of each, so that no one module's topic dominates."""
    per_module, seen = [], set()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without one (sqlite3, ssl): the others suffice
            continue
        sentences = []
        for doc in _docstrings(module):
            for paragraph in doc.split("\n\n"):
                for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                    if _PROSE.match(sentence) and 6 <= len(sentence.split()) <= 40 and sentence not in seen:
                        seen.add(sentence)
                        sentences.append(sentence)
        per_module.append(sentences)
    found = [s for turn in range(max(map(len, per_module), default=0)) for s in (m[turn] for m in per_module if turn < len(m))]
    if len(found) < count:
        raise InputError(f"this Python's docstrings hold {len(found)} sentences, fewer than the {count} asked for")
    return found[:count]

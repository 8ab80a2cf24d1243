"""Where human progress lines go: stderr, so that stdout holds only a command's JSON."""

from __future__ import annotations

import sys


def to_stderr(message: str) -> None:
    print(message, file=sys.stderr)

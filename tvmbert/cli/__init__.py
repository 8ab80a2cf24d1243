"""The `tvmbert` command: the group and the mapping of errors to one line and an exit code; the
commands are in ``commands``, their human output in ``render``. The top layer: may import every
other."""

from __future__ import annotations

import os
import sys

import click

from tvmbert.cli.commands import COMMANDS, INVOCATION
from tvmbert.cli.render import err
from tvmbert.core import targets
from tvmbert.core.errors import TvmbertError
from tvmbert.frontend.models import stay_offline


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tvmbert")
def cli():
    """Compile and tune HuggingFace BERT encoders with Apache TVM."""


for command in COMMANDS:
    cli.add_command(command)


def _one_line(message: str) -> str:
    """Control characters (a user's text or path may hold any) escaped: the error stays one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in message)


def main(argv=None) -> int:
    INVOCATION[:] = sys.argv[1:] if argv is None else list(argv)
    stay_offline()
    targets.use_every_core()
    try:
        cli.main(args=argv, prog_name="tvmbert", standalone_mode=False)
    except click.exceptions.Exit as stop:
        return stop.exit_code
    except click.ClickException as exc:
        err.print(f"error: {_one_line(exc.format_message())}", markup=False)
        return 2
    except click.Abort:
        err.print("interrupted")
        return 130
    except TvmbertError as exc:
        err.print(f"error: {_one_line(str(exc))}", markup=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:  # a bug or a TVM failure we did not anticipate: one line, details on request
        if os.environ.get("TVMBERT_TRACEBACK"):
            raise
        first = (str(exc).strip().splitlines() or [""])[-1]
        err.print(f"error: internal failure ({type(exc).__name__}: {_one_line(first)}); set TVMBERT_TRACEBACK=1 for the traceback",
                  markup=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

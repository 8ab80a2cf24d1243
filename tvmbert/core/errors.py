"""One exception hierarchy: the CLI maps each class to one line and an exit code."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name where it has none: what a
    one-line error quotes of another library's (a bare ``assert`` has no message)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class TvmbertError(Exception):
    """Base of every error tvmbert raises on purpose."""

    exit_code = 2


class InputError(TvmbertError):
    """The user asked for something that cannot be done (bad path, name, value, file)."""

    exit_code = 2


class MissingArtifactError(InputError):
    """A stage ran alone (--no-deps) but the artifact of the stage before it is absent."""


class ToolchainError(TvmbertError):
    """A compiler or device the target needs is not on this machine."""

    exit_code = 2


class CheckFailed(TvmbertError):
    """A check (verify tolerance) ran to the end and did not pass."""

    exit_code = 1


class StageFailed(TvmbertError):
    """A stage failed for a reason that is not the user's input (TVM, PyTorch, exporter)."""

    exit_code = 1


class Interrupted(TvmbertError):
    """The user stopped a long stage (Ctrl-C); what it had finished is kept."""

    exit_code = 130


class PackageError(InputError):
    """An exported package that cannot be served as it is: a file altered or missing, a format
    this version does not read, a device this machine lacks."""

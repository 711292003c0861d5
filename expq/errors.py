"""Errors expq raises: one line each, naming the file, tensor, expert and row where they apply; and user text as
expq prints it (``visible``)."""

from __future__ import annotations

import contextlib
import re

# How messages name the options that change an outcome: as Python parameters (``skip_verify=True``), or, while the
# command line runs (``cli_options``), as its flags (``--skip-verify``). Process-wide, so that worker threads follow.
_CLI = False


def option(name: str, value: object = True) -> str:
    """An option as the caller spells it: ``option("skip_verify")`` is ``skip_verify=True`` in Python and
    ``--skip-verify`` on the command line; ``option("format", "experts-int8")`` is ``format='experts-int8'`` or
    ``--format experts-int8``. Messages call it when they are made (see ``cli_options``).

    Example:
        >>> option("skip_verify"), option("format", "auto")
        ('skip_verify=True', "format='auto'")
    """
    if not _CLI:
        return f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


@contextlib.contextmanager
def cli_options():
    """While inside, ``option`` spells options as command-line flags (the CLI wraps each command in it)."""
    global _CLI
    before, _CLI = _CLI, True
    try:
        yield
    finally:
        _CLI = before


def scrub_tokens(text: str, *tokens: str | None) -> str:
    """``text`` with each of ``tokens`` (None and empty ones skipped) replaced by ``***``: a message that quotes a
    server's answer or a URL never shows a token.

    Example:
        >>> scrub_tokens("401 for hf_abc at /api", "hf_abc", None)
        '401 for *** at /api'
    """
    for t in tokens:
        if t:
            text = text.replace(t, "***")
    return text


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_OR_LINE_BREAK = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def visible(text: str, *, one_line: bool = False) -> str:
    r"""User text (a path, a tensor name, a config value) as expq prints it: literal (``[red]`` stays ``[red]``),
    except control characters, which are shown escaped (``\x1b``) and never reach a terminal or a log; with
    ``one_line`` (a log line, where a newline in a path would forge the next line), tabs and line breaks too.

    Example:
        >>> visible("out/\x1b[31m[usb]")
        'out/\\x1b[31m[usb]'
        >>> visible("a\nb\tc"), visible("a\nb\tc", one_line=True)
        ('a\nb\tc', 'a\\nb\\tc')
    """
    pattern = _CONTROL_OR_LINE_BREAK if one_line else _CONTROL
    return pattern.sub(lambda m: ascii(m.group())[1:-1], text)


class ExpqError(Exception):
    """A user-facing error. ``str(err)`` is one line that names where the problem is, its user text (a path, a
    tensor name from a checkpoint) shown as expq prints it (``visible``, one line): whoever prints it (the command
    line, vLLM's log of the plugin's error, a Ray driver) prints no control character and no forged line.

    Attributes ``file``, ``tensor``, ``expert`` and ``row`` hold the location (``None`` where it does not apply),
    so that callers can act on them without parsing the message.
    """

    exit_code = 1
    resumable = False
    """Whether the same command resumes after this error (see ``resumable``)."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 expert: int | None = None, row: int | None = None, hint: str | None = None):
        self.message = message
        self.file = file
        self.tensor = tensor
        self.expert = expert
        self.row = row
        self.hint = hint
        super().__init__(self._line())

    def __reduce__(self):
        """Picklable with its location (a Ray task raises it in one process and the driver reads it in another)."""
        return _rebuild, (type(self), dict(self.__dict__))

    def _line(self) -> str:
        where = []
        if self.file is not None:
            where.append(f"file {self.file}")
        if self.tensor is not None:
            where.append(f"tensor {self.tensor}")
        if self.expert is not None:
            where.append(f"expert {self.expert}")
        if self.row is not None:
            where.append(f"row {self.row}")
        line = f"{', '.join(where)}: {self.message}" if where else self.message
        if self.hint:
            line += f" ({self.hint})"
        return visible(line, one_line=True)


def _rebuild(cls: type, state: dict) -> ExpqError:
    err = cls.__new__(cls)
    err.__dict__.update(state)
    Exception.__init__(err, err._line())
    return err


class UsageError(ExpqError):
    """Bad arguments or an output location that cannot be used (exit status 2)."""

    exit_code = 2


class SourceError(ExpqError):
    """The source checkpoint is missing, unreadable, truncated or inconsistent."""


class OutputError(ExpqError):
    """Writing the output failed (disk full, permissions...); names the file and tensor. Resumable: the shards
    finished before it are kept."""

    resumable = True


class LayoutError(ExpqError):
    """The architecture is unknown, or its tensors do not match what its layout says."""


class NonFiniteError(ExpqError):
    """A routed-expert row holds NaN or infinity (refused unless ``allow_nonfinite``)."""


class UnreadableInputError(ExpqError):
    """A checkpoint that a check was asked to read cannot be read at all (exit status 2, like a usage error)."""

    exit_code = 2

    @classmethod
    def from_error(cls, e: ExpqError) -> "UnreadableInputError":
        """The same message and location, as an unreadable-input error."""
        return cls(e.message, file=e.file, tensor=e.tensor, expert=e.expert, row=e.row, hint=e.hint)


class ClusterError(ExpqError):
    """``--ray``: the cluster cannot be reached, or a task failed after its retries (the line names its output
    shards and the cause). ``exit_code``: the cause's where it was an expq error, else 1; ``resumable``: whether
    the same command resumes (the staging folder and journal are kept)."""

    resumable = True


class Interrupted(ExpqError):
    """The run was stopped by a signal (SIGINT, SIGTERM, SIGHUP): exit status 128 + the signal number."""

    resumable = True

    def __init__(self, signum: int, message: str | None = None, **where):
        import signal

        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        name = signal.Signals(self.signum).name
        super().__init__(message or f"interrupted by {name}", **where)


class HubError(SourceError):
    """A call to the Hub failed: a repo id could not be turned into a local snapshot, or a push or ``--to-hub``
    upload failed (``hub.errors.translate`` names a failure alike both ways). ``repo`` and ``revision`` say which;
    ``file`` is the path inside the repo (or the cache) where one file is the problem. The line starts ``repo ID
    (revision REV)`` and never holds a token. Resumable: a re-run finds what was downloaded (or uploaded) before."""

    resumable = True

    def __init__(self, message: str, *, repo: str, revision: str | None = None, file: str | None = None,
                 hint: str | None = None):
        self.repo = repo
        self.revision = revision
        super().__init__(message, file=file, hint=hint)

    def _line(self) -> str:
        where = f"repo {self.repo}" + (f" (revision {self.revision})" if self.revision else "")
        if self.file is not None:
            where += f", file {self.file}"
        line = f"{where}: {self.message}" + (f" ({self.hint})" if self.hint else "")
        return visible(line, one_line=True)


class HubNotFoundError(HubError):
    """The repo, the revision, or a file the checkpoint needs does not exist on the Hub (exit status 3)."""

    exit_code = 3


class HubAccessError(HubError):
    """The Hub refused access: a gated repo whose conditions are not accepted, or a token without read (or, for a
    push, write) permission (HTTP 403; exit status 4)."""

    exit_code = 4


class HubAuthError(HubError):
    """The Hub rejected the token itself (HTTP 401 invalid credentials; exit status 5)."""

    exit_code = 5


class HubOfflineError(HubError):
    """The Hub cannot be used (``HF_HUB_OFFLINE``, no network, or a Hub outage) and, for a download, the revision
    is not in the local cache (exit status 6)."""

    exit_code = 6


class IncompleteCacheError(HubOfflineError):
    """Offline, the local cache holds the repo but not all of it: a needed file is missing, or a branch name cannot
    be resolved because its ``refs/`` entry is missing (exit status 7)."""

    exit_code = 7


def resumable(e: BaseException) -> bool:
    """Whether the same command resumes after ``e``, so that the staging folder, the journal and a ``--stream``
    folder are kept for it (after any other error they are removed): an interrupt (``Interrupted``, or a
    ``KeyboardInterrupt`` that arrived before the signal handlers were in place), a failed write (``OSError``,
    ``OutputError``: disk full...), a Hub failure (``HubError``), or an error whose ``resumable`` says so (a
    ``ClusterError`` says whether its task's cause was)."""
    return isinstance(e, (KeyboardInterrupt, OSError)) or bool(getattr(e, "resumable", False))

"""Errors expq raises: one line each, naming the file, tensor, expert and row where they apply."""

from __future__ import annotations


class ExpqError(Exception):
    """A user-facing error. ``str(err)`` is one line that names where the problem is.

    Attributes ``file``, ``tensor``, ``expert`` and ``row`` hold the location (``None`` where it does not apply),
    so that callers can act on them without parsing the message.
    """

    exit_code = 1

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 expert: int | None = None, row: int | None = None, hint: str | None = None):
        self.message = message
        self.file = file
        self.tensor = tensor
        self.expert = expert
        self.row = row
        self.hint = hint
        super().__init__(self._line())

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
        return line.replace("\n", " ")


class UsageError(ExpqError):
    """Bad arguments or an output location that cannot be used (exit status 2)."""

    exit_code = 2


class SourceError(ExpqError):
    """The source checkpoint is missing, unreadable, truncated or inconsistent."""


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


class Interrupted(ExpqError):
    """The run was stopped by a signal (SIGINT, SIGTERM, SIGHUP): exit status 128 + the signal number."""

    def __init__(self, signum: int, message: str | None = None, **where):
        import signal

        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        name = signal.Signals(self.signum).name
        super().__init__(message or f"interrupted by {name}", **where)

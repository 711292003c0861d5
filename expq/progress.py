"""Progress for long commands: a rich bar on a terminal, plain newline-terminated lines in CI and in logs.

The rule (one for expq's own bars and for huggingface_hub's transfer bars): when stderr is a terminal and ``CI`` is
not set, a live bar; otherwise a plain line on stderr every ``EXPQ_PROGRESS_INTERVAL`` seconds (default 5; 0 prints
one per update) and one at the end, and huggingface_hub's bars are switched off. Nothing here writes to stdout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from .options import format_size

DEFAULT_INTERVAL = 5.0


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def is_tty(stream: TextIO | None) -> bool:
    """Whether ``stream`` is a terminal (False for closed, redirected or captured streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def interactive(stream: TextIO | None = None) -> bool:
    """Whether live progress bars belong on ``stream`` (default ``sys.stderr``): it is a terminal and the ``CI``
    environment variable is unset or false.

    Example:
        >>> import io
        >>> interactive(io.StringIO())
        False
    """
    return is_tty(sys.stderr if stream is None else stream) and not _truthy(os.environ.get("CI"))


def interval() -> float:
    """Seconds between plain progress lines: ``EXPQ_PROGRESS_INTERVAL`` (a finite number >= 0), else 5.

    Raises:
        UsageError: ``EXPQ_PROGRESS_INTERVAL`` is set to something else (``abc``, ``-1``, ``inf``).

    Example:
        >>> os.environ["EXPQ_PROGRESS_INTERVAL"] = "0.5"; interval()
        0.5
        >>> del os.environ["EXPQ_PROGRESS_INTERVAL"]; interval()
        5.0
    """
    raw = os.environ.get("EXPQ_PROGRESS_INTERVAL", "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        from .errors import UsageError

        raise UsageError(f"EXPQ_PROGRESS_INTERVAL={raw!r} is not a number of seconds >= 0 (unset it for the default, "
                         f"{DEFAULT_INTERVAL:g})")
    return value


def quiet_hub_bars() -> None:
    """Switch off huggingface_hub's transfer bars (and transformers', which follow them) when stderr is not an
    interactive terminal: their carriage-return redraws turn into noise in CI logs. A no-op on a terminal, and an
    explicit ``HF_HUB_DISABLE_PROGRESS_BARS=0`` still wins (huggingface_hub gives the environment priority)."""
    if interactive() or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return  # a terminal, or the user said what they want (huggingface_hub reads it itself)
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    # transformers copies huggingface_hub's setting when it is imported (so a later import follows it)
    if "transformers" in sys.modules:
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressLines:
    """Plain progress lines for a job measured in bytes and shards, e.g.
    ``converting: 1.20 GB / 4.80 GB (25%), 1/4 shards, 310.00 MB/s, ETA 0:00:12``.

    ``advance`` may be called from several threads; it prints when ``every`` seconds have passed since the last
    line (every call when ``every`` is 0). ``finish`` prints the final line (``converted: ...``, with the time taken).

    Args:
        total_bytes: the job's size; total_shards: how many output shards it writes.
        write: where a line goes (default: stderr, flushed); every: seconds between lines (default ``interval()``);
        clock: a monotonic clock (for tests); verb: the word for the running and the finished job.

    Example:
        >>> lines = []
        >>> p = ProgressLines(1000, 2, write=lines.append, every=0, clock=iter([0, 1, 2]).__next__)
        >>> p.advance(500, 1); p.finish()
        >>> lines
        ['converting: 500 bytes / 1.00 kB (50%), 1/2 shards, 500 bytes/s, ETA 0:00:01', \
'converted: 500 bytes / 1.00 kB (50%), 1/2 shards, 250 bytes/s, in 0:00:02']
    """

    def __init__(self, total_bytes: int, total_shards: int, *, write: Callable[[str], None] | None = None,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic,
                 verb: tuple[str, str] = ("converting", "converted")):
        self.total_bytes, self.total_shards = int(total_bytes), int(total_shards)
        self.write = write or self._stderr
        self.every = interval() if every is None else every
        self.clock, self.verb = clock, verb
        self.done_bytes = self.shards_done = 0
        self.start = self.clock()
        self.last = self.start
        self._lock = threading.Lock()

    @staticmethod
    def _stderr(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def line(self, now: float, final: bool = False) -> str:
        """The progress line at time ``now`` (the final form when ``final``)."""
        elapsed = now - self.start
        pct = f" ({100 * self.done_bytes / self.total_bytes:.0f}%)" if self.total_bytes > 0 else ""
        rate = self.done_bytes / elapsed if elapsed > 0 else None
        text = (f"{self.verb[1 if final else 0]}: {format_size(self.done_bytes)} / "
                f"{format_size(self.total_bytes)}{pct}, "
                f"{self.shards_done}/{self.total_shards} shards, {'-' if rate is None else format_size(rate)}/s")
        if final:
            return text + f", in {_clock(elapsed)}"
        left = self.total_bytes - self.done_bytes
        eta = "-" if not rate else _clock(max(left, 0) / rate)
        return text + f", ETA {eta}"

    def advance(self, nbytes: int, shards_done: int) -> None:
        """Count ``nbytes`` more done and ``shards_done`` shards finished; print a line if one is due."""
        with self._lock:
            self.done_bytes += int(nbytes)
            self.shards_done = max(self.shards_done, int(shards_done))
            now = self.clock()
            if now - self.last >= self.every:
                self.last = now
                self.write(self.line(now))

    def finish(self) -> None:
        """Print the final line."""
        with self._lock:
            self.write(self.line(self.clock(), final=True))

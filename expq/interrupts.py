"""The stop signal: one object that every part of a run watches to stop cleanly on SIGINT, SIGTERM or SIGHUP.

``stop_on_signals`` installs the handlers for the length of a run and yields ``STOP``; the pipelines, the Ray
driver, a ``--stream`` download and the writer's waits all look at that same object, finish what they hold and
raise ``STOP.interrupted()``. Whether the same command then resumes is ``errors.resumable``'s to say.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from .errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(threading.Event):
    """An event that also says which signal set it (``signum``; SIGINT until a signal arrives)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int = signal.SIGINT

    def stop(self, signum: int) -> None:
        """Set it, recording ``signum``."""
        self.signum = signum
        self.set()

    def reset(self) -> None:
        """Clear it for a new run."""
        self.signum = signal.SIGINT
        self.clear()

    def interrupted(self) -> Interrupted:
        """The error a run stopped by this signal raises (exit status 128 + ``signum``)."""
        return Interrupted(self.signum)


STOP = StopSignal()
"""The process's stop signal: set by the handlers ``stop_on_signals`` installs."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopSignal]:
    """For the length of a run: SIGINT, SIGTERM and SIGHUP set ``STOP`` (cleared first) instead of killing the
    process mid-write; the previous handlers come back afterwards, and ``STOP`` is cleared again (the run has
    raised ``Interrupted`` by then). Outside the main thread no handler can be installed: ``STOP`` is yielded as it
    is (set only by a run in the main thread).

    Yields:
        ``STOP``.
    """
    if threading.current_thread() is not threading.main_thread():
        yield STOP
        return
    old = {s: signal.signal(s, lambda signum, frame: STOP.stop(signum)) for s in SIGNALS}
    STOP.reset()
    try:
        yield STOP
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        STOP.reset()

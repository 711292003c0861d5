"""The stop signal: one object that every part of a run watches to stop cleanly on SIGINT, SIGTERM or SIGHUP.

``stop_on_signals`` installs the handlers for the length of a run and yields ``STOP``; the pipelines, the Ray
driver, a ``--stream`` download and the writer's waits all look at that same object, finish what they hold and
raise ``STOP.interrupted()``. Whether the same command then resumes is ``errors.resumable``'s to say.

The command line (``cli.console``) calls ``raise_on_signals`` first: from then until the process ends, a signal
that comes while no run watches ``STOP`` (importing, planning, hashing the source, printing the result) is recorded
in ``STOP`` and raised as ``KeyboardInterrupt`` in the main thread, as Python does for SIGINT alone (so SIGTERM and
SIGHUP too end with the one line and 128 + the signal, never a silent death); ``as_interrupted`` turns it into the
``Interrupted`` of the signal that came. One handler serves both: whether a run watches is one flag, so that no
signal finds a moment between the two.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

from .errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _handled() -> tuple[int, ...]:
    """``SIGNALS`` less those ignored now (``SIG_IGN``: ``nohup``, a script's ``trap '' INT``, a shell's background
    job): expq leaves an ignored signal ignored, as Python itself does for one inherited ignored."""
    return tuple(s for s in SIGNALS if signal.getsignal(s) != signal.SIG_IGN)


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
"""The process's stop signal: set by the handlers ``stop_on_signals`` and ``raise_on_signals`` install."""

_watched = False  # a run watches STOP (``stop_on_signals``): a signal only sets it
_raising = False  # ``raise_on_signals`` was called: this process is the command line's


def _on_signal(signum: int, frame) -> None:
    """The one handler: record the signal; where no run watches ``STOP``, raise it in the main thread, once: a
    signal that comes while an earlier one is being acted on (reported, or the run cleaning up) is absorbed."""
    if STOP.is_set():
        return
    STOP.stop(signum)
    if not _watched:
        raise KeyboardInterrupt


def raise_on_signals() -> None:
    """For the rest of this process (the command line's, from its first line): SIGINT, SIGTERM and SIGHUP are
    recorded in ``STOP`` and, outside a run, raised as ``KeyboardInterrupt`` (see the module docstring); ``STOP``
    stays set once a signal came (the process is ending: later signals are absorbed). Main thread only."""
    global _raising
    _raising = True
    for s in _handled():
        signal.signal(s, _on_signal)


def as_interrupted(e: BaseException, message: str | None = None) -> Interrupted | None:
    """``e`` as the interrupt it is: an ``Interrupted`` (given ``message``, a new one of its signal saying it), or a
    ``KeyboardInterrupt`` as the ``Interrupted`` of the signal ``STOP`` recorded (SIGINT where none was: Python's
    own Ctrl-C); None for any other error."""
    if isinstance(e, Interrupted):
        return e if message is None else Interrupted(e.signum, message)
    if isinstance(e, KeyboardInterrupt):
        return Interrupted(STOP.signum if STOP.is_set() else signal.SIGINT, message)
    return None


_committed = False  # the last conversion of this process committed its OUT (``conversion_committed``)


def conversion_committed(done: bool) -> None:
    """Record whether this process's conversion has committed OUT: False when one starts (``api.convert``), True
    right after its commit's rename (``OutputDir.commit``; a run still watches ``STOP`` then, so that no signal
    falls between the commit and this record).
    ``committed_now`` tells a handler that runs later which line is true."""
    global _committed
    _committed = done


def committed_now() -> bool:
    """Whether this process's last conversion committed OUT (``conversion_committed``)."""
    return _committed


def interrupted_outside_run(e: BaseException, *, committed: bool) -> Interrupted:
    """The ``Interrupted`` of a signal (``e``: see ``as_interrupted``) that came while no run was writing a
    conversion: before anything was written (starting, opening the source, planning, hashing it, taking OUT), or,
    when ``committed``, after the new checkpoint was in place, saying which."""
    stop = as_interrupted(e) or Interrupted(signal.SIGINT)
    name = signal.Signals(stop.signum).name
    if committed:
        return Interrupted(stop.signum, f"interrupted by {name} after the commit: OUT holds the complete new "
                                        "checkpoint; nothing to resume")
    return Interrupted(stop.signum, f"interrupted by {name} before anything was written: OUT is unchanged; re-run "
                                    "the same command to start")


STARTING = "error: interrupted by {signal} while expq was starting: nothing was done; re-run the same command"
"""The line of a signal before the command line has taken the signals over (``guard_start``)."""


def guard_start() -> None:
    """The command line's first step (``launch.main``, ``python -m expq.cli``): until it takes the signals over
    (``raise_on_signals``), SIGINT, SIGTERM and SIGHUP end the process at once with ``STARTING`` (``{signal}``: its
    name) on stderr and 128 + the signal."""
    end_on_signals(line=STARTING)


@contextlib.contextmanager
def ending_at_once(line: str = STARTING) -> Iterator[None]:
    """For the length of a step that writes nothing (the command line importing torch and the API): SIGINT,
    SIGTERM and SIGHUP end the process at once with ``line`` and 128 + the signal (``end_on_signals``), then the
    handlers before come back. A ``KeyboardInterrupt`` raised into torch's C++ start-up (pybind11) aborts the
    process (``std::terminate``, a core dump) instead of reaching expq's handler. Outside the main thread, nothing
    (no handler can be installed there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in _handled()}
    end_on_signals(line=line)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@contextlib.contextmanager
def keeping_handlers() -> Iterator[None]:
    """Around a library call that installs handlers of its own for SIGINT, SIGTERM or SIGHUP (``ray.init``: a
    SIGTERM handler that exits with status 15 and no line): the handlers from before come back afterwards, so that
    a signal still ends expq as its other signals do. Outside the main thread, nothing (no handler can be
    installed there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            if h is not None:  # None: installed from outside Python; left as it is
                signal.signal(s, h)


def end_on_signals(*, status: int | None = None, line: str | None = None) -> None:
    """From now on SIGINT, SIGTERM and SIGHUP end the process at once (``os._exit``), with ``status`` (None:
    128 + the signal), after writing ``line`` (``{signal}``: its name) on stderr: for a command line process
    still importing, before anything can be written or cleaned up, or one whose outcome is already printed."""
    def end(signum: int, frame) -> None:
        if line is not None:
            with contextlib.suppress(OSError):
                os.write(2, (line.format(signal=signal.Signals(signum).name) + "\n").encode())
        os._exit(128 + signum if status is None else status)

    for s in _handled():
        signal.signal(s, end)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopSignal]:
    """For the length of a run: SIGINT, SIGTERM and SIGHUP set ``STOP`` (cleared first) instead of killing the
    process mid-write; the previous handlers come back afterwards, and ``STOP`` is cleared again (the run has
    raised ``Interrupted`` by then), except in the command line's process (``raise_on_signals``), which is ending
    then. Outside the main thread no handler can be installed: ``STOP`` is yielded as it
    is (set only by a run in the main thread).

    Yields:
        ``STOP``.

    Raises:
        Interrupted: a signal came that the run did not act on: before it began (``raise_on_signals`` recorded
            it), or after its body's last look at ``STOP``.
    """
    global _watched
    if threading.current_thread() is not threading.main_thread():
        yield STOP
        return
    if _raising and STOP.is_set():  # recorded outside a run and not acted on (its KeyboardInterrupt was swallowed)
        raise STOP.interrupted()
    old = {s: signal.signal(s, _on_signal) for s in _handled()}
    STOP.reset()  # before watching: a signal between the two is raised, never cleared unseen
    _watched = True
    try:
        yield STOP
        if STOP.is_set():  # a signal after the body's last look: the run still stops as interrupted
            raise STOP.interrupted()
    finally:
        _watched = False
        for s, h in old.items():
            signal.signal(s, h)
        if not _raising:
            STOP.reset()

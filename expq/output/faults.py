"""The fault seam (for tests): ``EXPQ_FAULT=POINT:N:ACTION[,...]`` makes the N-th ``write`` (a tensor written into
a shard), ``rename`` (the commit's rename or exchange), ``fsync`` (any file or folder flushed) or ``settle`` (a source
identity hashed while the run wrote, about to go into the journal: ``conversion.BackgroundIdentity``) of this process fail with ``enospc`` or ``eio``, ``kill`` the process with SIGKILL right there, ``stall`` it there until
interrupted, or ``stall-eio``: stall, then fail with EIO once interrupted (a worker's error that the stop caused).

The writing code calls ``hit(point)`` at each of these points; ``active`` holds the rules read from the
environment when expq is imported (a test in the same process may set another ``Faults`` there, e.g. one that
never fires, to count the points a run passes).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections import Counter

from ..interrupts import STOP

FAULT_ENV = "EXPQ_FAULT"


class Faults:
    """The rules of one ``EXPQ_FAULT`` value: counts writes, renames and fsyncs (``count``) and fails the one it
    names."""

    def __init__(self, spec: str):
        self.rules: dict[str, tuple[int, str]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            point, n, action = part.split(":")
            self.rules[point] = (int(n), action)
        self.count: Counter = Counter()
        self.lock = threading.Lock()

    def hit(self, point: str) -> None:
        """Count a pass at ``point``; at the N-th one, act (see the module docstring).

        Raises:
            OSError: ENOSPC or EIO, where the rule says ``enospc`` or ``eio``.
        """
        if point not in self.rules:
            return
        with self.lock:
            self.count[point] += 1
            n = self.count[point]
        at, action = self.rules[point]
        if n != at:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action in ("stall", "stall-eio"):  # hold everything as it is until the run is interrupted
            while not STOP.wait(0.05):
                pass
            if action == "stall":
                return
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code))


active = Faults(os.environ.get(FAULT_ENV, ""))


def hit(point: str) -> None:
    """``active.hit(point)``: the call at each fault point."""
    active.hit(point)

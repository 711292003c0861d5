"""A local source's shards hashed while the command line is still starting up.

``expq convert`` of a local directory hashes every source file whole: its identity (``source.local_identity``).
Before the conversion can start, the command line imports torch, which takes seconds (2.5 s on the 2-core runner,
3.5-4.5 s on the H200 host) on one core, the others idle. ``start`` hashes config.json and the shards then, biggest
first, on threads of their own (sha256 releases the GIL); ``take`` gives ``local_identity`` a file's result when the
file is still as it was when hashed (``io.files.stamp``, what ``conversion.source_stamps`` compares), waits for a
file being hashed, and hands a file not yet started back to the caller to hash itself, so that after start-up every identity thread works. A file that changed, failed or was never
queued is hashed again by ``local_identity``, which then reports any problem in its usual place.

Imports nothing that imports torch: the command line calls ``start`` before its first import of torch.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ExpqError
from .files import Inside, stamp
from .index import shard_files
from .regular import sha256_regular

MAX_THREADS = 8
"""The most threads hashing a source at once, here and in ``source.local_identity``."""


def identity_threads() -> int:
    """Threads that hash a local source: one per core, at most ``MAX_THREADS``."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


@dataclass
class _Job:
    path: Path
    state: str = "queued"  # queued -> running -> done, or queued -> taken (the caller hashes it)
    stamp: tuple | None = None  # the file's stamp, the same before and after the hash
    result: tuple[int, str] | None = None  # (size, sha256 hex); None: failed, stopped or changed while hashed
    done: threading.Event = field(default_factory=threading.Event)


_lock = threading.Lock()
_jobs: dict[tuple[int, int], _Job] = {}  # (st_dev, st_ino) of the file -> its job
_queue: list[_Job] = []  # jobs not yet started, the next one last
_stop = threading.Event()
_threads: list[threading.Thread] = []


def start(root: str | Path, threads: int | None = None) -> int:
    """Start hashing ``root``'s config.json and shards (those its index names, else its one safetensors file:
    ``io.index.shard_files``), the biggest first, on ``threads`` daemon threads (default ``identity_threads``; 0
    queues them only, for ``take`` to hand back).

    Returns:
        how many files were queued: 0 when ``root`` is not a directory whose shards can be told, or one of those
        files resolves outside it (``files.Inside``: the conversion refuses to read it; no error is raised: the
        conversion reports it).
    """
    try:
        root = Path(root)
        rels = ["config.json", *shard_files(root)[1]]
        inside = Inside(root)
        for rel in rels:  # a file the conversion refuses to read (a link out of the checkpoint) is never read
            inside.check(rel, rel)
        files = [(os.stat(root / rel), root / rel) for rel in rels]
    except (OSError, ExpqError, ValueError):
        return 0
    jobs = []
    with _lock:
        for st, path in sorted(files, key=lambda f: f[0].st_size):  # the biggest last: taken first
            if (st.st_dev, st.st_ino) not in _jobs:
                _jobs[st.st_dev, st.st_ino] = job = _Job(path)
                jobs.append(job)
        _queue.extend(jobs)
    for i in range(min(len(jobs), identity_threads() if threads is None else threads)):
        t = threading.Thread(target=_work, name=f"expq-early-hash_{i}", daemon=True)
        t.start()
        _threads.append(t)
    return len(jobs)


def _work() -> None:
    while True:
        with _lock:
            if not _queue:
                return
            job, stopped = _queue.pop(), _stop
            job.state = "running"
        try:
            before = stamp(os.stat(job.path))
            result = sha256_regular(job.path, "source file", cancel=stopped)
            if stamp(os.stat(job.path)) == before and result[0] == before[0]:
                job.stamp, job.result = before, result
        except (OSError, ExpqError):
            pass
        finally:
            job.state = "done"
            job.done.set()


def take(path: str | Path, cancel: threading.Event | None = None) -> tuple[int, str] | None:
    """The (size, sha256 hex) ``start`` found for the file at ``path``, if it is still the file that was hashed;
    waits while it is being hashed (until ``cancel`` is set). None: not queued, not started yet (it is then the
    caller's to hash), failed, or changed since.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    with _lock:
        job = _jobs.get((st.st_dev, st.st_ino))
        if job is None:
            return None
        if job.state in ("queued", "taken"):  # not started: the caller's to hash
            if job.state == "queued":
                _queue.remove(job)
            job.state = "taken"
            return None
    while not job.done.wait(0.05):
        if cancel is not None and cancel.is_set():
            return None
    return job.result if job.stamp == stamp(st) else None


def join() -> None:
    """Wait until the threads ``start`` began have hashed every file of their queue (or were stopped)."""
    while _threads:
        _threads.pop().join()


def stop() -> None:
    """Stop hashing (each thread ends at its next chunk) and forget every result."""
    global _stop
    with _lock:
        old, _stop = _stop, threading.Event()
        _queue.clear()
        _jobs.clear()
    old.set()

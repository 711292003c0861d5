"""The thread pool a CPU conversion spreads its arithmetic over.

While a CPU pipeline runs, torch is single-threaded (OpenMP teams spin-wait for each other and slow down several
times over when the pipeline's read, write and hash threads share the cores) and this module holds a pool of one
thread per core (``Pool``). The scheme's row blocks and the decoders' bands go through ``each``; outside a conversion
(or on a GPU) ``each`` simply runs the items in turn, in the calling thread. A thread can hold a pool of its own
(``local``): the front pass of a GPU conversion spreads its CPU scales over one while the GPU pipelines, which
launch their kernels from their own threads and streams, keep running theirs in turn. Work queued from a thread inside
``first()`` (the scale pass) is taken before the rest, so that a small pass others wait for is never stuck behind
the bulk of the work.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

_pool: "Pool | Executor | None" = None
_local = threading.local()


class Pool:
    """``threads`` worker threads taking work from one priority queue (lower first, then in submission order)."""

    def __init__(self, threads: int, name: str = "expq-pool"):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (task := self._q.get())[2] is not None:
            fut, fn, item = task[2:]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(item))
                except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                    fut.set_exception(e)

    def run(self, fn: Callable, items: list, priority: int) -> None:
        """``fn(item)`` for every item on the workers; returns when all are done (raises the first exception)."""
        futs = []
        for it in items:
            fut: Future = Future()
            self._q.put((priority, next(self._seq), fut, fn, it))
            futs.append(fut)
        for fut in futs:
            fut.result()

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put((float("inf"), next(self._seq), None, None, None))
        for t in self._threads:
            t.join()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def pool() -> "Pool | Executor | None":
    """The pool in use in this thread (``local``), else the one in use (``using``), or None."""
    return getattr(_local, "pool", None) or _pool


@contextmanager
def using(executor: "Pool | Executor | None") -> Iterator[None]:
    """Make ``executor`` the pool for the duration (restores the previous one)."""
    global _pool
    before, _pool = _pool, executor
    try:
        yield
    finally:
        _pool = before


@contextmanager
def local(executor: "Pool | Executor | None") -> Iterator[None]:
    """Make ``executor`` the pool of the calling thread only, for the duration (``each`` called from other threads,
    a GPU pipeline's among them, does not see it)."""
    before, _local.pool = getattr(_local, "pool", None), executor
    try:
        yield
    finally:
        _local.pool = before


@contextmanager
def first() -> Iterator[None]:
    """In this thread, for the duration, ``each`` queues its items ahead of everything else queued on a ``Pool``."""
    before, _local.priority = getattr(_local, "priority", 1), 0
    try:
        yield
    finally:
        _local.priority = before


def each(fn: Callable, items: Iterable) -> None:
    """``fn(item)`` for every item, spread over the pool when there is one (items must be independent: they write
    disjoint parts of their outputs); exceptions propagate."""
    items, p = list(items), pool()
    if p is None or len(items) < 2:
        for it in items:
            fn(it)
        return
    if isinstance(p, Pool):
        p.run(fn, items, getattr(_local, "priority", 1))
        return
    for _ in p.map(fn, items):
        pass

"""The thread pool a CPU conversion spreads its arithmetic over.

While a CPU pipeline runs, torch is single-threaded (OpenMP teams spin-wait for each other and slow down several
times over when the pipeline's read, write and hash threads share the cores) and this module holds a pool of one
thread per core. The scheme's row blocks and the decoders' bands go through ``each``; outside a conversion (or on a
GPU) ``each`` simply runs the items in turn, in the calling thread.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

_pool: Executor | None = None


def pool() -> Executor | None:
    """The pool in use, or None."""
    return _pool


@contextmanager
def using(executor: Executor | None) -> Iterator[None]:
    """Make ``executor`` the pool for the duration (restores the previous one)."""
    global _pool
    before, _pool = _pool, executor
    try:
        yield
    finally:
        _pool = before


def each(fn: Callable, items: Iterable) -> None:
    """``fn(item)`` for every item, spread over the pool when there is one (items must be independent: they write
    disjoint parts of their outputs); exceptions propagate."""
    items = list(items)
    if _pool is None or len(items) < 2:
        for it in items:
            fn(it)
        return
    for _ in _pool.map(fn, items):
        pass

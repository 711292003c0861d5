"""The thread pools of a conversion (``expq.parallel``): the pool in use, a thread's own pool, the queue order."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from expq import parallel


def _threads_of(items: int) -> set[str]:
    """The names of the threads ``parallel.each`` runs ``items`` items on, from the calling thread."""
    seen, lock, pooled = set(), threading.Lock(), parallel.pool() is not None
    barrier = threading.Barrier(min(items, 2), timeout=10)

    def fn(_):
        with lock:
            seen.add(threading.current_thread().name)
        if pooled:
            barrier.wait()  # two items at once: only a pool of two threads gets past

    parallel.each(fn, range(items))
    return seen


def test_a_threads_own_pool_serves_that_thread_only():
    """``local``: the thread that holds the pool spreads its items over it; another thread (a GPU pipeline's, which
    must launch its kernels itself) runs its items in turn, in itself, while the first holds its pool."""
    held, release, out = threading.Event(), threading.Event(), {}

    def front():
        with parallel.Pool(2, "own") as pool, parallel.local(pool):
            out["front"] = _threads_of(4)
            held.set()
            release.wait(10)
            out["front, later"] = _threads_of(4)
        out["front, after"] = _threads_of(4)

    t = threading.Thread(target=front, name="front")
    t.start()
    assert held.wait(10)
    other = threading.Thread(target=lambda: out.__setitem__("other", _threads_of(4)), name="other")
    other.start()
    other.join(10)
    release.set()
    t.join(10)
    assert out["front"] == out["front, later"] == {"own_0", "own_1"}
    assert out["other"] == {"other"}  # not the front's pool
    assert out["front, after"] == {"front"}  # restored: no pool


def test_the_run_wide_pool_and_a_threads_own():
    """``using`` is seen by every thread; a thread's ``local`` pool takes precedence in that thread only."""
    with ThreadPoolExecutor(2, thread_name_prefix="run") as run_pool, parallel.using(run_pool):
        assert parallel.pool() is run_pool
        assert {n.rsplit("_", 1)[0] for n in _threads_of(4)} == {"run"}
        with parallel.Pool(2, "own") as own, parallel.local(own):
            assert parallel.pool() is own
            assert _threads_of(4) == {"own_0", "own_1"}
            box = {}
            t = threading.Thread(target=lambda: box.__setitem__("pool", parallel.pool()))
            t.start()
            t.join()
            assert box["pool"] is run_pool
        assert parallel.pool() is run_pool
    assert parallel.pool() is None


def test_usable_cores_is_the_affinity():
    import os

    n = parallel.usable_cores()
    assert n >= 1
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))

"""Reused host buffers for a CPU conversion: the large tensors a pipeline makes for every job (the bytes read, the
decoded weights, the int8 codes) come out of a pool of memory mappings instead of a fresh allocation each.

A fresh large allocation is a fresh mapping of the process's memory: every page of it faults on first touch, and
the kernel zeroes it; on the 2-core runner that costs about 0.7 ns per byte, twice the scheme's own arithmetic
(0.3 ns per bf16 element). ``Pool`` keeps the mappings of tensors that are gone and hands them out again.

When is a buffer gone? When nothing refers to its bytes any more: a buffer is handed out as a tensor made from a
numpy array of its own (``torch.from_numpy``), which every view of the tensor, every ``numpy()`` of a view and
every ``memoryview`` of those keeps alive; once the last of them is dropped (the writer has written the bytes, the
shard hasher has hashed them from memory, the codes were packed into another buffer...), a ``weakref.finalize`` on
that array gives the mapping back to its pool. Nothing has to say when it is done with a buffer, and a buffer
cannot be handed out again while anything can still read or write it.

``empty(shape, dtype)`` gives a tensor from the pool in use (``using``), or ``torch.empty`` outside one and for
small sizes. The pool never waits for a buffer to come back (it maps a new one), so it cannot deadlock a pipeline;
it keeps at most ``max_free`` bytes of buffers nobody holds. Contents are undefined, as with ``torch.empty``.
"""

from __future__ import annotations

import collections
import math
import mmap
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

MIN_BYTES = 1 << 20
"""Smaller tensors come from ``torch.empty`` (the C allocator keeps those: no page faults to save)."""
GRAIN = 2 << 20
"""Buffers are mapped in multiples of this (a huge page: with transparent huge pages on ``madvise``, a new buffer
faults once per 2 MiB instead of once per 4 KiB)."""


class Pool:
    """Buffers handed out by ``take`` and taken back when nothing refers to them any more (see the module docstring).

    Args:
        max_free: bytes of buffers kept for reuse at most (past that, the oldest returned are unmapped).
        poison: if set, every buffer is filled with this byte before it is handed out (tests: a result that
            depended on what a buffer held before, or on fresh memory being zero, would show).

    Attributes (counts since creation, for tests and benchmarks): ``mapped`` (new buffers), ``reused``,
    ``mapped_bytes``, ``unmapped_bytes`` (of free buffers past ``max_free``).
    """

    def __init__(self, max_free: int, poison: int | None = None):
        self.max_free, self.poison = max_free, poison
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []  # oldest first
        self._free_bytes = 0
        # buffers given back: appended by the finalizers, from whichever thread drops the last reference (a
        # deque's append is atomic; the finalizer never takes the lock, so it may run anywhere, even under it)
        self._back: collections.deque[mmap.mmap] = collections.deque()
        self.mapped = self.reused = self.mapped_bytes = self.unmapped_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (its contents undefined), from a buffer nobody holds, or a new one."""
        with self._lock:
            while self._back:
                buf = self._back.popleft()
                self._free.append(buf)
                self._free_bytes += len(buf)
            while self._free_bytes > self.max_free:
                n = len(self._free.pop(0))
                self._free_bytes -= n
                self.unmapped_bytes += n
            # the smallest free buffer that holds nbytes and is at most about twice as large
            fits = [b for b in self._free if nbytes <= len(b) <= 2 * nbytes + GRAIN]
            buf = min(fits, key=len) if fits else None
            if buf is not None:
                self._free.remove(buf)
                self._free_bytes -= len(buf)
                self.reused += 1
            else:
                size = max(GRAIN, -(-nbytes // GRAIN) * GRAIN)
                self.mapped += 1
                self.mapped_bytes += size
        if buf is None:
            buf = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)  # one array per lease: its life is the lease's
        if self.poison is not None:
            arr.fill(self.poison)
        weakref.finalize(arr, self._back.append, buf).atexit = False
        return torch.from_numpy(arr)


_pool: Pool | None = None


@contextmanager
def using(pool: Pool | None) -> Iterator[None]:
    """Make ``pool`` the one ``empty`` takes from, for the duration (process-wide; restores the previous one)."""
    global _pool
    before, _pool = _pool, pool
    try:
        yield
    finally:
        _pool = before


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor like ``torch.empty(shape, dtype=dtype)`` (contiguous, contents undefined), from the pool in use
    when there is one and the tensor is at least ``MIN_BYTES``."""
    pool = _pool
    nbytes = math.prod(shape) * dtype.itemsize
    if pool is None or nbytes < max(1, MIN_BYTES):
        return torch.empty(shape, dtype=dtype)
    return pool.take(nbytes).view(dtype).view(shape)

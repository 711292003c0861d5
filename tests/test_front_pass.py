"""How far the front pass runs ahead of the read threads (``front_pass.units_ahead``, ``lookahead_bytes``): by
source bytes, one unit at least, never past what a quarter of the available memory holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from expq import front_pass
from expq.front_pass import LOOKAHEAD_SHARDS, lookahead_bytes, memory_available, units_ahead

GB = 10**9


def units(*sizes: int) -> list[list[tuple[int, SimpleNamespace]]]:
    """One unit per size, each one job whose tensor stores that many bytes (split in two jobs, to count sums)."""
    return [[(2 * k, SimpleNamespace(tensor=SimpleNamespace(nbytes_stored=s - s // 3))),
             (2 * k + 1, SimpleNamespace(tensor=SimpleNamespace(nbytes_stored=s // 3)))] for k, s in enumerate(sizes)]


@pytest.mark.parametrize("sizes, ahead, want", [
    ((5 * GB, 5 * GB, 5 * GB, 2 * GB), 10 * GB, [0, 0, 1, 2]),  # two 5 GB units ahead at most
    ((5 * GB, 5 * GB, 5 * GB, 2 * GB), 0, [0, 1, 2, 3]),  # no lookahead: one unit ahead, as the read threads go
    ((1 * GB,) * 6, 3 * GB, [0, 0, 0, 1, 2, 3]),
    ((1 * GB, 20 * GB, 1 * GB), 10 * GB, [0, 1, 2]),  # a unit larger than the lookahead: started when its turn is next
    ((), 10 * GB, []),
])
def test_the_front_pass_runs_ahead_by_source_bytes(sizes, ahead, want):
    got = units_ahead(units(*sizes), ahead)
    assert got == want
    for k, n in enumerate(got):  # what is read ahead of the read threads fits, or is the one unit next
        assert n <= k and (sum(sizes[n:k + 1]) <= ahead or n == k)
        assert n == 0 or sum(sizes[n - 1:k + 1]) > ahead  # and no unit waits longer than it must


def test_the_lookahead_is_bounded_by_the_shard_size_and_the_memory(monkeypatch):
    plan = SimpleNamespace(max_shard_size=5 * GB)
    monkeypatch.setattr(front_pass, "memory_available", lambda: 400 * GB)
    assert lookahead_bytes(plan) == LOOKAHEAD_SHARDS * 5 * GB
    monkeypatch.setattr(front_pass, "memory_available", lambda: 8 * GB)
    assert lookahead_bytes(plan) == 2 * GB
    monkeypatch.setattr(front_pass, "memory_available", lambda: 0)
    assert lookahead_bytes(plan) == 0
    monkeypatch.undo()
    assert 0 < memory_available() < 1 << 50  # this machine's, read from /proc/meminfo (or sysconf)

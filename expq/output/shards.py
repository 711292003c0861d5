"""The output shards of a plan, written positionally and hashed as they fill.

Shards are written positionally (the plan knows every tensor's offset before the first byte), so tensors can arrive
in any order from any device and no output shard is ever held in memory. A hasher thread per open shard computes its
sha256 as it fills, following the contiguous written prefix: from memory when a tensor lands there, else read back
from the page cache (the shards' hashes run side by side: one sha256 is about 1.2 GB/s of one core, and a shard
whose front is written last, as experts-int8's scales can be, is hashed after its codes); it starts the disk
writing the hashed ranges (``io.files.start_writeback``), and once the shard's last tensor is written and its fsync
(run at once, in its own thread) has returned, records it in the journal (``ShardDestination.record``:
``outdir.OutputDir`` for a conversion, ``ShardFolder`` for one ``--ray`` task).

Also here: the sparse stand-in of a shard (``placeholder_shard``) and config.json's text (``config_json``).
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import json
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..errors import ExpqError, OutputError
from ..io import files
from ..io.hashing import sha256_file
from ..io.safetensors import encode_header
from ..manifest import MANIFEST_SHA256_KEY
from ..plan import OutTensor, Plan
from . import faults

HASH_CHUNK = 16 << 20  # bytes read back per step by the shard hasher
HASH_MEMORY = 256 << 20  # written bytes at most kept for the hasher to hash from memory (past that: read back)


class ShardDestination(Protocol):
    """Where a ``ShardSet`` writes: ``outdir.OutputDir`` (a conversion into OUT) or ``ShardFolder`` (one part of a
    ``--ray`` conversion).

    ``staging``: the folder the shards are written in. ``finished_files``: the output files already finished (by an
    earlier run into OUT, or by another part): never opened or written. ``path(name)``: where file ``name`` goes
    (its folders made). ``record(name, jobs, sha256)``: file ``name`` is written and fsync'd, its sha256 is
    ``sha256``, and ``jobs`` the row findings of the jobs finished so far."""

    staging: Path

    @property
    def finished_files(self) -> frozenset[str]: ...

    def path(self, name: str) -> Path: ...

    def record(self, name: str, jobs: dict | None = None, sha256: str | None = None) -> None: ...


class _ShardHash:
    """The sha256 of one output shard, computed while it is written: it follows the contiguous written prefix,
    hashing a tensor from memory when it lands right there and reading the rest back (from the page cache, just
    written) in large chunks, so that when the last tensor lands only the tail is left to hash."""

    def __init__(self, fd: int, header: bytes, size: int, writeback: bool):
        self.fd = fd
        self.h = hashlib.sha256(header)
        self.pos = len(header)
        self.size = size  # the whole file: header + data
        # heap of written (start, end, bytes or None) ranges past ``pos``: with their bytes while the shard's
        # memory allowance holds them (hashed from memory once ``pos`` gets there), else read back
        self.ready: list[tuple[int, int, int, memoryview | None]] = []  # (start, end, arrival, bytes)
        self.arrivals = 0  # orders empty ranges that share a start (never compares the bytes)
        self.writeback = writeback  # start writing hashed ranges to disk as we go
        self.synced = False  # the shard's fsync has returned

    def take(self, data: memoryview) -> None:
        """Hash bytes just written at ``pos`` from memory (no read back)."""
        self.h.update(data)
        if self.writeback:
            files.start_writeback(self.fd, self.pos, data.nbytes)
        self.pos += data.nbytes

    def advance(self, release: Callable[[int], None]) -> bool:
        """Hash what became contiguous; True once the whole file is hashed. Ranges whose bytes are held are hashed
        from memory (``release(nbytes)`` then gives the allowance back); the rest is read back into one buffer, kept
        between calls (a fresh 16 MiB object per read costs its page faults, about a sixth of the hash's time)."""
        while self.ready and self.ready[0][0] <= self.pos:
            _, end, _, data = heapq.heappop(self.ready)
            if data is not None:
                self.take(data)
                release(data.nbytes)
                continue
            while self.pos < end:
                view = _read_buffer()[: min(HASH_CHUNK, end - self.pos)]
                n = os.preadv(self.fd, [view], self.pos) if hasattr(os, "preadv") else \
                    _pread_into(self.fd, view, self.pos)
                if not n:
                    raise OSError(errno.EIO, "short read back of a shard being written")
                self.h.update(view[:n])
                if self.writeback:
                    files.start_writeback(self.fd, self.pos, n)
                self.pos += n
        return self.pos >= self.size


_hash_buffer = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read-back buffer (``HASH_CHUNK`` bytes)."""
    buf = getattr(_hash_buffer, "view", None)
    if buf is None:
        buf = _hash_buffer.view = memoryview(bytearray(HASH_CHUNK))
    return buf


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    data = os.pread(fd, len(view), pos)
    view[: len(data)] = data
    return len(data)


class ShardSet:
    """The output shards of a plan, opened on first write and closed once all their tensors are written: the last
    byte hashed (sha256, computed as the shard fills by its hasher thread), fsync'd, then recorded in the journal.

    ``write`` / ``done`` are thread-safe: pipelines on several devices write their tensors at their planned
    offsets, in any order (the hash is the same; it is cheapest when a shard is written front to back).
    Tensors whose value the plan knows (``OutTensor.value``) are written when their shard is opened.
    """

    def __init__(self, plan: Plan, outdir: ShardDestination, fsync: bool = True):
        self.plan = plan
        self.outdir = outdir
        self.fsync = fsync
        self._members: list[list[OutTensor]] = [[] for _ in plan.shard_names]
        for o in plan.outputs:
            self._members[o.shard].append(o)
        self._fds: dict[int, tuple[int, int]] = {}  # shard -> (fd, data start)
        self._hashes: dict[int, _ShardHash] = {}
        self._left = [len(m) for m in self._members]
        self._lock = threading.Condition()
        self._events: dict[int, queue.SimpleQueue] = {}  # per open shard, for its hasher (_hash_loop); None: stop
        self._held = 0  # bytes of written tensors held for the hasher to hash from memory
        self._hashers: dict[int, threading.Thread] = {}
        self._record_lock = threading.Lock()  # one journal record at a time
        self.error: BaseException | None = None  # what stopped the hasher (a failed read back, fsync or journal)
        self.closed: list[int] = []
        self.on_close = dict  # returns the row findings of finished jobs, for the journal (run_plan sets it)
        # shards finished before (``outdir.finished_files``): never opened, written or recorded here
        self.finished_shards = frozenset(k for k, n in enumerate(plan.shard_names) if n in outdir.finished_files)
        for k in sorted(self.finished_shards):
            self._left[k] = 0
            self.closed.append(k)

    def needed(self, outputs: list[OutTensor]) -> bool:
        """Whether any of these outputs goes into a shard that is not finished yet."""
        return any(self._left[o.shard] for o in outputs)

    def _open(self, k: int) -> tuple[int, int]:
        header = encode_header(self._members[k])
        path = self.outdir.path(self.plan.shard_names[k])
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + self.plan.shard_sizes[k])
            for o in self._members[k]:
                if o.value is not None:
                    os.pwrite(fd, o.value, len(header) + o.offset)
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=str(path)) from None
        self._hashes[k] = _ShardHash(fd, header, len(header) + self.plan.shard_sizes[k], writeback=self.fsync)
        self._events[k] = queue.SimpleQueue()
        self._hashers[k] = threading.Thread(target=self._hash_loop, args=(k,), name=f"expq-hasher-{k}", daemon=True)
        self._hashers[k].start()
        for o in self._members[k]:
            if o.value is not None:
                self._left[k] -= 1
                self._events[k].put((len(header) + o.offset, len(header) + o.offset + o.nbytes, None))
        return fd, len(header)

    def target(self, out: OutTensor) -> tuple[int, int] | None:
        """(fd, absolute offset) where ``out``'s bytes go (opens the shard if needed), or None for a shard an
        earlier run finished.

        Raises:
            OutputError: opening the shard failed, or the hasher stopped on an error (re-raised here).
        """
        with self._lock:
            if self.error is not None:
                raise self.error
            if out.shard in self.finished_shards:
                return None
            if out.shard not in self._fds:
                self._fds[out.shard] = self._open(out.shard)
            fd, base = self._fds[out.shard]
        return fd, base + out.offset

    def write(self, out: OutTensor, data) -> None:
        """Write ``data`` (a tensor of ``out``'s dtype and shape, or exactly ``out.nbytes`` bytes) at ``out``'s place.

        Raises:
            OutputError: the write failed (names the shard and tensor).
        """
        self.write_run([out], [data])

    def write_run(self, outs: list[OutTensor], datas: list) -> None:
        """Write tensors that lie back to back in one shard (``outs`` in file order, each ``datas`` item as
        ``write`` takes it) with one positional write: many small tensors (experts-int8's scales, thousands of a
        few KB in a per-expert family) cost one system call, not one each, and the file's lock is taken once.

        Raises:
            OutputError: the write failed (names the shard and the first tensor).
        """
        views = [_bytes_of(d) for d in datas]
        for o, v in zip(outs, views, strict=True):
            if v.nbytes != o.nbytes:
                raise RuntimeError(f"internal: {o.name} has {v.nbytes} bytes, planned {o.nbytes}")
        for a, b in zip(outs, outs[1:]):
            if b.shard != a.shard or b.offset != a.offset + a.nbytes:
                raise RuntimeError(f"internal: {b.name} does not follow {a.name} in its shard")
        t = self.target(outs[0])
        if t is None:
            return
        fd, pos = t
        data = views[0] if len(views) == 1 else memoryview(b"".join(views))
        mv, start = data, pos
        try:
            faults.hit("write")
            while mv.nbytes:
                n = os.pwrite(fd, mv, pos)
                mv, pos = mv[n:], pos + n
            if self.fsync:  # to disk now, whether or not the hash has got here (the pages stay cached for it)
                files.start_writeback(fd, start, data.nbytes)
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=self.plan.shard_names[outs[0].shard],
                              tensor=outs[0].name) from None
        at = 0
        for o in outs:
            self.done(o, data[at:at + o.nbytes])
            at += o.nbytes

    def done(self, out: OutTensor, data: memoryview | None = None) -> None:
        """Mark ``out`` written (``write`` does this; call it after writing through ``target`` directly). Once the
        last tensor of a shard is written, the shard is fsync'd (in its own thread, while the hasher finishes);
        once both are done, the journal records its size and sha256.

        ``data``: the bytes just written; the hasher hashes them from memory when they are next in the file (else
        it reads them back later). At most ``HASH_MEMORY`` bytes wait for it this way; past that, none.
        """
        with self._lock:
            if out.shard in self.finished_shards:
                return
            self._left[out.shard] -= 1
            fd, base = self._fds[out.shard]
            last = self._left[out.shard] == 0
            if data is not None and self._held + data.nbytes <= HASH_MEMORY:
                self._held += data.nbytes
            else:
                data = None
            events = self._events[out.shard]
        events.put((base + out.offset, base + out.offset + out.nbytes, data))
        if last and self.fsync:  # flush while the hasher finishes the tail
            threading.Thread(target=self._fsync, args=(out.shard, fd), name="expq-fsync", daemon=True).start()

    def _fsync(self, k: int, fd: int) -> None:
        try:
            faults.hit("fsync")
            os.fsync(fd)
            self._events[k].put((None,))
        except BaseException as e:  # noqa: BLE001 - the hasher raises it
            self._events[k].put((e,))

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    def _hash_loop(self, k: int) -> None:
        """Shard ``k``'s hasher: hashes what its events say was written, until the shard is closed or stopped."""
        hs, events = self._hashes[k], self._events[k]
        try:
            while (ev := events.get()) is not None:
                if len(ev) == 1:  # the shard's fsync returned (None) or failed
                    if ev[0] is not None:
                        raise ev[0]
                    hs.synced = True
                else:
                    start, end, data = ev
                    hs.arrivals += 1
                    heapq.heappush(hs.ready, (start, end, hs.arrivals, data))
                    hs.advance(self._release)
                if hs.pos >= hs.size and (hs.synced or not self.fsync):
                    self._close(k, hs)
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the writers and to wait_closed
            with self._lock:
                if self.error is None:
                    self.error = e if isinstance(e, ExpqError) else OutputError(
                        f"cannot finish the shard: {getattr(e, 'strerror', None) or e}", file=self.plan.shard_names[k])
                self._lock.notify_all()

    def _close(self, k: int, hs: _ShardHash) -> None:
        with self._lock:
            fd, _ = self._fds.pop(k)
        os.close(fd)
        name = self.plan.shard_names[k]
        with self._record_lock:
            self.outdir.record(name, jobs=self.on_close(), sha256=hs.h.hexdigest())
        with self._lock:
            self.closed.append(k)
            self._lock.notify_all()

    def wait_closed(self, stop: threading.Event | None = None) -> None:
        """Block until every shard is closed (hashed, fsync'd, recorded), or ``stop`` is set.

        Raises:
            OutputError (or the ExpqError that stopped the hasher).
        """
        with self._lock:
            while len(self.closed) < len(self.plan.shard_names) and self.error is None:
                if stop is not None and stop.is_set():
                    return
                self._lock.wait(0.1)
            if self.error is not None:
                raise self.error

    def close_all(self) -> None:
        """Stop the hasher, close and remove every shard not finished (after an error or an interrupt): a re-run
        redoes them."""
        with self._lock:
            hashers, self._hashers = self._hashers, {}
        for k in hashers:
            self._events[k].put(None)
        for t in hashers.values():
            t.join()
        with self._lock:
            for k, (fd, _) in self._fds.items():
                os.close(fd)
                files.remove_file(self.outdir.staging / self.plan.shard_names[k])
            self._fds.clear()

    def complete(self) -> bool:
        """Every shard written and closed."""
        return all(n == 0 for n in self._left) and len(self.closed) == len(self.plan.shard_names)


class ShardFolder:
    """Where one part of a conversion writes its output shards (``--ray``: one task, on any node): a
    ``ShardDestination`` without the lock, journal or commit, which stay with the driver's ``OutputDir``.

    Args:
        folder: where the shard files go (the driver's staging folder on a shared filesystem, or a node-local
            temporary folder); it must exist, and is never made here: a task still ending after its run failed
            cannot bring back the staging folder the driver removed.
        names: the shards this part writes; every other shard of the plan counts as finished elsewhere
            (``finished_files``).
        all_names: every shard name of the plan.

    ``records``: for each shard written and fsync'd, {size, sha256, jobs (row findings so far)}, as the journal
    would record it.

    Raises:
        OutputError: ``folder`` is not there.
    """

    def __init__(self, folder: Path, names: list[str], all_names: list[str]):
        self.staging = Path(folder)
        if not self.staging.is_dir():
            raise OutputError("the folder for these shards is not there (OUT's staging folder: removed after the run "
                              "failed, or not on a filesystem every node shares)", file=str(folder))
        self.finished_files = frozenset(all_names) - set(names)  # written by other parts: never opened here
        self.records: dict[str, dict] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        """Where shard ``name`` goes: the folders inside ``folder`` that its name has are made, ``folder`` never."""
        for sub in reversed(Path(name).parents[:-1]):
            (self.staging / sub).mkdir(exist_ok=True)
        return self.staging / name

    def record(self, name: str, jobs: dict | None = None, sha256: str | None = None) -> None:
        p = self.staging / name
        rec = {"size": p.stat().st_size, "sha256": sha256 or sha256_file(p, follow_links=False),
               "jobs": dict(jobs or {})}
        with self._lock:
            self.records[name] = rec


def placeholder_shard(plan: Plan, k: int, path: Path) -> None:
    """A sparse stand-in for output shard ``k``: its real header (the plan fixes it) and its real size, no data
    (``--to-hub``: the driver reads headers and sizes from it, for the model card, and never holds the weights)."""
    members = [o for o in plan.outputs if o.shard == k]
    header = encode_header(members)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + plan.shard_sizes[k])


def _bytes_of(data) -> memoryview:
    """The raw bytes of a tensor (any dtype, bfloat16 included) or a bytes-like object."""
    if isinstance(data, torch.Tensor):
        t = data.detach().cpu().contiguous()
        return memoryview(t.view(torch.uint8).numpy() if t.numel() else b"").cast("B")
    return memoryview(data).cast("B")


def config_json(config: dict, quantization_config: dict, manifest_sha256: str) -> str:
    """config.json: the source's, key order kept, with ``quantization_config`` set and, last, the sha256 of
    expq.json's canonical form (``manifest.MANIFEST_SHA256_KEY``); stale ones of both are replaced."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", MANIFEST_SHA256_KEY)}
    cfg["quantization_config"] = quantization_config
    cfg[MANIFEST_SHA256_KEY] = manifest_sha256
    return json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"

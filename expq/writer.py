"""Laying down the output: shards written in place from the plan's offsets, the index, config and side files, all
under temporary names in ``OUT/.expq-partial/`` and renamed into ``OUT`` only when everything is complete.

A crash leaves at most the hidden staging folder, never a final-named partial file; an error removes it. Shards are
written positionally (the plan knows every tensor's offset before the first byte), so tensors can arrive in any
order from any device and no output shard is ever held in memory. The staging folder holds an exclusive lock
(``filelock``, an ``flock`` the OS releases when the process dies), so two conversions never write one OUT.

Fault seam (for tests, and for anyone who wants to see what a crash leaves): ``EXPQ_FAULT=POINT:N:ACTION[,...]``
makes the N-th ``write`` (a tensor written into a shard), ``rename`` (a file moved into OUT at the commit) or
``fsync`` of this process fail with ``enospc`` or ``eio``, ``kill`` the process with SIGKILL right there, or
``stall`` it there (for a test that acts on a running conversion).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from .errors import ExpqError, UsageError
from .manifest import MANIFEST
from .plan import OutTensor, Plan
from .source import INDEX_NAME

STAGING = ".expq-partial"
LOCK = ".lock"  # in the staging folder: the lock file, held (flock) by the conversion writing OUT
OWNER = ".owner"  # in the staging folder: that conversion's pid, for the message a second one prints
OLD = ".replaced"  # in the staging folder: an overwritten checkpoint, until the new one is in place
FAULT_ENV = "EXPQ_FAULT"


class OutputError(ExpqError):
    """Writing the output failed (disk full, permissions...); names the file and tensor."""


class _Faults:
    """The ``EXPQ_FAULT`` seam: counts writes, renames and fsyncs and fails the one it names."""

    def __init__(self, spec: str):
        self.rules: dict[str, tuple[int, str]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            point, n, action = part.split(":")
            self.rules[point] = (int(n), action)
        self.count: Counter = Counter()
        self.lock = threading.Lock()

    def hit(self, point: str) -> None:
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
        if action == "stall":  # hold everything as it is (a slow disk; a run to kill from outside)
            time.sleep(3600)
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code))


_faults = _Faults(os.environ.get(FAULT_ENV, ""))


def safetensors_header(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The header of a safetensors file holding ``tensors`` at their planned offsets: 8-byte little-endian length,
    then JSON padded with spaces to a multiple of 8 bytes (so the data area starts aligned)."""
    entries: dict = {"__metadata__": metadata or {"format": "pt"}}
    for o in sorted(tensors, key=lambda o: o.offset):
        entries[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [o.offset, o.offset + o.nbytes]}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


class OutputDir:
    """The output directory and its staging area.

    Args:
        out: the final directory. Must not exist, or be empty, unless ``overwrite``; ``overwrite`` replaces only a
            checkpoint an earlier ``expq convert`` wrote (one holding ``expq.json``), at ``commit``: the old one stays
            intact if the conversion fails, and is restored if moving the new files in fails.
        src_root: the source directory, which OUT may not be, contain, or sit inside.

    Raises:
        UsageError: OUT is a file, not empty without ``overwrite``, not an expq checkpoint with ``overwrite``,
            overlaps the source, or another conversion is writing it.
    """

    def __init__(self, out: str | Path, *, overwrite: bool = False, src_root: Path | None = None):
        self.out = Path(out).expanduser().absolute()
        if src_root is not None:
            s = src_root.resolve()
            o = self.out.resolve()
            if o == s or s in o.parents or o in s.parents:
                raise UsageError("OUT overlaps the source directory; the source is never modified", file=str(out))
        if self.out.exists() and not self.out.is_dir():
            raise UsageError("OUT exists and is not a directory", file=str(out))
        existing = sorted(p.name for p in self.out.iterdir() if p.name != STAGING) if self.out.is_dir() else []
        if existing and not overwrite:
            raise UsageError(f"OUT is not empty ({len(existing)} entries); pass --overwrite to replace it",
                             file=str(out))
        if existing and MANIFEST not in existing:
            raise UsageError("OUT is not empty and was not written by expq convert (no expq.json); refusing to "
                             "delete its contents", file=str(out))
        self._replace = existing
        self._created = not self.out.exists()
        self.staging = self.out / STAGING
        self.out.mkdir(parents=True, exist_ok=True)
        self._flock = self._lock()

    def _lock(self) -> FileLock:
        """Take the staging folder's lock, then clear what a killed run left in it."""
        self.staging.mkdir(exist_ok=True)
        lock = FileLock(self.staging / LOCK)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            try:
                pid = int((self.staging / OWNER).read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            raise UsageError(f"another expq convert (pid {pid}) is writing OUT", file=str(self.out)) from None
        for p in self.staging.iterdir():  # left by a run that was killed: we hold the lock, nobody else writes here
            if p.name != LOCK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (self.staging / OWNER).write_text(f"{os.getpid()}\n")
        return lock

    def path(self, name: str) -> Path:
        """The staging path of an output file (its final name, relative to OUT)."""
        p = self.staging / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_text(self, name: str, text: str) -> None:
        self.path(name).write_text(text)

    def copy_file(self, src: Path, name: str) -> None:
        shutil.copyfile(src, self.path(name))

    def _staged(self) -> list[str]:
        return sorted(rel for p in self.staging.rglob("*") if p.is_file()
                      and (rel := p.relative_to(self.staging).as_posix()) not in (LOCK, OWNER)
                      and not rel.startswith(OLD + "/"))

    def commit(self) -> None:
        """Move every staged file to its final name: shards and side files first, then the index, then config.json
        (a loader finds nothing usable until the last rename). An overwritten checkpoint is first moved aside into
        the staging folder, and moved back if anything fails; it is deleted only once the new one is in place."""
        staged = self._staged()
        old_dir = self.staging / OLD
        moved_old: list[str] = []
        moved_new: list[str] = []
        try:
            if self._replace:
                old_dir.mkdir()
                for name in self._replace:
                    _replace(self.out / name, old_dir / name)
                    moved_old.append(name)
            last = [n for n in (INDEX_NAME, "config.json") if n in staged]
            for name in [n for n in staged if n not in last] + last:
                dst = self.out / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                _replace(self.staging / name, dst)
                moved_new.append(name)
        except BaseException:
            for name in reversed(moved_new):  # put the new files back, then the old checkpoint back in place
                with contextlib.suppress(OSError):
                    os.replace(self.out / name, self.staging / name)
            for name in {n.split("/")[0] for n in moved_new}:
                p = self.out / name
                if p.is_dir() and not any(p.rglob("*")):
                    shutil.rmtree(p, ignore_errors=True)
            for name in moved_old:
                with contextlib.suppress(OSError):
                    os.replace(old_dir / name, self.out / name)
            raise
        self._release()

    def abort(self) -> None:
        """Remove the staging area (and OUT itself if this run created it and it is empty)."""
        self._release()
        if self._created:
            with contextlib.suppress(OSError):
                self.out.rmdir()

    def _release(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self._flock.release()


def _replace(src: Path, dst: Path) -> None:
    _faults.hit("rename")
    os.replace(src, dst)


def _bytes_of(data) -> memoryview:
    """The raw bytes of a tensor (any dtype, bfloat16 included) or a bytes-like object."""
    if isinstance(data, torch.Tensor):
        t = data.detach().cpu().contiguous()
        return memoryview(t.view(torch.uint8).numpy() if t.numel() else b"").cast("B")
    return memoryview(data).cast("B")


class ShardSet:
    """The output shards of a plan, opened on first write and closed (fsync'd) once all their tensors are written.

    ``write`` is thread-safe: workers on several devices write their tensors at their planned offsets.
    """

    def __init__(self, plan: Plan, outdir: OutputDir, fsync: bool = True):
        self.plan = plan
        self.outdir = outdir
        self.fsync = fsync
        self._members: list[list[OutTensor]] = [[] for _ in plan.shard_names]
        for o in plan.outputs:
            self._members[o.shard].append(o)
        self._fds: dict[int, tuple[int, int]] = {}  # shard -> (fd, data start)
        self._left = [len(m) for m in self._members]
        self._lock = threading.Lock()
        self.closed: list[int] = []

    def _open(self, k: int) -> tuple[int, int]:
        header = safetensors_header(self._members[k])
        path = self.outdir.path(self.plan.shard_names[k])
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + self.plan.shard_sizes[k])
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=str(path)) from None
        return fd, len(header)

    def target(self, out: OutTensor) -> tuple[int, int]:
        """(fd, absolute offset) where ``out``'s bytes go; opens the shard if needed."""
        with self._lock:
            if out.shard not in self._fds:
                self._fds[out.shard] = self._open(out.shard)
            fd, base = self._fds[out.shard]
        return fd, base + out.offset

    def write(self, out: OutTensor, data) -> None:
        """Write ``data`` (a tensor of ``out``'s dtype and shape, or exactly ``out.nbytes`` bytes) at ``out``'s place.

        Raises:
            OutputError: the write failed (names the shard and tensor).
        """
        mv = _bytes_of(data)
        if mv.nbytes != out.nbytes:
            raise RuntimeError(f"internal: {out.name} has {mv.nbytes} bytes, planned {out.nbytes}")
        fd, pos = self.target(out)
        try:
            _faults.hit("write")
            while mv.nbytes:
                n = os.pwrite(fd, mv, pos)
                mv, pos = mv[n:], pos + n
        except OSError as e:
            raise OutputError(f"cannot write: {e.strerror or e}", file=self.plan.shard_names[out.shard],
                              tensor=out.name) from None
        self.done(out)

    def done(self, out: OutTensor) -> None:
        """Mark ``out`` written (``write`` does this; call it after writing through ``target`` directly)."""
        with self._lock:
            self._left[out.shard] -= 1
            if self._left[out.shard] == 0:
                fd, _ = self._fds.pop(out.shard)
                try:
                    if self.fsync:
                        _faults.hit("fsync")
                        os.fsync(fd)
                finally:
                    os.close(fd)
                self.closed.append(out.shard)

    def close_all(self) -> None:
        """Close every open shard (after an error)."""
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def complete(self) -> bool:
        return all(n == 0 for n in self._left)


def index_json(plan: Plan) -> str:
    """``model.safetensors.index.json``: ``total_size`` (bytes of tensor data) and the sorted weight map."""
    weight_map = {o.name: plan.shard_names[o.shard] for o in sorted(plan.outputs, key=lambda o: o.name)}
    return json.dumps({"metadata": {"total_size": sum(plan.shard_sizes)}, "weight_map": weight_map}, indent=2) + "\n"


def config_json(config: dict, quantization_config: dict) -> str:
    """config.json: the source's, key order kept, with ``quantization_config`` set (a stale one is replaced)."""
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    cfg["quantization_config"] = quantization_config
    return json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"

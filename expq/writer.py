"""Laying down the output: shards written in place from the plan's offsets, the index, config and side files, all
under temporary names in ``OUT/.expq-partial/`` and renamed into ``OUT`` only when everything is complete.

A crash leaves at most the hidden staging folder, never a final-named partial file; an error removes it. Shards are
written positionally (the plan knows every tensor's offset before the first byte), so tensors can arrive in any
order from any device and no output shard is ever held in memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path

from .errors import ExpqError, UsageError


class OutputError(ExpqError):
    """Writing the output failed (disk full, permissions...); names the file and tensor."""
from .plan import OutTensor, Plan
from .source import INDEX_NAME

STAGING = ".expq-partial"
LOCK = ".lock"  # in the staging folder: the pid of the conversion writing OUT
OLD = ".replaced"  # in the staging folder: an overwritten checkpoint, until the new one is in place
MANIFEST = "expq.json"


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

    The staging folder doubles as a lock: a second conversion into the same OUT while one runs is refused.

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
        self._lock()

    def _lock(self) -> None:
        for _ in range(2):
            try:
                self.staging.mkdir()
                (self.staging / LOCK).write_text(f"{os.getpid()}\n")
                return
            except FileExistsError:
                try:
                    pid = int((self.staging / LOCK).read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and _alive(pid):
                    raise UsageError(f"another expq convert (pid {pid}) is writing OUT", file=str(self.out)) from None
                shutil.rmtree(self.staging, ignore_errors=True)  # left by a run that was killed
        raise UsageError("cannot create the staging folder (another run keeps recreating it)", file=str(self.out))

    def path(self, name: str) -> Path:
        """The staging path of an output file (its final name, relative to OUT)."""
        p = self.staging / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_text(self, name: str, text: str) -> None:
        self.path(name).write_text(text)

    def copy_file(self, src: Path, name: str) -> None:
        shutil.copyfile(src, self.path(name))

    def commit(self) -> None:
        """Move every staged file to its final name: shards and side files first, then the index, then config.json
        (a loader finds nothing usable until the last rename). An overwritten checkpoint is first moved aside into
        the staging folder, and moved back if anything fails; it is deleted only once the new one is in place."""
        staged = sorted(p.relative_to(self.staging).as_posix() for p in self.staging.rglob("*")
                        if p.is_file() and p.relative_to(self.staging).as_posix() not in (LOCK,)
                        and not p.relative_to(self.staging).as_posix().startswith(OLD + "/"))
        old_dir = self.staging / OLD
        moved_old: list[str] = []
        moved_new: list[str] = []
        try:
            if self._replace:
                old_dir.mkdir()
                for name in self._replace:
                    os.replace(self.out / name, old_dir / name)
                    moved_old.append(name)
            last = [n for n in (INDEX_NAME, "config.json") if n in staged]
            for name in [n for n in staged if n not in last] + last:
                dst = self.out / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.staging / name, dst)
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
        shutil.rmtree(self.staging, ignore_errors=True)

    def abort(self) -> None:
        """Remove the staging area (and OUT itself if this run created it and it is empty)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._created:
            try:
                self.out.rmdir()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        """Write ``data`` (a bytes-like object of exactly ``out.nbytes``) at ``out``'s place."""
        mv = memoryview(data).cast("B")
        if mv.nbytes != out.nbytes:
            raise RuntimeError(f"internal: {out.name} has {mv.nbytes} bytes, planned {out.nbytes}")
        fd, pos = self.target(out)
        try:
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

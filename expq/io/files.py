"""Files and folders expq makes, opens, renames, locks and deletes, never through a link it did not make.

Every primitive works on the name itself: opens use ``O_NOFOLLOW`` (creation adds ``O_CREAT | O_EXCL``, so a name
that already exists, link or not, is never written through), checks use ``lstat``, walks never descend through a
link, and deletions remove regular files and real folders only (``remove_tree`` deletes a link found inside as a
link, never what it points to). Names given here are expq's own (the staging folder, journal, lock... beside OUT):
a link at one of them is refused with ``LinkRefused``, one line naming it.

The lock (``open_lock``, ``try_lock``, ``take_lock``, ``let_go``) uses Linux open-file-description byte-range locks
(``F_OFD_SETLK``): they belong to the open file, not the process, are released by the OS when the process dies,
and two bytes of one file give two independent locks: ``WRITER`` (one conversion into an OUT at a time) and
``COMMIT`` (taken shared by readers of OUT: ``verify``, ``push``; exclusive by a conversion while it swaps OUT).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import stat
import struct
import time
from pathlib import Path
from typing import Iterator

from ..errors import SourceError, UsageError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
WRITER, COMMIT = 0, 1  # the lock file's bytes: see the module docstring
_F_RDLCK, _F_WRLCK, _F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages in the range, do not wait
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP)


class LinkRefused(UsageError):
    """A name expq would create, open, rename or delete is a symbolic link (or not the kind of entry expq makes
    there): refused, naming it and what it points to (exit status 2)."""


class Inside:
    """Where a source's files may resolve to: the checkpoint directory, and for a Hub cache snapshot the repo's
    ``blobs/`` folder (``snapshots/<sha>/../../blobs``)."""

    def __init__(self, root: Path, enabled: bool = True):
        self.root = root
        self.enabled = enabled
        real = root.resolve()
        self.allowed = [real]
        blobs = real.parent.parent / "blobs"
        if real.parent.name == "snapshots" and blobs.is_dir():
            self.allowed.append(blobs.resolve())

    def check(self, rel: str, what: str) -> None:
        """Refuse ``root/rel`` if it resolves outside the allowed folders (a link out), naming it and its target.

        Raises:
            SourceError: ``{what} resolves to TARGET, outside the checkpoint directory``.
        """
        if not self.enabled:
            return
        p = self.root / rel
        try:
            real = p.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop
            raise SourceError(f"{what} cannot be resolved ({e.strerror if isinstance(e, OSError) else e})",
                              file=str(p)) from None
        if not any(real.is_relative_to(a) for a in self.allowed):
            raise SourceError(f"{what} resolves to {real}, outside the checkpoint directory", file=str(p),
                              hint="copy the file into the checkpoint directory instead of linking to it")


def stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode) of a stat result: what says a file is still the one that was read (a
    write changes the size or the times, even one that puts the modification time back; a rename over it, the
    inode)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def lstat(path: Path) -> os.stat_result | None:
    """``os.lstat``, or None when nothing is there (nor can be: a part of the path is a file)."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def refuse_link(path: Path, what: str, hint: str) -> None:
    """Raise ``LinkRefused`` if ``path`` is a symbolic link (the message names it, its target, and ``hint``)."""
    if os.path.islink(path):
        raise LinkRefused(f"{what} is a symbolic link (to {_target(path)}); expq never writes, reads or deletes "
                          "through a link", file=str(path), hint=hint)


def _target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _refused(path: Path, hint: str) -> LinkRefused:
    st = lstat(path)
    if st is not None and stat.S_ISLNK(st.st_mode):
        return LinkRefused(f"a symbolic link (to {_target(path)}); expq never writes, reads or deletes through a link",
                           file=str(path), hint=hint)
    kind = "a folder" if st is not None and stat.S_ISDIR(st.st_mode) else "a special file" \
        if st is not None and not stat.S_ISREG(st.st_mode) else "a file"
    return LinkRefused(f"{kind} where expq did not expect one; left as it is", file=str(path), hint=hint)


# --- opening ----------------------------------------------------------------------------------------------------------
def open_read(path: Path, hint: str = "replace it with the file itself") -> int:
    """A read-only descriptor of the regular file ``path`` itself (never a link's target).

    Raises:
        LinkRefused: ``path`` is a link or not a regular file. OSError: as ``os.open`` (FileNotFoundError...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO does not hang the open
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(path, hint) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, hint)
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path) -> bytes:
    """The bytes of the regular file ``path`` (not followed through a link; see ``open_read``)."""
    fd = open_read(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def create(path: Path, mode: int = 0o644, *, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path``, created here (``O_CREAT | O_EXCL | O_NOFOLLOW``): nothing that was there, link or
    file, is ever opened.

    Raises:
        FileExistsError: something is there already. OSError: as ``os.open``.
    """
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)


def create_replacing_stale(path: Path, hint: str, mode: int = 0o644, *, flags: int = os.O_WRONLY) -> int:
    """``create``, after removing a regular file left at ``path`` (a temporary of an interrupted run).

    Raises:
        LinkRefused: a link (or a folder, or another special file) is there.
    """
    for _ in range(10):
        try:
            return create(path, mode, flags=flags)
        except FileExistsError:
            if not remove_file(path):
                raise _refused(path, hint) from None
    raise _refused(path, hint)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the descriptor's position."""
    mv = memoryview(data)
    while mv.nbytes:
        mv = mv[os.write(fd, mv):]


# --- checks and walks ------------------------------------------------------------------------------------------------
def walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under the folder ``root`` (relative POSIX path, its ``lstat``), folders before what they hold;
    a link is yielded as a link and never descended into."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for n in sorted(dirnames) + sorted(filenames):
            st = lstat(base / n)
            if st is not None:
                yield (base / n).relative_to(root).as_posix(), st


def regular_files(root: Path) -> list[str]:
    """The regular files under ``root`` (relative POSIX paths, sorted); links and special files are left out."""
    return sorted(rel for rel, st in walk(root) if stat.S_ISREG(st.st_mode))


def links(root: Path) -> list[str]:
    """The symbolic links under ``root`` (relative POSIX paths, sorted), none followed."""
    return sorted(rel for rel, st in walk(root) if stat.S_ISLNK(st.st_mode))


def not_regular(root: Path) -> list[str]:
    """Entries under ``root`` that are neither regular files nor folders (links, FIFOs, devices, sockets)."""
    return sorted(rel for rel, st in walk(root) if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)))


def is_real_dir(path: Path) -> bool:
    """``path`` is a folder itself (not a link to one)."""
    st = lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def holds_anything(path: Path) -> bool:
    """``path`` is a real folder (not a link to one) with at least one entry."""
    if not is_real_dir(path):
        return False
    with os.scandir(path) as it:
        return any(True for _ in it)


def is_mount_point(path: Path) -> bool:
    """``path`` (a real folder) is where a filesystem is mounted: its device differs from its parent folder's, or
    the kernel's mount table names it (a bind mount of the same filesystem)."""
    st = lstat(path)
    try:
        up = os.stat(path.parent)  # the parent as it resolves: a parent that is a link to another disk is fine
    except OSError:
        return False
    if st is None:
        return False
    if st.st_dev != up.st_dev or os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            points = {_unescape(line.split(b" ")[4]) for line in f}
    except OSError:
        return False
    return os.fsencode(os.path.realpath(path)) in points


KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
                                "bpf", "configfs", "efivarfs", "fusectl", "binfmt_misc", "devpts", "mqueue", "nsfs"})
"""Filesystems through which the kernel shows its own state: no file or folder of a user's can be made there."""


def kernel_filesystem(path: Path) -> str | None:
    """The type of the filesystem ``path`` (or, as it resolves, its nearest existing ancestor) is on, where it is
    one of ``KERNEL_FILESYSTEMS`` (``proc`` for ``/proc/self/out``), else None (also where the mount table cannot be
    read): there, making a file fails with an errno that says nothing true (``/proc``: "No such file or
    directory")."""
    here = os.fsencode(os.path.realpath(path))
    best, kind = b"", None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields, sep, rest = line.partition(b" - ")
                point = _unescape(fields.split(b" ")[4]) if sep else b""
                inside = here == point or here.startswith(point.rstrip(b"/") + b"/")
                if sep and inside and len(point) >= len(best):  # the longest; of equal ones the last (on top)
                    best, kind = point, os.fsdecode(rest.split(b" ")[0])
    except (OSError, IndexError):
        return None
    return kind if kind in KERNEL_FILESYSTEMS else None


def _unescape(field: bytes) -> bytes:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    out, i = bytearray(), 0
    while i < len(field):
        if field[i:i + 1] == b"\\" and field[i + 1:i + 4].isdigit():
            out.append(int(field[i + 1:i + 4], 8))
            i += 4
        else:
            out += field[i:i + 1]
            i += 1
    return bytes(out)


# --- deleting ---------------------------------------------------------------------------------------------------------
def remove_file(path: Path) -> bool:
    """Delete ``path`` if it is a regular file; True if it was one (or was removed meanwhile), False if nothing or
    something else (a link, a folder) is there: that is left alone."""
    st = lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return True


def remove_tree(path: Path, hint: str = "") -> None:
    """Delete the real folder ``path`` and everything in it (a link inside is deleted as a link, its target
    untouched); nothing if nothing is there.

    Raises:
        LinkRefused: ``path`` itself is a link or not a folder (left as it is).
    """
    st = lstat(path)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise _refused(path, hint)
    shutil.rmtree(path)  # fd-based on Linux: never follows a link inside


def make_dir(path: Path, hint: str = "") -> bool:
    """Make the folder ``path`` (its parent must exist); True if made here, False if a real folder was there.

    Raises:
        LinkRefused: a link or a file is there.
    """
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        if is_real_dir(path):
            return False
        raise _refused(path, hint) from None


# --- flushing and renaming --------------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush the file or folder ``path`` itself (a folder: its entries) to disk.

    Raises:
        LinkRefused: ``path`` is a link. OSError: as ``os.fsync``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(path, "") from None
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range of a file to disk now, without waiting (Linux ``sync_file_range``
    with ``SYNC_FILE_RANGE_WRITE``; a no-op elsewhere). A later fsync then has little left to wait for: the disk
    writes while the work goes on, where a plain ``write`` + ``fsync`` leaves it all to the end."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``: both names, never what
    a link points to); False where the filesystem (or the C library) cannot.

    Raises:
        OSError: any other failure (both names are then as they were).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange_supported(folder: Path) -> bool:
    """Whether the filesystem of ``folder`` (a real folder expq made) swaps entries atomically: two empty files
    are made in it, swapped and removed.

    Raises:
        OSError: the probe files cannot be made (disk full, permissions).
    """
    a, b = folder / ".expq-exchange-probe-a", folder / ".expq-exchange-probe-b"
    try:
        for p in (a, b):
            os.close(create_replacing_stale(p, "remove it"))
        return exchange(a, b)
    finally:
        for p in (a, b):
            remove_file(p)


# --- locks ------------------------------------------------------------------------------------------------------------
def open_lock(path: Path, *, create_it: bool = True) -> int | None:
    """A read-write descriptor of the lock file ``path`` (made if missing and ``create_it``), never through a link;
    None when it is missing and not made.

    Raises:
        LinkRefused: ``path`` is a link or not a regular file. OSError: as ``os.open``.
    """
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW | (os.O_CREAT if create_it else 0), 0o644)
    except FileNotFoundError:
        if create_it:
            raise
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(path, "remove it: expq makes its lock file itself") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(path, "remove it: expq makes its lock file itself")
    return fd


def try_lock(fd: int, byte: int, *, exclusive: bool) -> bool:
    """Take the lock on ``byte`` of the lock file (``WRITER`` or ``COMMIT``), shared or exclusive, without waiting;
    False if another open file holds a conflicting one. Taking it again on the same descriptor converts it."""
    return _ofd(fd, byte, _F_WRLCK if exclusive else _F_RDLCK)


def _ofd(fd: int, byte: int, kind: int) -> bool:
    flock = struct.pack("hhqqi4x", kind, os.SEEK_SET, byte, 1, 0)  # struct flock; l_pid 0 for OFD locks
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def same_file(fd: int, path: Path) -> bool:
    """The descriptor ``fd`` is still the file named ``path`` (it was not deleted or replaced meanwhile)."""
    st = lstat(path)
    f = os.fstat(fd)
    return st is not None and (st.st_dev, st.st_ino) == (f.st_dev, f.st_ino)


def take_lock(path: Path, out: Path) -> int:
    """The lock file's ``WRITER`` lock, exclusive, for a conversion into ``out``: taken, then re-checked against the
    path's inode (a holder deleting the file as it was opened never lets two runs in); the file then holds this
    process's pid. A reader of OUT deleting the file holds the lock for an instant: that is waited out.

    Raises:
        UsageError: another conversion holds it (naming its pid). LinkRefused: ``path`` is a symbolic link.
    """
    for attempt in range(200):
        fd = open_lock(path)
        if not try_lock(fd, WRITER, exclusive=True):
            try:
                pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
            except ValueError:
                pid = 0
            os.close(fd)
            if pid and _alive(pid) or attempt >= 40:
                raise UsageError(f"another expq convert (pid {pid}) is writing OUT", file=str(out)) from None
            time.sleep(0.05)  # a reader deleting the file, or a convert that has not written its pid yet
            continue
        if same_file(fd, path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the holder deleted it as we opened it: take the new one
    raise UsageError("cannot take the lock (it keeps changing)", file=str(out))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def let_go(fd: int, lock_path: Path) -> None:
    """Close a lock file descriptor, deleting the file first when nobody else holds either of its locks."""
    try:
        if try_lock(fd, WRITER, exclusive=True) and try_lock(fd, COMMIT, exclusive=True) \
                and same_file(fd, lock_path):
            remove_file(lock_path)
    finally:
        os.close(fd)

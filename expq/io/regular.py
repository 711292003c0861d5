"""Regular files only: opening an input after checking that it is a plain file (never blocking on a named pipe,
never reading a device without end), and hashing or copying it in bounded chunks, so that a file of any size (a
sparse 50 GiB side file included) costs a few MiB of memory.

Every function names the file in its error, with the error class its caller passes (``SourceError`` for a source
file, ``LayoutError`` for a layout...): one line, never an ``OSError`` of its own.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import threading
from pathlib import Path

from ..errors import ExpqError, SourceError

CHUNK = 16 << 20  # bytes read per step when hashing or copying


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words, for an error line (``a named pipe (FIFO)``, ``a directory``...)."""
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a regular file"


def check_regular(path: str | Path, what: str, error: type[ExpqError] = SourceError) -> os.stat_result:
    """``path`` (links followed) is a regular file: its ``stat``, read without opening it.

    Raises:
        ``error``: ``{what} is a named pipe (FIFO), not a regular file`` (a device, socket, directory likewise), or
            the file cannot be looked at (missing, no permission), naming ``path``.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise error(f"cannot read the {what}: {e.strerror or e}", file=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"cannot read the {what}: it is {kind_of(st.st_mode)}, not a regular file", file=str(path))
    return st


def open_regular(path: str | Path, what: str, error: type[ExpqError] = SourceError) -> int:
    """A read-only file descriptor on ``path``, once it is known to be a regular file: ``check_regular`` first, then
    ``open`` with ``O_NONBLOCK`` (a file swapped for a named pipe in between does not block the open) and ``fstat``
    of what was opened; ``O_NONBLOCK`` is cleared before the descriptor is returned. The caller closes it.

    Raises:
        ``error``: as ``check_regular``, or the open fails, naming ``path``.
    """
    check_regular(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "a socket, not a regular file" if e.errno == errno.ENXIO else (e.strerror or str(e))
        raise error(f"cannot open the {what}: {why}", file=str(path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"cannot read the {what}: it is {kind_of(mode)}, not a regular file", file=str(path))
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular(path: str | Path, what: str, limit: int, error: type[ExpqError] = SourceError) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (a larger one is refused before it is read).

    Raises:
        ``error``: not a regular file, unreadable, or larger than ``limit`` (names ``path`` and both sizes).
    """
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"cannot read the {what}: it is {size} bytes; at most {limit} are accepted", file=str(path))
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, min(CHUNK, limit + 1 - len(data)))):
            data += chunk
    except OSError as e:
        raise error(f"cannot read the {what}: {e.strerror or e}", file=str(path)) from None
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while being read
        raise error(f"cannot read the {what}: it grew past {limit} bytes while it was read", file=str(path))
    return data


def sha256_regular(path: str | Path, what: str, error: type[ExpqError] = SourceError,
                   cancel: threading.Event | None = None) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a regular file, read in ``CHUNK`` pieces (memory stays at one chunk).

    Raises:
        ``error``: not a regular file, or a read failed (EIO...), naming ``path``; or ``cancel`` was set (checked
            before each chunk).
    """
    fd = open_regular(path, what, error)
    h, size = hashlib.sha256(), 0
    try:
        while chunk := os.read(fd, CHUNK):
            if cancel is not None and cancel.is_set():
                raise error(f"hashing the {what} was stopped", file=str(path))
            h.update(chunk)
            size += len(chunk)
    except OSError as e:
        raise error(f"cannot read the {what}: {e.strerror or e}", file=str(path)) from None
    finally:
        os.close(fd)
    return size, h.hexdigest()


def copy_regular(src: str | Path, dst: str | Path, what: str, error: type[ExpqError] = SourceError,
                 dst_error: type[ExpqError] | None = None) -> None:
    """Copy a regular file's bytes into a new file ``dst`` (created or truncated, mode 0o644; never opened through a link) and fsync it, in
    chunks, keeping its holes: only the data ranges (``SEEK_DATA``/``SEEK_HOLE``) are copied, so a sparse file
    stays sparse and costs neither memory nor disk for its holes.

    Raises:
        ``error``: ``src`` is not a regular file or cannot be read, naming it. ``dst_error`` (default ``error``):
            ``dst`` cannot be written (disk full...), naming it.
    """
    dst_error = dst_error or error
    fd = open_regular(src, what, error)
    try:
        try:
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise dst_error(f"cannot write: {e.strerror or e}", file=str(dst)) from None
        try:
            size = os.fstat(fd).st_size
            for start, end in _data_ranges(fd, size):
                _copy_range(fd, out, start, end, src, dst, what, error, dst_error)
            try:
                os.ftruncate(out, size)
                os.fsync(out)
            except OSError as e:
                raise dst_error(f"cannot write: {e.strerror or e}", file=str(dst)) from None
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _data_ranges(fd: int, size: int):
    """The (start, end) byte ranges of ``fd`` that hold data; the whole file where holes cannot be asked for."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past pos: the rest is a hole
                return
            yield pos, size  # the filesystem cannot say: copy everything
            return
        yield start, min(end, size)
        pos = end


def _copy_range(fd: int, out: int, start: int, end: int, src, dst, what: str, error, dst_error) -> None:
    pos = start
    while pos < end:
        try:
            data = os.pread(fd, min(CHUNK, end - pos), pos)
        except OSError as e:
            raise error(f"cannot read the {what}: {e.strerror or e}", file=str(src)) from None
        if not data:
            raise error(f"cannot read the {what}: it shrank while it was copied", file=str(src))
        try:
            view = memoryview(data)
            while view.nbytes:
                n = os.pwrite(out, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            raise dst_error(f"cannot write: {e.strerror or e}", file=str(dst)) from None

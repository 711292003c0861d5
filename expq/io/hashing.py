"""Content hashes of files, read in bounded chunks: the sha256 (what expq.json and the journal record, and the LFS
oid the Hub lists for a large file) and the git blob id (what the Hub lists for a small file stored in git).

Both read the file once, ``CHUNK`` bytes at a time, so a file of any size costs a few MiB of memory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 16 << 20  # bytes read per step


def _digest(h, path: Path, follow_links: bool) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW))
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path, *, follow_links: bool = True) -> str:
    """The file's sha256 (64 hex digits), as the Hub computes LFS oids. ``follow_links=False``: a symbolic link at
    ``path`` is not opened (``O_NOFOLLOW``: ELOOP), for files in OUT, which expq reads only as it wrote them.

    Raises:
        OSError: the file cannot be read (or is a link and ``follow_links`` is False).
    """
    return _digest(hashlib.sha256(), path, follow_links)


def git_blob_id(path: Path, *, follow_links: bool = True) -> str:
    """The file's git blob id (40 hex digits: sha1 of ``blob <size>\\0`` + content), as the Hub reports it for a
    file stored in git rather than LFS; ``follow_links`` as for ``sha256_file``.

    Raises:
        OSError: the file cannot be read.
    """
    size = os.stat(path, follow_symlinks=follow_links).st_size
    return _digest(hashlib.sha1(b"blob %d\0" % size), path, follow_links)

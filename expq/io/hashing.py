"""Content hashes of files, read in bounded chunks: the sha256 (what expq.json and the journal record, and the LFS
oid the Hub lists for a large file) and the git blob id (what the Hub lists for a small file stored in git).

Both read the file once, ``CHUNK`` bytes at a time, so a file of any size costs a few MiB of memory.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 16 << 20  # bytes read per step


def _digest(h, path: Path) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    """The file's sha256 (64 hex digits), as the Hub computes LFS oids.

    Raises:
        OSError: the file cannot be read.
    """
    return _digest(hashlib.sha256(), path)


def git_blob_id(path: Path) -> str:
    """The file's git blob id (40 hex digits: sha1 of ``blob <size>\\0`` + content), as the Hub reports it for a
    file stored in git rather than LFS.

    Raises:
        OSError: the file cannot be read.
    """
    return _digest(hashlib.sha1(b"blob %d\0" % Path(path).stat().st_size), path)

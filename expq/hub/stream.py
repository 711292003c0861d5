"""``--stream``: converting a Hub repo whose source and output do not fit on the disk together.

The plan is made from the shards' headers alone (``hub.download.read_remote_header``: ranged reads, no tensor data);
the side files (config, tokenizer, index...) are downloaded first. Then ``StreamFeeder``, the pipeline's
``SourceFeeder`` for ``--stream``, downloads the shards in the order the pipeline will read them, one at a time in a background
thread, into ``.<OUT>.expq-stream/`` beside OUT (the same filesystem as the output), keeping at most ``ahead``
shards downloaded ahead of the ones being converted, and deletes each shard once every job reading it has written
its outputs. So the stream folder holds at most ``ahead + 1`` shards (plus the side files) at any time; with one
device that bound is exact; with several, a worker that needs a shard beyond that window has it fetched at once
rather than wait, which can add one shard per such worker.

Every shard comes from the one commit the listing resolved, and is checked after the download: its size, and its
sha256 against the LFS oid of the listing (the git blob id for a file stored in git). A kill or an interrupt keeps
the stream folder: the same command again resumes. The output journal keeps the finished output shards (their
source shards are not downloaded again), a complete shard already in the stream folder is reused once its sha256
matches, and partial downloads are removed and fetched again. After a successful conversion (and after any error
that leaves nothing to resume) the stream folder is removed. The Hub cache is not written.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
import threading
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ExpqError, HubError, OutputError, UsageError
from ..interrupts import STOP
from ..io import files
from ..options import is_repo_id
from ..source import RemoteShards, Source, open_source
from .download import StreamListing, fetch_listing, read_remote_header
from .errors import translate

STREAM = ".expq-stream"
LOCK = ".expq-lock"  # inside the stream folder: one run at a time uses it
HF_DOWNLOADS = Path(".cache") / "huggingface" / "download"  # where hf_hub_download(local_dir=...) writes partials
DEFAULT_AHEAD = 2


def stream_folder(out: str | Path) -> Path:
    """Where ``--stream`` downloads the shards of a conversion into ``out``: ``.<OUT-name>.expq-stream`` beside
    OUT (as the staging folder ``.<OUT-name>.expq-partial``)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{STREAM}"


def open_stream(src: str, out: str | Path, *, revision: str | None = None, token: str | bool | None = None,
                ahead: int | None = None) -> tuple[Source, "StreamFeeder"]:
    """Open a Hub repo for a streamed conversion into ``out``, downloading no shard: take the stream folder (a
    lock: one run at a time), list the revision, download the side files into the folder, read every shard's
    header remotely, and validate the whole source as ``source.open_source`` does.

    Args:
        ahead: shards downloaded ahead of the ones being converted (None: ``DEFAULT_AHEAD``, 2).

    Returns:
        (the Source, rooted at the stream folder, where the shards will appear; the StreamFeeder that will fetch
        them: hand it to the pipeline, then ``remove()`` or ``release()`` it).

    Raises:
        UsageError: ``src`` is a local directory (``--stream`` is for Hub repos) or not a repo id; another run holds
            the stream folder.
        SourceError, HubError: as ``download.fetch_listing``, ``download.read_remote_header`` and
            ``source.open_source``.
    """
    local = Path(src).expanduser()
    if local.exists():
        kind = "directory" if local.is_dir() else "file"
        raise UsageError(f"--stream applies to Hub repo ids; SRC is a local {kind} (convert it without --stream)",
                         file=str(src))
    if not is_repo_id(src):
        raise UsageError("--stream needs a Hub repo id (org/name)", file=str(src))
    folder = stream_folder(out)
    created = not folder.exists()
    lock = _take(folder, Path(out))
    try:
        listing = fetch_listing(src, folder, revision=revision, token=token)
        _drop_other_files(folder, listing)
        remote = RemoteShards(sorted(listing.weights),
                              lambda rel: read_remote_header(listing, rel, folder / rel))
        source = open_source(folder, repo_id=src, revision=listing.revision, commit=listing.commit, remote=remote)
        source.hub_sha256 = {f: w.sha256 or w.blob_id or "" for f, w in listing.weights.items()}
    except BaseException:
        _let_go(folder, lock, delete=created)
        raise
    return source, StreamFeeder(listing, folder, lock, ahead=DEFAULT_AHEAD if ahead is None else ahead)


@contextlib.contextmanager
def streamed(src: str, out: str | Path, *, revision: str | None = None, token: str | bool | None = None,
             keep: Callable[[BaseException], bool], ahead: int | None = None
             ) -> Iterator[tuple[Source, "StreamFeeder"]]:
    """``open_stream`` for the length of a conversion: on success the stream folder is removed; after an error
    for which ``keep(error)`` is true (the same command resumes) it is kept, else removed."""
    source, feeder = open_stream(src, out, revision=revision, token=token, ahead=ahead)
    try:
        yield source, feeder
    except BaseException as e:
        feeder.release() if keep(e) else feeder.remove()
        raise
    feeder.remove()


_FOLDER_HINT = ("expq downloads into this folder and deletes what it downloaded, so it must be a real folder: remove "
                "the link (to stream onto another disk, give an OUT on that disk)")


def _take(folder: Path, out: Path) -> int:
    """Create the stream folder if needed and lock it (``io.files.take_lock``: released by the OS if the process
    dies); a link there, or inside it, is refused (expq downloads into it and deletes from it).

    Raises:
        UsageError: another run holds it. LinkRefused: the folder, or an entry in it, is a link or a special file.
    """
    files.refuse_link(folder, "the stream folder", _FOLDER_HINT)
    for _ in range(10):
        folder.parent.mkdir(parents=True, exist_ok=True)
        files.make_dir(folder, _FOLDER_HINT)
        try:
            fd = files.take_lock(folder / LOCK, out)
        except FileNotFoundError:  # a run that just finished removed the folder: make it again
            continue
        odd = files.not_regular(folder)
        if odd:
            files.let_go(fd, folder / LOCK)
            raise files.LinkRefused(f"the stream folder holds {odd[0]}, a link or a special file expq did not make; "
                                    "expq never downloads, reads or deletes through a link", file=str(folder),
                                    hint=_FOLDER_HINT)
        return fd
    raise UsageError("cannot lock the stream folder (it keeps being removed)", file=str(folder))


def _drop_other_files(folder: Path, listing: StreamListing) -> None:
    """Remove the files (not hidden) of the stream folder that this revision does not have: side files of a run of
    another revision must not be copied into OUT. (``_take`` refused links in it: nothing here follows one.)"""
    wanted = set(listing.weights) | set(listing.side)
    for rel, st in sorted(files.walk(folder), reverse=True):
        if rel.startswith(".") or "/." in rel:
            continue
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                (folder / rel).rmdir()  # only if empty
        elif rel not in wanted:
            files.remove_file(folder / rel)


class _Cancelled(Exception):
    """The stream was closed during a download."""


class _Meter:
    """Stands in for huggingface_hub's progress bar during one download (``tqdm_class``): shows nothing, and stops
    the download (at its next chunk) once the stream is closing or the run is interrupted (``interrupts.STOP``)."""

    def __init__(self, closing: threading.Event, *args, **kwargs):
        self.closing = closing

    def update(self, n: float = 1) -> None:
        if self.closing.is_set() or STOP.is_set():
            raise _Cancelled()

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Meter":
        return self

    def __exit__(self, *exc) -> bool:
        return False


class StreamFeeder:
    """The pipeline's ``SourceFeeder`` for ``--stream``: downloads the shard files into the stream folder ahead of
    the conversion and deletes each once converted (see the module docstring).

    ``start(files)``: fetch these files in this order, in one background thread; a file starts downloading when at
    most ``ahead`` shards are on disk and not yet done (so at most ``ahead + 1`` are). ``wait(file)``: block until
    the file is complete and checked (a file not being downloaded yet is fetched next, past the window, rather than
    waited for). ``done(file)``: delete it. ``close()``: stop the thread.

    Attributes:
        peak_bytes: the most bytes (file sizes) the stream folder held at once during this run: side files, shards,
            partial downloads and huggingface_hub's bookkeeping. Sampled just before each deletion and after each
            download, which is where the maximum lies.
        downloaded: the shards this run fetched from the Hub, in order (not the complete shards an earlier run left
            in the folder, kept because their sha256 matched).
    """

    def __init__(self, listing: StreamListing, folder: Path, lock_fd: int | None, *,
                 ahead: int = DEFAULT_AHEAD):
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.listing, self.folder, self.ahead = listing, folder, ahead
        self._lock_fd = lock_fd
        self._cv = threading.Condition()
        self._queue: list[str] = []  # files still to fetch, in order; urgent ones moved to the front
        self._urgent: set[str] = set()
        self._state: dict[str, str] = {}  # file -> "queued" | "fetching" | "ready" | "done"
        self._error: BaseException | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_bytes = folder_bytes(folder) if folder.is_dir() else 0  # the side files, already there
        self.downloaded: list[str] = []

    # --- SourceFeeder ------------------------------------------------------------------------------------------------
    def start(self, wanted: list[str]) -> None:
        """Fetch ``files`` (shard paths, in the order the pipeline first reads them). Shards of the folder that are
        not among them (an earlier run converted them) and partial downloads are removed first."""
        unknown = [f for f in wanted if f not in self.listing.weights]
        if unknown:
            raise RuntimeError(f"internal: {unknown[0]} is not a weight file of {self.listing.repo}")
        for rel in sorted(set(self.listing.weights) - set(wanted)):
            files.remove_file(self.folder / rel)
        partials = self.folder / HF_DOWNLOADS
        for rel in files.regular_files(partials) if files.is_real_dir(partials) else []:
            if rel.endswith(".incomplete"):
                files.remove_file(partials / rel)
        with self._cv:
            self._queue = list(dict.fromkeys(wanted))
            self._state = {f: "queued" for f in self._queue}
            self._sample()
        self._thread = threading.Thread(target=self._run, name="expq-stream", daemon=True)
        self._thread.start()

    def wait(self, file: str) -> None:
        """Return once ``file`` is complete and checked under the stream folder.

        Raises:
            HubError: its download (or an earlier one: the stream stops at the first failure) failed: the Hub's
                errors as ``hub.errors.translate`` names them, or a size or sha256 that differs from the listing.
            OutputError: the stream folder cannot be written (disk full...).
            Interrupted: the run was interrupted (``interrupts.STOP``, set by convert's signal handlers) meanwhile.
        """
        if file not in self.listing.weights:
            raise RuntimeError(f"internal: {file} is not a weight file of {self.listing.repo}")
        with self._cv:
            if self._state.get(file) in (None, "done"):  # not scheduled (or read again): fetch it
                self._state[file] = "queued"
                self._queue.append(file)
            if self._state[file] == "queued":
                self._queue.remove(file)
                self._queue.insert(0, file)
                self._urgent.add(file)
                self._cv.notify_all()
            while self._state[file] != "ready":
                if self._error is not None:
                    raise self._error
                if STOP.is_set():  # a signal: the worker stops here instead of after the download
                    raise STOP.interrupted()
                if self._closing.is_set():
                    raise RuntimeError(f"internal: waiting for {file} after the stream was closed")
                self._cv.wait(0.1)  # STOP cannot notify this condition: look at it ten times a second

    def done(self, file: str) -> None:
        """No job reads ``file`` any more: delete it (the next download may start)."""
        with self._cv:
            self._sample()  # the folder's largest just before a deletion
            files.remove_file(self.folder / file)
            self._state[file] = "done"
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the background thread: a download in progress stops at its next chunk. Waits at most 2 s: a request
        stuck on the network is left to its (daemon) thread, whose partial file the next ``start`` removes."""
        self._closing.set()
        with self._cv:
            self._cv.notify_all()
        thread, self._thread = self._thread, None  # a second close (release, remove) does not wait again
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)

    # --- the end of a run --------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop, and give up the stream folder, keeping it (a re-run resumes from it)."""
        self.close()
        lock, self._lock_fd = self._lock_fd, None
        _let_go(self.folder, lock, delete=False)

    def remove(self) -> None:
        """Stop, and delete the stream folder (nothing left to resume from it)."""
        self.close()
        lock, self._lock_fd = self._lock_fd, None
        _let_go(self.folder, lock, delete=True)

    # --- the background thread ---------------------------------------------------------------------------------------
    def _next(self) -> str | None:
        """The next file to fetch, once the window allows it (an urgent one at once); None once the stream is
        closed or has failed."""
        with self._cv:
            while True:
                if self._closing.is_set() or self._error is not None:
                    return None
                f = self._queue[0] if self._queue else None
                held = sum(1 for s in self._state.values() if s in ("fetching", "ready"))
                if f is not None and (f in self._urgent or held <= self.ahead):
                    self._queue.pop(0)
                    self._urgent.discard(f)
                    self._state[f] = "fetching"
                    return f
                self._cv.wait()

    def _run(self) -> None:
        while (f := self._next()) is not None:
            try:
                reused = self._fetch(f)
            except _Cancelled:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the workers through wait()
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._state[f] = "ready"
                if not reused:
                    self.downloaded.append(f)
                self._sample()  # the folder's largest at the end of a download
                self._cv.notify_all()

    def _fetch(self, rel: str) -> bool:
        """Make ``rel`` complete and checked in the folder; True when a complete file of an earlier run was reused.

        Raises:
            HubError: the download failed, or the downloaded file's size or hash differs from the listing (the file
                is deleted). OutputError: the folder cannot be written.
        """
        path = self.folder / rel
        st = files.lstat(path)
        if st is not None and stat.S_ISREG(st.st_mode):
            if self._check(rel) is None:
                return True
            files.remove_file(path)
        self._download(rel)
        problem = self._check(rel)
        if problem is not None:
            files.remove_file(path)
            raise HubError(problem, repo=self.listing.repo, revision=self.listing.revision, file=rel,
                           hint="re-run the same command to download it again; if it persists, the repo's copy "
                                "is corrupt")
        return False

    def _check(self, rel: str) -> str | None:
        try:
            return self.listing.weights[rel].mismatch(self.folder / rel)
        except OSError as e:
            raise OutputError(f"cannot read the downloaded file: {e.strerror or e}",
                              file=str(self.folder / rel)) from None

    def _download(self, rel: str) -> None:
        """``hf_hub_download`` of one shard into the folder, pinned to the listing's commit."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError

        lst = self.listing
        try:
            hf_hub_download(lst.repo, rel, revision=lst.commit, token=lst.token, local_dir=self.folder,
                            tqdm_class=functools.partial(_Meter, self._closing), endpoint=lst.endpoint)
        except (_Cancelled, ExpqError):
            raise
        except Exception as e:  # noqa: BLE001 - classified below; what is not a Hub failure is re-raised
            sizes = re.search(r"should be of size (\d+) but has size (\d+)", str(e))
            if sizes:  # huggingface_hub's own size check
                raise HubError(f"downloaded {sizes[2]} bytes but the Hub lists {sizes[1]}", repo=lst.repo,
                               revision=lst.revision, file=rel,
                               hint="re-run the same command to download it again") from None
            if isinstance(e, OSError) and e.errno in _LOCAL_ERRNOS and not isinstance(e, HfHubHTTPError):
                raise OutputError(f"cannot download into the stream folder: {e.strerror or e}",
                                  file=str(self.folder / rel)) from None
            raise translate(e, repo=lst.repo, revision=lst.revision, file=rel, token=lst.token) from None

    def _sample(self) -> None:
        """Update ``peak_bytes`` with what the folder holds now (call with ``_cv`` held)."""
        self.peak_bytes = max(self.peak_bytes, folder_bytes(self.folder))


def _let_go(folder: Path, lock_fd: int | None, *, delete: bool) -> None:
    """Give up the stream folder's lock, deleting the folder (``delete``) or only the lock file."""
    if delete:
        with contextlib.suppress(OSError, UsageError):
            files.remove_tree(folder)
    if lock_fd is not None:
        files.let_go(lock_fd, folder / LOCK)


_LOCAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


def folder_bytes(folder: Path) -> int:
    """The bytes (sum of file sizes) under ``folder``, each file counted once even if a download is moved into
    place meanwhile: partial downloads are looked at first, and files are counted by inode."""
    seen: set[int] = set()
    total = 0
    for top in (folder / HF_DOWNLOADS, folder):
        for dirpath, _, names in os.walk(top):
            for n in names:
                try:
                    st = os.lstat(os.path.join(dirpath, n))
                except FileNotFoundError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total

"""OUT and what expq keeps beside it: a staging folder, a journal that makes a killed run resumable, a lock, and
one commit point.

* **Names beside OUT.** ``.<OUT>.expq-partial/`` (staging), ``.<OUT>.expq-journal.json`` (and its ``.tmp``) and
  ``.<OUT>.expq-lock``, in OUT's parent. None is ever followed when it is a symbolic link: it is refused, naming it
  (``io.files``). OUT itself may not be a link or a mount point (the commit renames a folder onto it).
* **Staging and journal.** The new checkpoint is built in the staging folder. The journal records the run's
  settings fingerprint and, for every output file finished and fsync'd, its size and sha256. A re-run with the same
  settings keeps the files whose content still matches (checked by hash, never by name) and redoes the rest;
  different settings are refused unless ``--overwrite``.
* **One commit point.** When every file is written and fsync'd (and the staging folder too), the staging folder is
  swapped in with one rename: onto a missing or empty OUT, or, replacing an earlier expq output, by an atomic
  exchange of the two directories (``renameat2(RENAME_EXCHANGE)``; a filesystem without it is refused before the
  conversion starts, as OUT would be missing for a moment); the old checkpoint is then deleted. A model card in OUT
  that is not the one the old checkpoint was converted with (``PUSH_WRITES``: a push or a user wrote it) is copied
  into the staging folder just before the exchange, so it is carried across. At every instant OUT holds the complete
  old checkpoint or the complete new one. The journal records the staged folder's inode, so the next start tells
  whether a killed commit happened (OUT is that folder: the old one left under the staging name is deleted) or not
  (the staging folder is resumed).
* **Lock.** ``.<OUT>.expq-lock`` holds two locks (``io.files``): ``WRITER``, exclusive, for the whole run (one
  conversion per OUT; released by the OS when the process dies; re-checked against the path's inode after it is
  taken, so deleting it at the end never lets two runs in), and ``COMMIT``, exclusive while OUT is swapped and the
  old checkpoint deleted, shared by readers of OUT (``reading``: verify, push), so that no reader sees OUT change
  under it. The last one out deletes the file. ``filelock`` is not used: its lock file cannot be deleted safely.
* **Interrupts.** ``STOP`` is set by convert's signal handlers; workers finish the tensor in hand and stop; files not
  finished are removed; the journal stays consistent.

The output shards themselves are written by ``shards.ShardSet``, which records each finished one here
(``OutputDir.record``). Every flush and the commit's rename pass the ``EXPQ_FAULT`` seam (``faults``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

from ..errors import ExpqError, OutputError, UsageError
from ..interrupts import STOP, conversion_committed
from ..io import files
from ..io.hashing import sha256_file
from ..manifest import MANIFEST, PUSH_WRITES, ManifestFile, OutFiles, files_against_manifest, manifest_intact
from ..source import read_config
from . import faults

PARTIAL = ".expq-partial"
JOURNAL = ".expq-journal.json"
LOCK = ".expq-lock"

_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC  # an output file, never via a link


def fsync_path(path: Path) -> None:
    """Flush a file or a directory (its entries) to disk (``io.files.fsync_path``; the ``fsync`` fault point).

    Raises:
        OutputError: the flush failed (EIO, ENOSPC...), naming ``path``.
    """
    with naming(path, "cannot flush to disk"):
        faults.hit("fsync")
        files.fsync_path(path)


@contextlib.contextmanager
def naming(path: Path | str, what: str = "cannot write"):
    """Turn an ``OSError`` raised inside into an ``OutputError`` naming ``path``: ``{what}: {strerror}``."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{what}: {e.strerror or e}", file=str(path)) from None


def beside(out: Path, suffix: str) -> Path:
    """The name ``.<OUT-name><suffix>`` beside OUT, where expq keeps its staging folder, journal and lock."""
    return out.parent / f".{out.name}{suffix}"


def is_fresh(out: str | Path) -> bool:
    """OUT is missing or an empty folder, and no journal of an earlier run lies beside it: there are no earlier
    settings to compare a run's with, so they may be settled while it writes (``OutputDir(settled=False)``)."""
    p = Path(out).expanduser().absolute()
    st = files.lstat(p)
    try:
        if st is not None and (not stat.S_ISDIR(st.st_mode) or os.listdir(p)):
            return False
    except OSError:
        return False
    return files.lstat(beside(p, JOURNAL)) is None


def check_out_location(out: str | Path) -> None:
    """Refuse an OUT the commit cannot rename a folder onto: a symbolic link (the rename would replace the link, not
    what it points to) or a mount point (a rename cannot cross filesystems; the staging folder is in OUT's parent).

    Raises:
        UsageError: naming OUT and saying what to give instead.
    """
    p = Path(out).expanduser().absolute()
    longest = f".{p.name}{JOURNAL}.tmp"  # the longest name expq gives a file beside OUT
    limit = _name_max(p.parent)
    if len(os.fsencode(longest)) > limit:
        room = limit - len(os.fsencode(longest)) + len(os.fsencode(p.name))
        raise UsageError(f"OUT's name is {len(os.fsencode(p.name))} bytes: the files expq keeps beside OUT while it "
                         f"works (.<OUT>{JOURNAL}.tmp and others) would exceed this filesystem's {limit}-byte limit "
                         "on a name", file=str(out), hint=f"give OUT a name of at most {max(room, 1)} bytes")
    if os.path.islink(p):
        raise UsageError(f"OUT is a symbolic link (to {os.readlink(p)}); expq replaces OUT by renaming a folder onto "
                         "it, which would replace the link", file=str(out),
                         hint=f"give the folder it points to as OUT: {os.path.realpath(p)}")
    if files.is_real_dir(p) and files.is_mount_point(p):
        raise UsageError("OUT is a mount point (another filesystem than its parent's); expq builds the new checkpoint "
                         "beside OUT and renames it into place, which cannot cross filesystems", file=str(out),
                         hint=f"convert into a folder inside it, e.g. {p / 'model'}")


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the filesystem of ``folder`` (or of its nearest existing ancestor) takes; 255
    where the OS cannot say."""
    for d in (folder, *folder.parents):
        try:
            return os.pathconf(d, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return 255


def _not_a_folder(path: Path) -> Path | None:
    """The first of ``path`` and its ancestors, from the root down, that exists and is not a folder (a file where
    OUT's folder would be made: ``mkdir`` says only "File exists"), or None."""
    for p in (*reversed(path.parents), path):
        try:
            if not stat.S_ISDIR(os.stat(p).st_mode):
                return p
        except OSError:
            return None
    return None


def _why_not_writable(folder: Path, e: OSError) -> str:
    """Why nothing could be made in ``folder`` (``e``: the error of making it, or a file in it), in true words: a
    file where a folder of the path should be, or a filesystem of the kernel's (``/proc``, ``/sys``: their errno
    says "No such file or directory" or "Permission denied"), else ``e``'s own text."""
    blocker = _not_a_folder(folder)
    if blocker is not None:
        return f"{blocker} is not a folder"
    kind = files.kernel_filesystem(folder)
    if kind is not None:
        return f"it is in the kernel's {kind} filesystem, where no file can be made"
    return e.strerror or str(e)


class OutputDir:
    """The output directory, its staging folder, journal and lock (see the module docstring).

    Args:
        out: the final directory. Must not exist, be empty, hold an earlier expq output with the same settings (then
            ``up_to_date`` tells whether there is anything to do), or, with ``overwrite``, an earlier expq output.
        fingerprint: the run's settings (what makes two runs the same: source identity, options, expq version); a
            JSON-ready dict.
        settled: False when ``fingerprint`` is not final yet (a fresh OUT, ``is_fresh``, whose source identity is
            hashed while the run writes): ``settle`` gives the final one; a partial run left before then is
            discarded by the next run, never resumed.
        src_root: the source directory, which OUT may not be, contain, or sit inside.

    Raises:
        UsageError: OUT is a file, a symbolic link or a mount point, holds anything expq did not write, holds an expq
            output (or a partial run) with other settings without ``overwrite`` (the message names what differs),
            overlaps the source, or another conversion is writing it; one of expq's names beside OUT is a link.
    """

    def __init__(self, out: str | Path, *, fingerprint: dict, overwrite: bool = False, src_root: Path | None = None,
                 settled: bool = True):
        self.out = Path(out).expanduser().absolute()
        self.fingerprint = fingerprint
        self.settled = settled  # False: ``fingerprint`` waits for ``settle`` (until then a partial run never resumes)
        self.overwrite = overwrite
        _check_location(self.out, src_root, out)
        check_out_location(self.out)
        parent = self.out.parent
        self.staging = beside(self.out, PARTIAL)
        self.journal_path = beside(self.out, JOURNAL)
        self.journal_tmp = beside(self.out, JOURNAL + ".tmp")
        self.lock_path = beside(self.out, LOCK)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = files.take_lock(self.lock_path, self.out)
        except OSError as e:
            why = _why_not_writable(parent, e)
            raise UsageError(f"cannot write beside OUT in {parent} ({why}): expq keeps its lock, journal and partial "
                             "output there", file=str(self.out)) from None
        self._journal_lock = threading.Lock()
        self.warnings: list[str] = []  # what went wrong after the commit (the new checkpoint is in place)
        self.committed = False  # the new checkpoint is OUT (``commit`` renamed it into place)
        self.kept_files: dict[str, dict] = {}  # a resumed run's finished files: name -> {size, sha256}
        self._journal: dict = {}
        self.existing: ManifestFile | None = None  # OUT's expq.json, read once by _check_out (None: none, or not expq's)
        self.out_files: OutFiles | None = None  # OUT's files against it (None: it lists none)
        try:
            files.refuse_link(self.staging, "the staging folder", _STAGING_HINT)
            for p in (self.journal_path, self.journal_tmp):
                files.refuse_link(p, "the journal", "remove it: expq makes its journal itself (an interrupted run "
                                                    "cannot then be resumed)")
            self._recover()
            self._check_out()
        except BaseException:
            self.release()
            raise

    def start(self) -> None:
        """Begin writing: resume a partial run with the same settings (``kept_files``: the files whose content still
        matches the journal) or start afresh.

        Raises:
            UsageError: a partial run with other settings waits (without ``overwrite``); the staging folder holds
                files expq did not write, or a link; OUT must be replaced and holds documentation a user added (it
                would be deleted), or its filesystem cannot swap two folders atomically.
        """
        try:
            self._refuse_foreign(self.out_files.not_carried() if self.out_files is not None else [])
            self.kept_files = self._start()
        except BaseException:
            self.release()
            raise

    def finish_up_to_date(self) -> None:
        """OUT already holds this conversion: drop a stale partial run of the same settings, give up the lock."""
        j = self._read_journal()
        if j is not None and j.get("fingerprint") == self.fingerprint:
            self.discard()
            return
        if j is None:
            self._drop_journal()  # a journal write cut short before it was ever complete
            if files.is_real_dir(self.staging) and not files.holds_anything(self.staging):
                self.staging.rmdir()
        self.release()

    # --- start: recover an interrupted commit, check OUT, resume ---------------------------------------------------
    def _recover(self) -> None:
        """Finish a commit that a kill interrupted, from the journal: if OUT is the folder that was staged, the
        commit happened (delete the old checkpoint left under the staging name, and the journal); if not, it did not,
        and the staging folder is still the new checkpoint, to resume."""
        j = self._read_journal()
        if j is None or j.get("phase") != "swap":
            return
        st = files.lstat(self.out)
        if st is not None and [st.st_dev, st.st_ino] == j.get("staged"):
            files.remove_tree(self.staging, _STAGING_HINT)
            self._drop_journal()
        else:
            self._write_journal(j, phase="writing")

    def _check_out(self) -> None:
        """OUT is missing, an empty folder, or an expq output holding nothing expq did not write (the model card a
        push writes excepted), with the same settings unless ``overwrite``."""
        st = files.lstat(self.out)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UsageError("OUT exists and is not a directory", file=str(self.out))
        entries = sorted(os.listdir(self.out)) if st is not None else []
        if not entries:
            return
        if MANIFEST not in entries:
            raise UsageError("OUT is not empty and was not written by expq convert (no expq.json); refusing to "
                             "delete its contents", file=str(self.out))
        with contextlib.suppress(ExpqError):
            self.existing = ManifestFile.read(self.out)
        old = self.existing.record.settings if self.existing is not None else None
        if self.existing is not None and self.existing.record.files:
            self.out_files = files_against_manifest(self.out, self.existing.record)
            # documentation a user added stays through a run with nothing to do; other settings mean a rebuild
            self._refuse_foreign(list(self.out_files.unlisted) +
                                 (self.out_files.not_carried() if old != self.fingerprint else []))
        if old != self.fingerprint and not self.overwrite:
            raise UsageError(f"OUT holds an expq conversion with other settings ({_differences(old, self.fingerprint)})"
                             "; pass --overwrite to replace it", file=str(self.out))

    def _refuse_foreign(self, foreign: list[str]) -> None:
        """Refuse to replace an OUT holding ``foreign`` entries (what expq did not write), which would delete them."""
        if foreign:
            raise UsageError(f"OUT holds {len(foreign)} file(s) expq did not write (e.g. {foreign[0]}); refusing to "
                             "replace it, which would delete them: move them out of OUT first", file=str(self.out))

    def up_to_date(self) -> bool:
        """Whether OUT already holds exactly this conversion: same settings, and every file the manifest lists is
        there with its size and sha256 (content checked, not names), and nothing else
        (``manifest.files_against_manifest``: the model card a push writes is not compared, it is kept)."""
        m = self.existing
        if m is None or m.record.settings != self.fingerprint or self.out_files is None:
            return False
        try:
            if manifest_intact(m, read_config(self.out)) is not None:  # expq.json edited: write it anew
                return False
        except ExpqError:
            return False
        return self.out_files.match()

    def _start(self) -> dict[str, dict]:
        """Resume a partial run with the same settings (keeping files whose content matches the journal), or start
        afresh. Returns the kept files: name -> {size, sha256}."""
        j = self._read_journal()
        if j is not None and j.get("settled") is False:
            j = None  # left before its settings were final: nothing to resume from
        if j is not None and j.get("fingerprint") != self.fingerprint:
            if not self.overwrite:
                raise UsageError("a partial conversion into OUT with other settings is waiting to be resumed ("
                                 f"{_differences(j.get('fingerprint'), self.fingerprint)}); re-run it, or pass "
                                 "--overwrite to discard it", file=str(self.out))
            j = None
        if j is None and files.holds_anything(self.staging) and files.lstat(self.journal_path) is None:
            raise UsageError(f"{self.staging} exists and was not left by expq; refusing to delete it",
                             file=str(self.out))
        with naming(self.staging, "cannot make the staging folder"):
            made = files.make_dir(self.staging, _STAGING_HINT)
        self._check_exchange(made)
        if j is None:
            files.remove_tree(self.staging, _STAGING_HINT)
            with naming(self.staging, "cannot make the staging folder"):
                files.make_dir(self.staging, _STAGING_HINT)
            try:
                self._write_journal({"fingerprint": self.fingerprint, "phase": "writing", "files": {},
                                     "settled": self.settled})
            except BaseException:
                self.staging.rmdir()  # nothing to resume from
                raise
            return {}
        return self._keep_matching(j)

    def settle(self, fingerprint: dict) -> None:
        """The run's final settings, once known (``settled`` was False): written into the journal, so that from
        now on an interrupted run resumes.

        Raises:
            OutputError: the journal cannot be written (``settled`` stays False).
        """
        with self._journal_lock:
            if self._journal:
                self._write_journal(self._journal, fingerprint=fingerprint, settled=True)
            self.fingerprint, self.settled = fingerprint, True

    def _keep_matching(self, j: dict) -> dict[str, dict]:
        """Keep the staged files whose size and sha256 match the journal; delete the other regular files.

        Raises:
            LinkRefused: the staging folder holds a link or a special file (expq makes neither)."""
        odd = files.not_regular(self.staging)
        if odd:
            raise files.LinkRefused(f"the staging folder holds {odd[0]}, which expq did not make (a link or a "
                                    "special file); expq never writes or deletes through a link",
                                    file=str(self.staging), hint=_STAGING_HINT)
        kept_files = {}
        for rel in files.regular_files(self.staging):
            rec = j["files"].get(rel)
            p = self.staging / rel
            if rec and os.lstat(p).st_size == rec["size"] and sha256_file(p, follow_links=False) == rec["sha256"]:
                kept_files[rel] = rec
            else:
                files.remove_file(p)  # unfinished, or changed since: redone
        self._write_journal(j, files=kept_files)
        return kept_files

    def _check_exchange(self, made: bool) -> None:
        """Replacing a non-empty OUT needs an atomic exchange: refuse, before any work, where the filesystem has
        none (OUT would be missing between two renames). ``made``: the staging folder was just made (removed then)."""
        if not files.holds_anything(self.out):
            return
        if files.exchange_supported(self.staging):
            return
        if made:
            self.staging.rmdir()
        raise UsageError("this filesystem cannot swap two folders atomically (no renameat2 RENAME_EXCHANGE: NFS, "
                         "SMB and many FUSE mounts), so OUT cannot be replaced without a moment where it is missing",
                         file=str(self.out), hint="remove OUT yourself first, or convert into a new folder")

    # --- journal ---------------------------------------------------------------------------------------------------
    def _read_journal(self) -> dict | None:
        try:
            j = json.loads(files.read_bytes(self.journal_path))
        except FileNotFoundError:
            return None
        except files.LinkRefused:
            raise files.LinkRefused(f"the journal {self.journal_path.name} is a symbolic link or not a regular file; "
                                    "expq never reads or writes through a link", file=str(self.journal_path),
                                    hint="remove it (an interrupted run cannot then be resumed)") from None
        except (OSError, ValueError):
            raise UsageError("the journal of an earlier conversion is unreadable; remove it to start afresh",
                             file=str(self.journal_path)) from None
        return j if isinstance(j, dict) and isinstance(j.get("files"), dict) else None

    def _write_journal(self, j: dict, **changes) -> None:
        """Write the journal whole: into a new temporary file (never a link's target), fsync'd, renamed over it."""
        j = {**j, **changes, "pid": os.getpid()}
        with naming(self.journal_tmp, "cannot write the journal"):
            fd = files.create_replacing_stale(self.journal_tmp, "remove it: expq makes its journal itself")
            try:
                files.write_all(fd, json.dumps(j).encode())
                faults.hit("fsync")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(self.journal_tmp, self.journal_path)
        self._journal = j

    def _drop_journal(self) -> None:
        for p in (self.journal_path, self.journal_tmp):
            files.remove_file(p)

    def record(self, name: str, jobs: dict | None = None, sha256: str | None = None) -> None:
        """A staged file is complete and fsync'd: record its size and sha256 (a re-run keeps it), and the row
        findings of the jobs finished so far (``jobs``: job index -> dict). ``sha256``: the file's hash when the
        caller computed it as it wrote the file (else it is read back here)."""
        p = self.staging / name
        rec = {"size": os.lstat(p).st_size, "sha256": sha256 or sha256_file(p, follow_links=False)}
        with self._journal_lock:
            j = self._journal
            merged = {**j.get("jobs", {}), **{str(k): v for k, v in (jobs or {}).items()}}
            self._write_journal(j, files={**j["files"], name: rec}, jobs=merged)

    def recorded_sha256(self, name: str) -> str | None:
        """The sha256 the journal holds for a finished staged file (None if it is not recorded)."""
        rec = self._journal.get("files", {}).get(name)
        return rec["sha256"] if rec else None

    @property
    def finished_files(self) -> frozenset[str]:
        """The names of ``kept_files``: output files a resumed run does not write again (``shards.ShardSet``)."""
        return frozenset(self.kept_files)

    @property
    def done_jobs(self) -> dict[int, dict]:
        """Row findings of quantize jobs a resumed run finished (from the journal)."""
        return {int(k): v for k, v in self._journal.get("jobs", {}).items()} if self.kept_files else {}

    # --- files -----------------------------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """The staging path of an output file (its final name, relative to OUT); the folders its name has are made
        in the staging folder (a link there is refused)."""
        p = self.staging / name
        with naming(p.parent, "cannot make the folder"):
            for sub in reversed(Path(name).parents[:-1]):
                files.make_dir(self.staging / sub, _STAGING_HINT)
        return p

    def write_text(self, name: str, text: str) -> None:
        """Write and fsync a small output file (created here, never through a link).

        Raises:
            OutputError: the write or flush failed (disk full...), naming the file.
        """
        path = self.path(name)
        with naming(path):
            with os.fdopen(os.open(path, _O_NEW, 0o644), "w") as f:
                f.write(text)
                f.flush()
                faults.hit("fsync")
                os.fsync(f.fileno())

    def copy_file(self, src: Path, name: str) -> None:
        """Copy a side file (its bytes, not a link; in chunks, holes kept: ``io.regular.copy_regular``, which
        creates the copy without following a link), fsync'd.

        Raises:
            SourceError: ``src`` is not a regular file or cannot be read, naming it. OutputError: the copy cannot
                be written, naming it.
        """
        from ..errors import SourceError
        from ..io.regular import copy_regular

        dst = self.path(name)
        with naming(dst, "cannot flush to disk"):
            faults.hit("fsync")
        copy_regular(src, dst, "side file", SourceError, OutputError)

    def staged_files(self) -> list[str]:
        return files.regular_files(self.staging)

    # --- commit ----------------------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Swap the complete, fsync'd staging folder in as OUT with one rename (see the module docstring): record
        the staged folder's inode (the next start tells from it whether a killed commit happened), wait for readers of
        OUT, copy the model card across, rename or exchange, then delete the old checkpoint.

        Raises:
            OutputError: the rename failed (nothing changed: the same command finishes), or, after it, deleting the
                old checkpoint failed (OUT is the new one; the next run into OUT finishes the cleanup).
            Interrupted: a signal came while waiting for a reader of OUT (the same command finishes).
        """
        for d in sorted({(self.staging / n).parent for n in self.staged_files()} | {self.staging}, reverse=True):
            fsync_path(d)
        st = os.lstat(self.staging)
        self._write_journal(self._journal, phase="swap", staged=[st.st_dev, st.st_ino])
        self._wait_for_readers()
        replace = files.holds_anything(self.out)
        try:
            if replace:
                self._carry_cards()
            faults.hit("rename")
            if replace:
                if not files.exchange(self.staging, self.out):
                    raise OSError(errno.ENOTSUP, "the filesystem no longer swaps folders atomically")
            else:
                os.rename(self.staging, self.out)  # onto a missing or empty OUT
        except OSError as e:
            raise OutputError(f"cannot move the finished conversion into place: {e.strerror or e}; re-run the same "
                              "command to finish", file=str(self.out)) from None
        self.committed = True
        conversion_committed(True)  # what a signal's line says from now on (``interrupts.committed_now``)
        self._after_commit(self.staging if replace else None)

    def _after_commit(self, old: Path | None) -> None:
        """The new checkpoint is in OUT: delete the old one (under the staging name), drop the journal, flush the
        parent folder. A failure here cannot undo the commit, so it is a warning (``warnings``), naming what is
        left, never an error; the next run into OUT removes what is left."""
        parent = self.out.parent
        if old is not None:
            try:
                files.remove_tree(old)
            except OSError as e:
                self.warnings.append(f"the new conversion is in {self.out}, but the checkpoint it replaced could not "
                                     f"be deleted ({e.strerror or e}): remove {old} by hand")
        failed = None
        for step in (lambda: fsync_path(parent), self._drop_journal, lambda: fsync_path(parent)):
            try:
                step()
            except (OSError, OutputError) as e:
                failed = failed or e
        if failed is not None:
            self.warnings.append(f"the new conversion is in {self.out}, but {failed}: it may not survive a power "
                                 "loss until the folder is flushed (run sync)")
        self.release()

    def _carry_cards(self) -> None:
        """Copy into the staging folder the model card files of OUT (``PUSH_WRITES``) that are not the bytes the old
        conversion recorded (a push or a user wrote them), with their mode and times: the new checkpoint keeps
        them. A copy, so OUT keeps its own until the exchange."""
        recorded = {f.name: f.sha256 for f in self.existing.record.files} if self.existing is not None else {}
        for rel in PUSH_WRITES:
            st = files.lstat(self.out / rel)
            if st is None or not stat.S_ISREG(st.st_mode) \
                    or recorded.get(rel) == sha256_file(self.out / rel, follow_links=False):
                continue
            dst = self.path(rel)
            files.remove_file(dst)
            fd = files.create(dst, stat.S_IMODE(st.st_mode))
            try:
                files.write_all(fd, files.read_bytes(self.out / rel))
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_path(dst.parent)

    def _wait_for_readers(self) -> None:
        """Take the lock's ``COMMIT`` byte, exclusive: wait while a verify or push reads OUT (stopping on a signal)."""
        while not files.try_lock(self._lock_fd, files.COMMIT, exclusive=True):
            if STOP.wait(0.1):
                raise STOP.interrupted()

    def discard(self) -> None:
        """Remove the staging folder and the journal (nothing to resume)."""
        with contextlib.suppress(OSError):
            files.remove_tree(self.staging)
        self._drop_journal()
        self.release()

    def release(self) -> None:
        """Give up the lock (the staging folder and journal stay for a resume); the lock file is deleted unless a
        reader of OUT holds it (the last reader deletes it)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            files.let_go(fd, self.lock_path)


_STAGING_HINT = ("move the folder itself back to this name (mv, on the same filesystem), or remove the link to start "
                 "afresh")


@contextlib.contextmanager
def reading(out: str | Path):
    """Hold OUT steady while reading it (verify, push): a shared lock that a conversion into OUT takes exclusively
    only to swap OUT and delete the old checkpoint, so a commit waits for the reader and the reader for a commit
    in progress. Where the lock file cannot be made (a read-only place), nothing can convert into OUT either, and
    nothing is held.

    Raises:
        LinkRefused: the lock file is a symbolic link.
    """
    out = Path(out).expanduser().absolute()
    path = beside(out, LOCK)
    fd = None
    while True:
        try:
            fd = files.open_lock(path)
        except files.LinkRefused:
            raise
        except OSError:
            break
        if files.try_lock(fd, files.COMMIT, exclusive=False) and files.same_file(fd, path):
            break
        os.close(fd)
        fd = None
        time.sleep(0.05)  # a commit in progress, or the file was just deleted: try again
    try:
        yield
    finally:
        if fd is not None:
            files.let_go(fd, path)


def _check_location(out: Path, src_root: Path | None, given) -> None:
    if src_root is not None:
        s, o = src_root.resolve(), out.resolve()
        if o == s or s in o.parents or o in s.parents:
            raise UsageError("OUT overlaps the source directory; the source is never modified", file=str(given))


def _differences(old: dict | None, new: dict) -> str:
    """What differs between two settings fingerprints, for a one-line message: key by key (nested dicts by their
    dotted keys), and for file lists (``[[name, size, hashes...], ...]``) the names of the files that differ."""
    if not isinstance(old, dict):
        return "its settings are not recorded"
    shown = _diff_items("", old, new)
    return "; ".join(shown[:4]) + (f"; and {len(shown) - 4} more" if len(shown) > 4 else "") if shown else "none"


def _diff_items(prefix: str, old: dict, new: dict) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b, key = old.get(k), new.get(k), prefix + k
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff_items(key + ".", a, b)
        elif _is_file_list(a) and _is_file_list(b):
            fa, fb = {str(e[0]): e for e in a}, {str(e[0]): e for e in b}
            changed = [n for n in sorted(set(fa) | set(fb)) if fa.get(n) != fb.get(n)]
            out.append(f"{key}: {', '.join(changed[:3])}{' and more' if len(changed) > 3 else ''} "
                       f"{'differ' if len(changed) > 1 else 'differs'} (size or content)")
        else:
            out.append(f"{key}: {_short(a)} -> {_short(b)}")
    return out


def _is_file_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(e, list) and e for e in v)


def _short(v) -> str:
    t = json.dumps(v, sort_keys=True, default=str)
    return t if len(t) <= 60 else t[:57] + "..."



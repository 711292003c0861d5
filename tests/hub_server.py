"""A small Hugging Face Hub-compatible HTTP server for offline tests (stdlib only).

The real ``huggingface_hub`` client talks to it through ``HF_ENDPOINT`` (see the ``hub_server`` fixture in
``tests/conftest.py``). It keeps real git-like state: every repo has refs (branches, ``refs/pr/N``) pointing at
commits, and a revision's file list is the result of applying its commits in order. File contents live in a
content-addressed store under ``root``; "LFS" files are uploaded through the git-LFS batch API (basic and,
optionally, multipart transfers) and committed by sha256, regular files are sent base64-encoded in the commit.
Xet is never advertised (no ``X-Xet-*`` headers, LFS batch answers ``transfer: basic``, ``xetEnabled: false``,
the ``xet-*-token`` routes answer 501): clients >= 1.x that pick Xet by themselves must run with
``HF_HUB_DISABLE_XET=1`` (the fixture does it).

Fault injection (for retry / resume tests): ``inject_fault(kind, after=N)`` makes the requests of one kind fail
after N of them went through, with an HTTP status (default 500) or by dropping the connection. ``stats`` counts
requests per endpoint and ``uploaded_oids`` lists the LFS objects whose upload completed, so that a test can
check that a resumed push did not upload finished files again.

Read failures, as the Hub answers them: ``gate(repo_id)`` makes file downloads answer 401 (anonymous) or 403
(a user not granted access) with ``X-Error-Code: GatedRepo``; ``deny_read(repo_id)`` makes every read of the repo
answer 403 without an error code (a token without read permission); ``hide_file(repo_id, path)`` makes a file that
the tree lists answer 404 ``EntryNotFound`` when downloaded; ``reject_tokens`` answers 401 invalid credentials;
``serve_instead(repo_id, path, data)`` sends other bytes than the listing describes (a corrupt or truncated copy).

Downloads honour a single ``Range: bytes=first-last`` (also ``first-`` and ``-suffix``) with 206 Partial Content and
``Content-Range``, 416 when it starts past the end; ``transfers(repo_id)`` lists what was sent, byte ranges included;
``hold(repo_id, path)`` keeps a download waiting until the test releases it.

Which process asked (Linux): with ``track_clients = True`` the server looks up, for every connection, the process
that holds the client end of it (``/proc/net/tcp`` and ``/proc/*/fd``, the server and its clients on one machine),
and ``transfers_by_pid(repo_id)`` lists each file content sent with that process id: a test can tell a driver's
requests from its worker processes' (``--ray``).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import re
import socket
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
DEFAULT_GITATTRIBUTES = "".join(
    f"{p} filter=lfs diff=lfs merge=lfs -text\n"
    for p in (
        "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.mlmodel *.model *.msgpack *.npy *.npz "
        "*.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar *.safetensors saved_model/**/* *.tar.* *.tar "
        "*.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"
    ).split()
)
UPLOAD_KINDS = ("lfs_upload", "lfs_part")  # what the "upload" fault kind matches


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Entry:
    """One file of a commit's tree."""

    size: int
    sha256: str
    lfs: bool
    blob_id: str  # git oid: of the content (regular) or of the LFS pointer (lfs)


@dataclass
class Commit:
    oid: str
    parent: str | None
    tree: dict[str, Entry]
    title: str
    message: str
    date: str


@dataclass
class Repo:
    type: str
    id: str
    private: bool
    created: str
    refs: dict[str, str] = field(default_factory=dict)  # "refs/heads/main" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: set[str] = field(default_factory=set)  # sha256 of LFS objects uploaded to this repo
    num_prs: int = 0


@dataclass
class Fault:
    kind: str
    after: int = 0
    times: int | None = None
    status: int = 500
    mode: str = "status"  # "status" or "drop"
    seen: int = 0
    fired: int = 0

    def matches(self, endpoint: str) -> bool:
        return self.kind in ("*", endpoint) or (self.kind == "upload" and endpoint in UPLOAD_KINDS)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.extra = extra  # more fields of the JSON error body


class _Drop(Exception):
    """Close the connection without answering."""


@dataclass
class _Resp:
    status: int = 200
    body: bytes | tuple[Path, int, int] = b""  # bytes, or (file, offset, length)
    headers: dict[str, str] = field(default_factory=dict)


def _json(data: Any, status: int = 200, headers: dict | None = None) -> _Resp:
    return _Resp(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})


class HubServer:
    """Hub-compatible server on 127.0.0.1 (random port). Use as a context manager or call start()/stop().

    token: the only accepted bearer token (None: no auth at all, every request acts as ``user``).
    lfs_threshold: files at least this large go through LFS (as do binary files and .gitattributes LFS patterns).
    multipart_chunk_size: when set, LFS objects larger than it are uploaded with the multipart transfer.
    tree_page_size: entries per page of the tree listing (pagination via the Link header).
    init_gitattributes: new repos start with a commit adding the Hub's default .gitattributes, like on the Hub.
    fail_after_uploads / fail_after_commits: shortcuts for inject_fault("upload"/"commit", after=N, ...).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        token: str | None = "hf_test_token",
        *,
        user: str = "test-user",
        lfs_threshold: int = 10 * 1024 * 1024,
        multipart_chunk_size: int | None = None,
        tree_page_size: int = 1000,
        init_gitattributes: bool = True,
        fail_after_uploads: int | None = None,
        fail_after_commits: int | None = None,
        fail_status: int = 500,
        fail_mode: str = "status",
        fail_times: int | None = None,
    ):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        self.token, self.user = token, user
        self.lfs_threshold, self.multipart_chunk_size = lfs_threshold, multipart_chunk_size
        self.tree_page_size, self.init_gitattributes = tree_page_size, init_gitattributes
        self.reject_tokens = False  # True: every request carrying a token gets 401 (invalid credentials)
        self.denied_writes: set[str] = set()  # repo ids or namespaces answering 403 to writes
        self.denied_reads: set[str] = set()  # repo ids answering 403 to every read
        self.gated: dict[str, set[str]] = {}  # gated repo id -> users granted access
        self.hidden_files: set[tuple[str, str]] = set()  # (repo id, path): listed, but downloads answer 404
        self.replaced: dict[tuple[str, str], bytes] = {}  # (repo id, path): listed as committed, serves these bytes
        self.held: dict[tuple[str, str], tuple[threading.Event, threading.Event]] = {}  # see hold()
        self.served: list[tuple[str, str, int, int, int]] = []  # (repo id, path, status, first byte, length)
        self.repos: dict[tuple[str, str], Repo] = {}
        self.faults: list[Fault] = []
        self.stats: Counter[str] = Counter()  # requests received, per endpoint name
        self.uploaded_oids: list[str] = []  # LFS objects whose upload completed, in order
        self.requests: list[tuple[str, str, str, int]] = []  # (method, path, endpoint, status)
        self.track_clients = False  # look up the client process of every connection (see transfers_by_pid)
        self.served_pids: list[int | None] = []  # with track_clients: the client process of each `served` entry
        self._lock = threading.RLock()
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for kind, after in (("upload", fail_after_uploads), ("commit", fail_after_commits)):
            if after is not None:
                self.inject_fault(kind, after=after, times=fail_times, status=fail_status, mode=fail_mode)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HubServer":
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # ------------------------------------------------------------------ test controls
    def inject_fault(
        self, kind: str, *, after: int = 0, times: int | None = None, status: int = 500, mode: str = "status"
    ) -> Fault:
        """Fail requests of `kind` once `after` of them went through; `times` failures then recover (None: never).

        kind: an endpoint name as counted in `stats` ("lfs_upload", "lfs_part", "commit", "preupload",
        "lfs_batch", "resolve_get", "info", ...), "upload" (= lfs_upload or lfs_part) or "*".
        mode: "status" answers `status`; "drop" reads the request and closes the connection without answering.
        Note: huggingface_hub retries most calls (not the commit POST) 5 times with a 1, 2, 4, 8, 8 s backoff:
        on 408/429/500/502/503/504 and dropped connections in 2.x, on 503 only in 1.0. To make a push fail fast,
        use a status it does not retry (e.g. 507), or `times=1` to show that a retry recovers.
        """
        assert mode in ("status", "drop")
        fault = Fault(kind, after=after, times=times, status=status, mode=mode)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def deny_write(self, *targets: str) -> None:
        """Answer 403 to writes on these repo ids or whole namespaces (and to create_repo in a namespace)."""
        self.denied_writes.update(targets)

    def deny_read(self, *repo_ids: str) -> None:
        """Answer 403 (no error code, like a token without read permission) to every read of these repos."""
        self.denied_reads.update(repo_ids)

    def gate(self, repo_id: str, granted: tuple[str, ...] = ()) -> None:
        """Make a repo gated: its info and file list stay public, file downloads answer 401 GatedRepo without a
        token and 403 GatedRepo for a user not in ``granted`` (as the Hub does)."""
        self.gated[repo_id] = set(granted)

    def hide_file(self, repo_id: str, path: str) -> None:
        """Keep ``path`` in the repo's listings but answer 404 EntryNotFound when it is downloaded."""
        self.hidden_files.add((repo_id, path))

    def serve_instead(self, repo_id: str, path: str, data: bytes) -> None:
        """Keep ``path``'s listing (size, sha256, ETag) as committed but send ``data`` when it is downloaded: a
        corrupt or truncated copy, as a broken mirror or proxy would serve it."""
        self.replaced[(repo_id, path)] = bytes(data)

    def hold(self, repo_id: str, path: str) -> tuple[threading.Event, threading.Event]:
        """Make whole-file downloads of ``path`` (GET without a Range) wait before answering: returns (requested:
        set when such a download arrives, release: set it to let the answer go; after 120 s it goes anyway)."""
        pair = self.held[(repo_id, path)] = (threading.Event(), threading.Event())
        return pair

    def transfers(self, repo_id: str) -> list[tuple[str, int, int, int]]:
        """(path, status, first byte, length) of every file content the server sent for ``repo_id`` (GET on
        resolve answered 200 or 206), in order: ranged reads show as 206 with their byte range."""
        with self._lock:
            return [(p, st, a, n) for r, p, st, a, n in self.served if r == repo_id]

    def transfers_by_pid(self, repo_id: str) -> list[tuple[int | None, str, int, int, int]]:
        """(client process id, path, status, first byte, length) of every file content sent for ``repo_id``, in
        order; the process id is None unless ``track_clients`` was set before the request (or not found)."""
        with self._lock:
            return [(pid, p, st, a, n) for (r, p, st, a, n), pid in zip(self.served, self.served_pids)
                    if r == repo_id]

    def downloaded(self, repo_id: str) -> list[str]:
        """Paths of ``repo_id`` whose content was sent (GET on resolve answered 200/206), in order."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            reqs = list(self.requests)
        return [unquote(p[len(prefix):]).split("/", 1)[1] for m, p, _, st in reqs
                if m == "GET" and p.startswith(prefix) and st in (200, 206)]

    def reset_stats(self) -> None:
        with self._lock:
            self.stats.clear()
            self.uploaded_oids.clear()
            self.requests.clear()
            self.served.clear()
            self.served_pids.clear()

    # ------------------------------------------------------------------ seeding
    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> Repo:
        with self._lock:
            key = (repo_type, repo_id)
            if key in self.repos:
                return self.repos[key]
            repo = self.repos[key] = Repo(repo_type, repo_id, private, _now())
            files = {".gitattributes": DEFAULT_GITATTRIBUTES.encode()} if self.init_gitattributes else {}
            self._commit(repo, "refs/heads/main", self._ops_from_bytes(repo, None, files), "initial commit")
            return repo

    def add_repo(
        self,
        repo_id: str,
        folder: str | os.PathLike,
        revision: str = "main",
        repo_type: str = "model",
        *,
        private: bool = False,
        message: str = "Upload folder",
    ) -> str:
        """Create the repo if needed and commit every file of `folder` to branch `revision`; returns the commit."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.create_repo(repo_id, repo_type, private)
        return self.commit_files(repo_id, files, revision=revision, repo_type=repo_type, message=message)

    def commit_files(
        self,
        repo_id: str,
        files: dict[str, bytes | str | os.PathLike | None],
        revision: str = "main",
        repo_type: str = "model",
        *,
        message: str = "Update files",
        lfs: bool | None = None,
    ) -> str:
        """Commit files to a branch (created from main if missing); returns the new commit oid.

        files: path in repo -> bytes, str (text content), a Path to a local file, or None (delete the file).

        lfs: force LFS (True) or regular (False) storage; None applies the same rule as the preupload endpoint.
        """

        def as_bytes(v):
            if v is None or isinstance(v, bytes):
                return v
            return v.encode() if isinstance(v, str) else Path(v).read_bytes()

        data = {path: as_bytes(v) for path, v in files.items()}
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            ref = revision if revision.startswith("refs/") else f"refs/heads/{revision}"
            if ref not in repo.refs:
                repo.refs[ref] = repo.refs["refs/heads/main"]
            return self._commit(repo, ref, self._ops_from_bytes(repo, ref, data, lfs), message)

    # ------------------------------------------------------------------ inspection
    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return (repo_type, repo_id) in self.repos

    def head(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> str:
        """Commit oid a revision (branch, refs/pr/N, commit) points at."""
        return self._resolve(self._repo(repo_type, repo_id), revision).oid

    def refs(self, repo_id: str, repo_type: str = "model") -> dict[str, str]:
        return dict(self._repo(repo_type, repo_id).refs)

    def list_files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, dict]:
        """{path: {"size", "sha256", "lfs", "blob_id"}} of a revision."""
        tree = self._resolve(self._repo(repo_type, repo_id), revision).tree
        return {
            p: {"size": e.size, "sha256": e.sha256, "lfs": e.lfs, "blob_id": e.blob_id} for p, e in sorted(tree.items())
        }

    def read_file(self, repo_id: str, path: str, revision: str = "main", repo_type: str = "model") -> bytes:
        entry = self._resolve(self._repo(repo_type, repo_id), revision).tree[path]
        return self._object(entry.sha256).read_bytes()

    def history(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[Commit]:
        """Commits reachable from a revision, newest first."""
        repo = self._repo(repo_type, repo_id)
        out, commit = [], self._resolve(repo, revision)
        while commit is not None:
            out.append(commit)
            commit = repo.commits.get(commit.parent) if commit.parent else None
        return out

    def lfs_objects(self, repo_id: str, repo_type: str = "model") -> set[str]:
        return set(self._repo(repo_type, repo_id).lfs)

    # ------------------------------------------------------------------ storage / state helpers
    def _object(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def _store_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self._object(sha)
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def _store_file(self, tmp: Path, sha: str) -> None:
        path = self._object(sha)
        path.parent.mkdir(exist_ok=True)
        os.replace(tmp, path)

    def _entry(self, sha: str, size: int, lfs: bool) -> Entry:
        blob = git_blob_id(lfs_pointer(sha, size)) if lfs else git_blob_id(self._object(sha).read_bytes())
        return Entry(size, sha, lfs, blob)

    def _ops_from_bytes(self, repo: Repo, ref: str | None, files: dict, lfs: bool | None = None) -> list:
        gitattributes = files.get(".gitattributes")
        tree = repo.commits[repo.refs[ref]].tree if ref in repo.refs else {}
        ops = []
        for path, data in files.items():
            if data is None:
                ops.append(("delete", path, None))
                continue
            sha = self._store_bytes(data)
            is_lfs = lfs if lfs is not None else self._is_lfs(tree, path, len(data), data[:512], gitattributes)
            if is_lfs and data:
                repo.lfs.add(sha)
            ops.append(("add", path, self._entry(sha, len(data), bool(is_lfs and data))))
        return ops

    def _is_lfs(self, tree: dict[str, Entry], path: str, size: int, sample: bytes, gitattributes=None) -> bool:
        """The Hub's rule: LFS if big, binary, or matching a `filter=lfs` pattern of the .gitattributes."""
        if path == ".gitattributes":
            return False
        if size >= self.lfs_threshold or b"\0" in sample:
            return True
        if gitattributes is None and ".gitattributes" in tree:
            gitattributes = self._object(tree[".gitattributes"].sha256).read_bytes()
        for line in (gitattributes or b"").decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 1 and "filter=lfs" in parts[1:]:
                pattern = parts[0].lstrip("/")
                if fnmatch(path if "/" in pattern else path.rsplit("/", 1)[-1], pattern):
                    return True
        return False

    def _commit(self, repo: Repo, ref: str, ops: list, title: str, message: str = "", parent_commit=None) -> str:
        with self._lock:
            parent = repo.refs.get(ref)
            if parent_commit and parent and not parent.startswith(parent_commit):
                raise HubError(412, f"A commit has happened since. Parent commit {parent_commit} is not the head.")
            tree = dict(repo.commits[parent].tree) if parent else {}
            for op, path, entry in ops:
                if op == "add":
                    tree[path] = entry
                elif op == "delete":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                else:  # delete folder
                    prefix = path.strip("/") + "/"
                    doomed = [p for p in tree if p.startswith(prefix)]
                    if not doomed:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in doomed:
                        del tree[p]
            self._counter += 1
            seed = json.dumps([parent, sorted((p, e.blob_id) for p, e in tree.items()), title, self._counter])
            oid = hashlib.sha1(seed.encode()).hexdigest()
            repo.commits[oid] = Commit(oid, parent, tree, title, message, _now())
            repo.refs[ref] = oid
            return oid

    def _repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _resolve(self, repo: Repo, rev: str) -> Commit:
        for ref in (rev, f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if ref.startswith("refs/") and ref in repo.refs:
                return repo.commits[repo.refs[ref]]
        if re.fullmatch(r"[0-9a-f]{7,40}", rev):
            found = [c for oid, c in repo.commits.items() if oid.startswith(rev)]
            if len(found) == 1:
                return found[0]
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _branch_ref(self, repo: Repo, rev: str) -> str:
        """The ref a commit to `rev` moves (a branch or a PR ref)."""
        ref = rev if rev.startswith("refs/") else f"refs/heads/{rev}"
        if ref not in repo.refs:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return ref

    def _web(self, repo: Repo) -> str:
        return f"{self.url}/{URL_PREFIX[repo.type]}{repo.id}"

    # ------------------------------------------------------------------ request handling
    def _user(self, h: "_Handler") -> str | None:
        if self.token is None:
            return self.user
        auth = h.headers.get("Authorization") or ""
        if not auth.lower().startswith("bearer "):
            return None
        if self.reject_tokens or auth[7:].strip() != self.token:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.user

    def _can_read(self, user: str | None, repo: Repo) -> Repo:
        if repo.private and user is None:
            raise HubError(401, "Repository not found", "RepoNotFound")
        if repo.id in self.denied_reads:
            raise HubError(403, f"Your token does not have read access to {repo.id}")
        return repo

    def _check_write(self, user: str | None, repo_id: str) -> None:
        if user is None:
            raise HubError(401, "You must be authenticated to write to this repository")
        if repo_id in self.denied_writes or repo_id.split("/")[0] in self.denied_writes:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")

    def _check_fault(self, endpoint: str) -> None:
        with self._lock:
            for fault in self.faults:
                if not fault.matches(endpoint):
                    continue
                fault.seen += 1
                if fault.seen > fault.after and (fault.times is None or fault.fired < fault.times):
                    fault.fired += 1
                    if fault.mode == "drop":
                        raise _Drop()
                    raise HubError(fault.status, f"Injected failure ({endpoint})")

    def handle(self, h: "_Handler", method: str) -> None:
        split = urlsplit(h.path)
        segs = [unquote(s) for s in split.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        endpoint, resp = "unknown", None
        try:
            endpoint, action = self._route(method, segs)
            with self._lock:
                self.stats[endpoint] += 1
            if endpoint in UPLOAD_KINDS:  # body streamed by the action itself
                self._check_fault(endpoint)
                resp = action(h, query, None)
            else:
                body = b"".join(h.iter_body())
                self._check_fault(endpoint)
                resp = action(h, query, body)
        except _Drop:
            h.drain()
            h.close_connection = True
        except HubError as e:
            h.drain()
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            resp = _json({"error": e.message, **e.extra}, e.status, headers)
        except Exception as e:  # noqa: BLE001 - a server bug shows up as a 500 with the message
            h.drain()
            resp = _json({"error": f"{type(e).__name__}: {e}"}, 500)
        with self._lock:
            self.requests.append((method, split.path, endpoint, resp.status if resp else 0))
        if resp is not None:
            h.send(resp, head=(method == "HEAD"))

    def _route(self, method: str, segs: list[str]):
        def bad(*_):
            raise HubError(404, f"Unknown route {method} /{'/'.join(segs)}")

        if segs[:1] == ["api"]:
            api = segs[1:]
            fixed = {
                ("GET", "whoami-v2"): ("whoami", self._whoami),
                ("POST", "repos/create"): ("create_repo", self._create_repo),
                ("DELETE", "repos/delete"): ("delete_repo", self._delete_repo),
                ("POST", "validate-yaml"): ("validate_yaml", lambda *_: _json({"errors": [], "warnings": []})),
            }.get((method, "/".join(api)))
            if fixed:
                return fixed
            if len(api) >= 3 and api[0] in TYPES:
                rtype, repo_id, rest = TYPES[api[0]], f"{api[1]}/{api[2]}", api[3:]
                sub = rest[0] if rest else ""
                arg = "/".join(rest[1:])
                routes = {
                    ("GET", ""): ("info", lambda h, q, b: self._info(h, q, rtype, repo_id, "main")),
                    ("GET", "revision"): ("info", lambda h, q, b: self._info(h, q, rtype, repo_id, arg)),
                    ("GET", "tree"): ("tree", lambda h, q, b: self._tree(h, q, rtype, repo_id, rest[1], rest[2:])),
                    ("POST", "paths-info"): ("paths_info", lambda h, q, b: self._paths_info(h, b, rtype, repo_id, arg)),
                    ("POST", "preupload"): ("preupload", lambda h, q, b: self._preupload(h, b, rtype, repo_id, arg)),
                    ("POST", "commit"): ("commit", lambda h, q, b: self._commit_api(h, q, b, rtype, repo_id, arg)),
                    ("POST", "branch"): ("branch", lambda h, q, b: self._branch(h, b, rtype, repo_id, arg, True)),
                    ("DELETE", "branch"): ("branch", lambda h, q, b: self._branch(h, b, rtype, repo_id, arg, False)),
                    ("POST", "tag"): ("tag", lambda h, q, b: self._tag(h, b, rtype, repo_id, arg)),
                    ("GET", "refs"): ("refs", lambda h, q, b: self._refs(h, q, rtype, repo_id)),
                    ("GET", "commits"): ("commits", lambda h, q, b: self._commits(h, rtype, repo_id, arg)),
                }
                if sub.startswith("xet-"):
                    return "xet", lambda *_: _json({"error": "Xet is not supported by this server"}, 501)
                if (method, sub) in routes and (sub != "tree" or len(rest) >= 2):
                    return routes[(method, sub)]
            return "unknown", bad
        if segs[:1] == ["_lfs"] and len(segs) >= 5:  # /_lfs/{type}/{ns}/{name}/{oid}[/part/{n} | /complete]
            rtype, repo_id, oid, rest = segs[1], f"{segs[2]}/{segs[3]}", segs[4], segs[5:]
            if method == "PUT" and not rest:
                return "lfs_upload", lambda h, q, b: self._lfs_put(h, rtype, repo_id, oid, None)
            if method == "PUT" and len(rest) == 2 and rest[0] == "part":
                return "lfs_part", lambda h, q, b: self._lfs_put(h, rtype, repo_id, oid, int(rest[1]))
            if method == "POST" and rest == ["complete"]:
                return "lfs_complete", lambda h, q, b: self._lfs_complete(rtype, repo_id, oid, b)
            return "unknown", bad
        rtype = "model"
        if segs and segs[0] in ("datasets", "spaces"):
            rtype, segs = TYPES[segs[0]], segs[1:]
        if len(segs) >= 3 and segs[1].endswith(".git") and segs[2:5] == ["info", "lfs", "objects"]:
            repo_id, op = f"{segs[0]}/{segs[1][:-4]}", "/".join(segs[5:])
            if method == "POST" and op == "batch":
                return "lfs_batch", lambda h, q, b: self._lfs_batch(h, b, rtype, repo_id)
            if method == "POST" and op == "verify":
                return "lfs_verify", lambda h, q, b: self._lfs_verify(h, b, rtype, repo_id)
        if len(segs) >= 5 and segs[2] == "resolve" and method in ("GET", "HEAD"):
            repo_id, rev, path = f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:])
            return f"resolve_{method.lower()}", lambda h, q, b: self._resolve_file(h, rtype, repo_id, rev, path)
        return "unknown", bad

    # ------------------------------------------------------------------ endpoints
    def _whoami(self, h, q, body) -> _Resp:
        user = self._user(h)
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        token_info = {"displayName": "test token", "role": "write"}
        return _json({"type": "user", "id": "0" * 24, "name": user, "fullname": "Test User", "email": None,
                      "emailVerified": True, "isPro": False, "orgs": [],
                      "auth": {"type": "access_token", "accessToken": token_info}})

    def _create_repo(self, h, q, body) -> _Resp:
        user, payload = self._user(h), json.loads(body or b"{}")
        rtype = payload.get("type") or "model"
        if rtype not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type {rtype}")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        self._check_write(user, repo_id)
        private = payload.get("visibility", "private" if payload.get("private") else "public") != "public"
        with self._lock:
            exists = (rtype, repo_id) in self.repos
            repo = self.create_repo(repo_id, rtype, private)
        if exists:
            raise HubError(409, f"You already created this {rtype} repo", url=self._web(repo))
        return _json({"url": self._web(repo), "name": repo_id, "id": repo_id})

    def _delete_repo(self, h, q, body) -> _Resp:
        user, payload = self._user(h), json.loads(body or b"{}")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        self._check_write(user, repo_id)
        with self._lock:
            self._repo(payload.get("type") or "model", repo_id)
            del self.repos[(payload.get("type") or "model", repo_id)]
        return _json({})

    def _info(self, h, q, rtype, repo_id, rev) -> _Resp:
        repo = self._can_read(self._user(h), self._repo(rtype, repo_id))
        commit = self._resolve(repo, rev)
        blobs = str(q.get("blobs", "")).lower() in ("1", "true")
        siblings = []
        for path, e in sorted(commit.tree.items()):
            s: dict[str, Any] = {"rfilename": path}
            if blobs:
                s.update(size=e.size, blobId=e.blob_id)
                if e.lfs:
                    s["lfs"] = {"size": e.size, "sha256": e.sha256, "pointerSize": len(lfs_pointer(e.sha256, e.size))}
            siblings.append(s)
        data = {"_id": hashlib.md5(f"{rtype}/{repo_id}".encode()).hexdigest()[:24], "id": repo_id,
                "author": repo_id.split("/")[0], "sha": commit.oid, "lastModified": commit.date,
                "createdAt": repo.created, "private": repo.private, "disabled": False,
                "gated": "manual" if repo.id in self.gated else False,
                "downloads": 0, "likes": 0, "tags": [], "siblings": siblings, "xetEnabled": False,
                "usedStorage": sum(e.size for e in commit.tree.values())}
        if rtype == "space":
            data.update(sdk="static", runtime={"stage": "RUNNING"})
        return _json(data)

    def _file_json(self, repo: Repo, commit: Commit, path: str, expand: bool) -> dict:
        if path in commit.tree:
            e = commit.tree[path]
            d: dict[str, Any] = {"type": "file", "oid": e.blob_id, "size": e.size, "path": path}
            if e.lfs:
                d["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": len(lfs_pointer(e.sha256, e.size))}
        else:
            children = sorted((p, e.blob_id) for p, e in commit.tree.items() if p.startswith(path + "/"))
            d = {"type": "directory", "oid": hashlib.sha1(json.dumps(children).encode()).hexdigest(), "size": 0,
                 "path": path}
        if expand:
            last = commit
            for c in self.history(repo.id, commit.oid, repo.type):  # newest first: last commit touching the path
                parent = repo.commits.get(c.parent) if c.parent else None
                if parent is None or parent.tree.get(path) != c.tree.get(path) or d["type"] == "directory":
                    last = c
                    break
            d["lastCommit"] = {"id": last.oid, "title": last.title, "date": last.date}
        return d

    def _listing(self, commit: Commit, base: str, recursive: bool) -> list[str]:
        prefix = base + "/" if base else ""
        out: set[str] = set()
        for p in commit.tree:
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            if recursive:
                out.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            else:
                out.add(prefix + parts[0])
        return sorted(out)

    def _tree(self, h, q, rtype, repo_id, rev, path_segs) -> _Resp:
        repo = self._can_read(self._user(h), self._repo(rtype, repo_id))
        commit = self._resolve(repo, rev)
        base = "/".join(path_segs).strip("/")
        truthy = lambda v: str(v).lower() in ("1", "true")  # noqa: E731
        recursive, expand = truthy(q.get("recursive", "")), truthy(q.get("expand", ""))
        paths = self._listing(commit, base, recursive)
        if base and (base in commit.tree or not paths):
            raise HubError(404, f"{base} does not exist (or is not a folder) on {rev}", "EntryNotFound",
                           {"X-Repo-Commit": commit.oid})
        start = int(q.get("cursor", 0))
        page = paths[start:start + self.tree_page_size]
        headers = {}
        if start + self.tree_page_size < len(paths):
            nxt = urlencode({**q, "cursor": start + self.tree_page_size})
            headers["Link"] = f'<{self.url}{urlsplit(h.path).path}?{nxt}>; rel="next"'
        return _json([self._file_json(repo, commit, p, expand) for p in page], headers=headers)

    def _paths_info(self, h, body, rtype, repo_id, rev) -> _Resp:
        repo = self._can_read(self._user(h), self._repo(rtype, repo_id))
        commit = self._resolve(repo, rev)
        if h.headers.get("Content-Type", "").startswith("application/json"):
            data = json.loads(body)
            paths, expand = data.get("paths", []), bool(data.get("expand"))
        else:
            form = parse_qs(body.decode())
            paths, expand = form.get("paths", []), form.get("expand", ["False"])[-1].lower() == "true"
        out = []
        for path in paths:
            path = path.strip("/")
            if path in commit.tree or any(p.startswith(path + "/") for p in commit.tree):
                out.append(self._file_json(repo, commit, path, expand))
        return _json(out)

    def _preupload(self, h, body, rtype, repo_id, rev) -> _Resp:
        user, repo = self._user(h), self._repo(rtype, repo_id)
        self._check_write(user, repo_id)
        commit = self._resolve(repo, rev)
        files = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f.get("sample", ""))
            lfs = self._is_lfs(commit.tree, f["path"], int(f.get("size", 0)), sample)
            existing = commit.tree.get(f["path"])
            oid = (existing.sha256 if existing.lfs else existing.blob_id) if existing else None
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        return _json({"files": files, "commitOid": commit.oid})

    def _lfs_batch(self, h, body, rtype, repo_id) -> _Resp:
        user, repo = self._user(h), self._repo(rtype, repo_id)
        self._check_write(user, repo_id)
        payload = json.loads(body)
        if payload.get("operation") != "upload":
            raise HubError(422, "Only the upload operation is supported")
        multipart = self.multipart_chunk_size and "multipart" in payload.get("transfers", ["basic"])
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], int(obj["size"])
            out: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not (oid in repo.lfs and self._object(oid).exists()):
                href = f"{self.url}/_lfs/{rtype}/{repo_id}/{oid}"
                upload: dict[str, Any] = {"href": href}
                if multipart and size > self.multipart_chunk_size:
                    n = -(-size // self.multipart_chunk_size)
                    upload = {"href": f"{href}/complete", "header": {"chunk_size": str(self.multipart_chunk_size)}}
                    upload["header"].update({str(i): f"{href}/part/{i}" for i in range(1, n + 1)})
                verify = {"href": f"{self._web(repo)}.git/info/lfs/objects/verify", "header": {}}
                out["actions"] = {"upload": upload, "verify": verify}
            objects.append(out)
        return _Resp(200, json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
                     {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, h, rtype, repo_id, oid, part: int | None) -> _Resp:
        repo = self._repo(rtype, repo_id)
        name = f"{rtype}-{repo_id.replace('/', '--')}-{oid}" + (f".part{part:05d}" if part else "")
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix=name + ".", suffix=".tmp")
        sha = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            for chunk in h.iter_body():
                sha.update(chunk)
                f.write(chunk)
        digest = sha.hexdigest()
        if part is not None:
            os.replace(tmp_name, self.root / "tmp" / name)
            return _Resp(200, b"", {"ETag": f'"{digest}"'})
        if digest != oid:
            os.unlink(tmp_name)
            raise HubError(400, f"sha256 mismatch: expected {oid}, got {digest}")
        self._store_file(Path(tmp_name), oid)
        with self._lock:
            repo.lfs.add(oid)
            self.uploaded_oids.append(oid)
        return _Resp(200, b"", {"ETag": f'"{oid}"'})

    def _lfs_complete(self, rtype, repo_id, oid, body) -> _Resp:
        repo = self._repo(rtype, repo_id)
        payload = json.loads(body)
        prefix = f"{rtype}-{repo_id.replace('/', '--')}-{oid}"
        fd, tmp_name = tempfile.mkstemp(dir=self.root / "tmp", prefix=prefix + ".", suffix=".tmp")
        sha = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in sorted(payload["parts"], key=lambda p: p["partNumber"]):
                part_path = self.root / "tmp" / f"{prefix}.part{part['partNumber']:05d}"
                if not part_path.exists():
                    raise HubError(400, f"Missing part {part['partNumber']}")
                data = part_path.read_bytes()
                sha.update(data)
                out.write(data)
        if sha.hexdigest() != oid:
            os.unlink(tmp_name)
            raise HubError(400, f"sha256 mismatch after multipart completion for {oid}")
        self._store_file(Path(tmp_name), oid)
        for p in (self.root / "tmp").glob(prefix + ".part*"):
            p.unlink(missing_ok=True)
        with self._lock:
            repo.lfs.add(oid)
            self.uploaded_oids.append(oid)
        return _json({})

    def _lfs_verify(self, h, body, rtype, repo_id) -> _Resp:
        repo = self._repo(rtype, repo_id)
        self._check_write(self._user(h), repo_id)
        payload = json.loads(body)
        path = self._object(payload["oid"])
        if payload["oid"] not in repo.lfs or not path.exists() or path.stat().st_size != payload["size"]:
            raise HubError(404, f"LFS object {payload['oid']} not found")
        return _json({})

    def _commit_api(self, h, q, body, rtype, repo_id, rev) -> _Resp:
        user, repo = self._user(h), self._repo(rtype, repo_id)
        self._check_write(user, repo_id)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next((x["value"] for x in lines if x["key"] == "header"), {})
        ops = []
        for item in lines:
            key, v = item["key"], item["value"]
            if key == "file":
                data = base64.b64decode(v["content"]) if v.get("encoding") == "base64" else v["content"].encode()
                ops.append(("add", v["path"], self._entry(self._store_bytes(data), len(data), False)))
            elif key == "lfsFile":
                obj = self._object(v["oid"])
                if v["oid"] not in repo.lfs or not obj.exists():
                    raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                        f"does not exist: {v['path']} ({v['oid']})")
                ops.append(("add", v["path"], Entry(obj.stat().st_size, v["oid"], True,
                                                    git_blob_id(lfs_pointer(v["oid"], obj.stat().st_size)))))
            elif key in ("deletedFile", "deletedFolder"):
                ops.append(("delete" if key == "deletedFile" else "delete_folder", v["path"], None))
            elif key != "header":
                raise HubError(400, f"Unsupported commit operation {key}")
        create_pr = str(q.get("create_pr", "")).lower() in ("1", "true")
        with self._lock:
            if create_pr:
                base = self._resolve(repo, rev)
                repo.num_prs += 1
                ref = f"refs/pr/{repo.num_prs}"
                repo.refs[ref] = base.oid
            else:
                ref = self._branch_ref(repo, rev)
            try:
                oid = self._commit(repo, ref, ops, header.get("summary", ""), header.get("description", ""),
                                   header.get("parentCommit"))
            except HubError:
                if create_pr:  # no PR without its commit
                    del repo.refs[ref]
                    repo.num_prs -= 1
                raise
        pr_url = f"{self._web(repo)}/discussions/{repo.num_prs}" if create_pr else None
        return _json({"success": True, "commitOid": oid, "commitUrl": f"{self._web(repo)}/commit/{oid}",
                      "pullRequestUrl": pr_url, "hookOutput": ""})

    def _branch(self, h, body, rtype, repo_id, branch, create: bool) -> _Resp:
        user, repo = self._user(h), self._repo(rtype, repo_id)
        self._check_write(user, repo_id)
        ref = f"refs/heads/{branch}"
        with self._lock:
            if not create:
                if ref not in repo.refs or branch == "main":
                    raise HubError(404 if ref not in repo.refs else 403, f"Cannot delete branch {branch}")
                del repo.refs[ref]
                return _json({})
            if ref in repo.refs:
                raise HubError(409, f"Branch {branch} already exists")
            start = (json.loads(body) if body else {}).get("startingPoint") or "main"
            repo.refs[ref] = self._resolve(repo, start).oid
        return _json({})

    def _tag(self, h, body, rtype, repo_id, rev) -> _Resp:
        user, repo = self._user(h), self._repo(rtype, repo_id)
        self._check_write(user, repo_id)
        tag = json.loads(body)["tag"]
        with self._lock:
            if f"refs/tags/{tag}" in repo.refs:
                raise HubError(409, f"Tag {tag} already exists")
            repo.refs[f"refs/tags/{tag}"] = self._resolve(repo, rev).oid
        return _json({})

    def _refs(self, h, q, rtype, repo_id) -> _Resp:
        repo = self._can_read(self._user(h), self._repo(rtype, repo_id))
        groups: dict[str, list] = {"branches": [], "converts": [], "tags": [], "pullRequests": []}
        kinds = {"refs/heads/": "branches", "refs/tags/": "tags", "refs/pr/": "pullRequests"}
        for ref, oid in sorted(repo.refs.items()):
            for prefix, group in kinds.items():
                if ref.startswith(prefix):
                    groups[group].append({"name": ref[len(prefix):], "ref": ref, "targetCommit": oid})
        if not q.get("include_prs"):
            groups.pop("pullRequests")
        return _json(groups)

    def _commits(self, h, rtype, repo_id, rev) -> _Resp:
        repo = self._can_read(self._user(h), self._repo(rtype, repo_id))
        self._resolve(repo, rev)
        return _json([{"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
                       "authors": [{"user": self.user}]} for c in self.history(repo_id, rev, rtype)])

    def _resolve_file(self, h, rtype, repo_id, rev, path) -> _Resp:
        user = self._user(h)
        repo = self._can_read(user, self._repo(rtype, repo_id))
        commit = self._resolve(repo, rev)
        if repo_id in self.gated and user not in self.gated[repo_id]:
            if user is None:
                raise HubError(401, f"Access to model {repo_id} is restricted. You must have access to it and be "
                                    "authenticated to access it. Please log in.", "GatedRepo")
            raise HubError(403, f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                                f"Visit {self._web(repo)} to ask for access.", "GatedRepo")
        entry = None if (repo_id, path) in self.hidden_files else commit.tree.get(path)
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        etag = entry.sha256 if entry.lfs else entry.blob_id
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
        data = self.replaced.get((repo_id, path))
        size = entry.size if data is None else len(data)
        start, end, status = 0, size - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", h.headers.get("Range") or "")
        if m and size:  # one range, as RFC 9110 section 14: first-last, first-, or -suffix
            if m[1]:
                start, end = int(m[1]), min(int(m[2]), size - 1) if m[2] else size - 1
            else:
                start = max(size - int(m[2] or 0), 0)
            if start > end:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        held = self.held.get((repo_id, path))
        if h.command == "GET" and held is not None and not h.headers.get("Range"):
            held[0].set()
            held[1].wait(120)
        if h.command == "GET":
            with self._lock:
                self.served.append((repo_id, path, status, start, end - start + 1))
                self.served_pids.append(h.client_pid() if self.track_clients else None)
        body = (self._object(entry.sha256), start, end - start + 1) if data is None else data[start:end + 1]
        return _Resp(status, body, headers)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that went away (a killed process) is not a server error: say nothing; print the others."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "expq-test-hub/1.0"
    server_hub: HubServer
    timeout = 60  # idle keep-alive connections are closed after this many seconds
    _body_read = False

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    _pid: int | None = None
    _pid_known = False

    def client_pid(self) -> int | None:
        """The process holding the client end of this connection (looked up once per connection)."""
        if not self._pid_known:
            self._pid, self._pid_known = _socket_owner(self.client_address[1], self.server.server_address[1]), True
        return self._pid

    def iter_body(self) -> Iterator[bytes]:
        """The request body, decoded from Content-Length or chunked framing (read at most once)."""
        if self._body_read:
            return
        self._body_read = True
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield from self._read_exactly(size)
                self.rfile.readline()
        else:
            yield from self._read_exactly(int(self.headers.get("Content-Length") or 0))

    def _read_exactly(self, n: int) -> Iterator[bytes]:
        while n:
            chunk = self.rfile.read(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("client closed the connection mid-body")
            n -= len(chunk)
            yield chunk

    def drain(self) -> None:
        try:
            for _ in self.iter_body():
                pass
        except (OSError, ValueError):
            self.close_connection = True

    def send(self, resp: _Resp, head: bool) -> None:
        length = resp.body[2] if isinstance(resp.body, tuple) else len(resp.body)
        self.send_response(resp.status)
        for k, v in resp.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if head:
            return
        if isinstance(resp.body, tuple):
            path, offset, remaining = resp.body
            with open(path, "rb") as f:
                f.seek(offset)
                while remaining > 0:
                    chunk = f.read(min(remaining, 1 << 20))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    remaining -= len(chunk)
        else:
            self.wfile.write(resp.body)

    def _do(self) -> None:
        self._body_read = False  # one handler serves all the requests of a keep-alive connection
        try:
            self.server_hub.handle(self, self.command)
        except (ConnectionError, BrokenPipeError, socket.timeout):
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _do


def _socket_owner(client_port: int, server_port: int) -> int | None:
    """Linux: the process with an open TCP socket from local port ``client_port`` to ``server_port`` (the socket's
    inode from /proc/net/tcp, then the process whose /proc/PID/fd links to it)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == client_port and int(f[2].rsplit(":", 1)[1], 16) == server_port:
                inode = f[9]
                break
        if inode:
            break
    if not inode:
        return None
    target = f"socket:[{inode}]"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    return int(proc.name)
            except OSError:  # closed meanwhile
                continue
    return None


# ---------------------------------------------------------------------- client-side helpers (lazy imports)
def configure_hf_client(
    monkeypatch, endpoint: str, home: str | os.PathLike, token: str | None, *, progress_bars: bool = False
) -> None:
    """Point `huggingface_hub` (1.x/2.x) at `endpoint` with a private HF_HOME, through env vars *and* the values
    it copied from them at import time (huggingface_hub.constants, the module-level HfApi instance).
    Also disables Xet (HF_HUB_DISABLE_XET=1), telemetry, and huggingface_hub's own progress bars (unless asked)."""
    home = Path(home)
    cache = home / "hub"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE",
                "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_ASSETS_CACHE", "HF_ASSETS_CACHE",
                "HF_XET_CACHE", "HUGGINGFACE_CO_STAGING", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ENABLE_HF_TRANSFER": "0", "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    if token is not None:
        env["HF_TOKEN"] = token
    for var, value in env.items():
        monkeypatch.setenv(var, value)

    import huggingface_hub
    from huggingface_hub import constants

    values = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HUGGINGFACE_HUB_CACHE": str(cache),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HUGGINGFACE_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
    }
    if hasattr(constants, "HF_URL_HOSTS"):
        values["HF_URL_HOSTS"] = frozenset(constants.HF_URL_HOSTS) | {"127.0.0.1"}
    for name, value in values.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    # Modules that did `from ..constants import X` at import time.
    for module_name, name, value in (
        ("huggingface_hub.utils._cache_manager", "HF_HUB_CACHE", str(cache)),
        ("huggingface_hub.utils._cache_assets", "HF_ASSETS_CACHE", str(home / "assets")),
        ("huggingface_hub.utils.tqdm", "HF_HUB_DISABLE_PROGRESS_BARS", None if progress_bars else True),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)
    # Module-level functions (huggingface_hub.create_repo, upload_folder, ...) are bound to an HfApi built at import.
    monkeypatch.setattr(importlib.import_module("huggingface_hub.hf_api").api, "endpoint", endpoint)
    close_session = getattr(huggingface_hub, "close_session", None)
    if close_session is not None:  # drop pooled connections to a previous test's server
        close_session()


def set_hf_offline(monkeypatch, offline: bool = True) -> None:
    """Switch `huggingface_hub` offline mode (HF_HUB_OFFLINE) on or off, env var and import-time constant."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)

"""Turning a Hub repo id into a local snapshot: which files to fetch, fetching them with ``huggingface_hub``, and
errors that say what really went wrong.

Steps (``fetch``): list the revision's files (``repo_info``) → read the safetensors index (``hf_hub_download``) →
choose the files (``select_files``: the shards the index names, the index, and the side files at the repo root) →
``snapshot_download(allow_patterns=...)`` of exactly those. Offline (``HF_HUB_OFFLINE``, no network, a Hub outage)
the same choice is made from the local cache (``from_cache``), and a missing file or ``refs/`` entry is named.

Hub snapshots are symlinks into the cache's ``blobs/``; the returned directory is used as it is.

For ``--stream`` (``hub.stream``), ``fetch_listing`` makes the same choice from a listing with sizes and LFS sha256,
downloads only the index and side files (into the stream folder), and ``read_remote_header`` reads each shard's
header with HTTP range requests. Every failure of the Hub is named by ``hub.errors.translate``, as on the way up.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExpqError, HubError, HubNotFoundError, HubOfflineError, IncompleteCacheError, SourceError
from ..io.hashing import git_blob_id, sha256_file
from ..io.index import INDEX_NAME, Index, is_weight_file, read_index, weight_files
from ..io.safetensors import Shard, header_length, parse_header
from .errors import OFFLINE, offline_reason, translate

COMMIT = re.compile(r"[0-9a-f]{40}")


def select_files(repo: str, revision: str, paths: list[str], index: Index | None) -> list[str]:
    """The files of a Hub checkpoint that expq needs, sorted.

    Args:
        repo, revision: for error messages.
        paths: every file of the revision (repo-relative, ``/``-separated).
        index: the index (None when there is none, or it is not valid: then only the index file itself is
            chosen and ``open_source`` reports what is wrong with it).

    Returns:
        the shards the index names (or the single ``model.safetensors``, or the one root ``*.safetensors``), the
        index, and every other root-level file that is not a weight file and not hidden (config, tokenizer,
        generation config, chat template, licence, README, remote code ``*.py``). Never a subfolder file the index
        does not name (``onnx/``, ``metal/``, ``original/``), nor an unindexed weight file.

    Raises:
        HubError: no ``*.safetensors`` weights, or several at the root without an index (exit status 1).
    """
    side = [p for p in paths if "/" not in p and not p.startswith(".") and not is_weight_file(p) and p != INDEX_NAME]
    try:
        weights = weight_files(paths, index)
    except SourceError as e:
        raise HubError(e.message, repo=repo, revision=revision) from None
    return sorted(set(side) | set(weights) | ({INDEX_NAME} if INDEX_NAME in paths else set()))


def index_or_none(path: Path | None) -> Index | None:
    """The index at ``path`` (``io.index.read_index``), or None when there is none or it is not valid (the
    conversion's ``open_source`` then names what is wrong with it)."""
    if path is None or not path.is_file():
        return None
    try:
        return read_index(path)
    except SourceError:
        return None


def fetch(repo: str, *, revision: str | None = None, token: str | bool | None = None) -> tuple[Path, str]:
    """Download (or find in the cache) the files expq needs from a Hub repo; the user's cache, token,
    ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are honoured.

    Returns:
        (the snapshot directory, its commit sha).

    Raises:
        HubNotFoundError (3): the repo, the revision or a file the index names does not exist.
        HubAccessError (4): gated repo not granted, or 403 forbidden. HubAuthError (5): the token was rejected (401).
        HubOfflineError (6): the Hub cannot be used and the revision is not cached.
        IncompleteCacheError (7): offline, and the cache lacks a needed file or the ``refs/`` entry of a branch.
        HubError (1): no config.json or no usable safetensors weights in the repo, or another Hub failure.
    """
    from huggingface_hub import constants, snapshot_download

    rev = revision or "main"
    if constants.HF_HUB_OFFLINE:
        return from_cache(repo, rev, OFFLINE)
    try:
        info, files = _choose(repo, rev, token)
        local = Path(snapshot_download(repo, revision=rev, token=token,
                                       allow_patterns=[glob.escape(f) for f in files]))
    except ExpqError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure is classified; the rest is re-raised
        reason = offline_reason(e)
        if reason is None:
            raise translate(e, repo=repo, revision=rev, token=token) from None
        return from_cache(repo, rev, reason)
    if local.name != info.sha:
        raise HubError(f"{rev} moved from {info.sha} to {local.name} during the download", repo=repo, revision=rev,
                       hint=f"run again, or pin --revision {local.name}")
    return local, info.sha


def _choose(repo: str, rev: str, token: str | bool | None, *, local_dir: Path | None = None,
            files_metadata: bool = False):
    """(the revision's ``ModelInfo``, the files expq needs from it: ``select_files``'s choice). The index is
    downloaded to read its weight map: into the cache, or into ``local_dir``. ``files_metadata``: the listing
    carries each file's size and LFS sha256.

    Raises:
        HubError: no config.json at the root; ``select_files``'s errors. HubNotFoundError: the index names a file
            the commit does not have. Failures of the Hub calls themselves are huggingface_hub's exceptions.
    """
    from huggingface_hub import HfApi, hf_hub_download

    info = HfApi(token=token).model_info(repo, revision=rev, token=token, files_metadata=files_metadata)
    paths = [s.rfilename for s in info.siblings or []]
    if "config.json" not in paths:
        raise HubError("no config.json at the repo root: not a Hugging Face checkpoint", repo=repo, revision=rev)
    index = None
    if INDEX_NAME in paths:
        index = Path(hf_hub_download(repo, INDEX_NAME, revision=info.sha, token=token, local_dir=local_dir))
    files = select_files(repo, rev, paths, index_or_none(index))
    absent = sorted(set(files) - set(paths))
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise HubNotFoundError(f"{INDEX_NAME} names this file but commit {info.sha} does not have it{more}",
                               repo=repo, revision=rev, file=absent[0])
    return info, files


# --- --stream: the listing and side files now, the shards' headers by ranged reads, the shards later ---------------
@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub revision as its listing gives it: ``size`` in bytes, and what its content must hash to:
    ``sha256`` (the LFS oid) for an LFS file, else ``blob_id`` (the git blob id: sha1 of ``blob <size>\\0`` +
    content)."""

    path: str
    size: int
    sha256: str | None
    blob_id: str | None

    def mismatch(self, path: Path) -> str | None:
        """None when the file at ``path`` has this size and content hash, else what differs (for an error line).

        Raises:
            OSError: the file cannot be read.
        """
        got = path.stat().st_size
        if got != self.size:
            return f"downloaded {got} bytes but the Hub lists {self.size}"
        if self.sha256 is not None:
            have, want, what = sha256_file(path), self.sha256, "the LFS oid (sha256)"
        elif self.blob_id is not None:
            have, want, what = git_blob_id(path), self.blob_id, "the git blob id"
        else:
            return None
        if have != want:
            return f"the downloaded content hashes to {have[:16]}..., not to {what} {want[:16]}... the Hub lists"
        return None


@dataclass(frozen=True)
class StreamListing:
    """What ``fetch_listing`` found: the repo, the revision asked for and the commit it is (every download is
    pinned to it), the token, the weight files with their sizes and hashes (name order) and the other files
    (already downloaded); ``endpoint``: the Hub it was listed from (``--ray`` tasks, in other processes, download
    from the same one)."""

    repo: str
    revision: str
    commit: str
    token: str | bool | None
    weights: dict[str, RemoteFile]
    side: list[str]
    endpoint: str | None = None

    def where(self, rel: str) -> str:
        """How error lines name a file of the repo before it is downloaded: ``hf://org/name[@revision]/path``."""
        at = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf://{self.repo}{at}/{rel}"


def fetch_listing(repo: str, folder: Path, *, revision: str | None = None,
                  token: str | bool | None = None) -> StreamListing:
    """``--stream``: list a Hub revision's files (sizes and LFS sha256), choose them as ``fetch`` does
    (``select_files``), and download the index and the side files (config, tokenizer...: small) into ``folder``
    with ``hf_hub_download(local_dir=...)``, pinned to the revision's commit. The weight files stay on the Hub; the
    Hub cache is not written.

    Raises:
        HubOfflineError (6): ``HF_HUB_OFFLINE`` is set or the Hub cannot be reached (a stream needs the Hub; without
            ``--stream`` the cache is used). The other HubErrors as ``fetch``.
    """
    from huggingface_hub import constants, hf_hub_download

    rev = revision or "main"
    if constants.HF_HUB_OFFLINE:
        raise HubOfflineError(f"--stream downloads from the Hub, and {OFFLINE}", repo=repo, revision=rev,
                              hint="convert without --stream to use the local cache")
    try:
        info, files = _choose(repo, rev, token, local_dir=folder, files_metadata=True)
        listed = {s.rfilename: s for s in info.siblings or []}
        weights = {f: _remote_file(listed[f]) for f in files if is_weight_file(f)}
        side = [f for f in files if f not in weights]
        for f in side:
            if f != INDEX_NAME:
                hf_hub_download(repo, f, revision=info.sha, token=token, local_dir=folder)
    except ExpqError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure is classified; the rest is re-raised
        raise translate(e, repo=repo, revision=rev, token=token) from None
    return StreamListing(repo, rev, info.sha, token, weights, side, endpoint=constants.ENDPOINT)


def _remote_file(sibling) -> RemoteFile:
    lfs = sibling.lfs
    size = lfs.size if lfs is not None else sibling.size
    return RemoteFile(sibling.rfilename, int(size or 0), lfs.sha256 if lfs is not None else None,
                      None if lfs is not None else sibling.blob_id)


def read_remote_header(listing: StreamListing, rel: str, path: Path) -> Shard:
    """One weight file's header, read from the Hub without any of its tensor data: two ranged GETs (its 8-byte
    length, then exactly the header) through huggingface_hub's session, validated by ``io.safetensors.parse_header``
    against the size the listing gives (so a header that does not cover the file is refused before the download).

    Args:
        path: where the file will be under the stream folder (``Shard.path``).

    Raises:
        SourceError: the header is not valid (``read_header``'s checks), naming ``hf://repo/file``.
        HubError: the Hub refused or failed the reads (``hub.errors.translate``).
    """
    from huggingface_hub import hf_hub_url

    f, where = listing.weights[rel], listing.where(rel)
    url = hf_hub_url(listing.repo, rel, revision=listing.commit)
    try:
        n = header_length(_read_range(url, 0, min(8, f.size), listing.token), f.size, where)
        blob = _read_range(url, 8, n, listing.token)
    except ExpqError:
        raise
    except Exception as e:  # noqa: BLE001 - classified as for every Hub call
        raise translate(e, repo=listing.repo, revision=listing.revision, file=rel, token=listing.token) from None
    if len(blob) != n:
        raise SourceError(f"short read of the header ({len(blob)} of {n} bytes): file changed or truncated",
                          file=where)
    return parse_header(blob, f.size, rel, path=path, where=where)


def _read_range(url: str, start: int, length: int, token: str | bool | None) -> bytes:
    """``length`` bytes of a file from byte ``start`` (an HTTP range request; retried as huggingface_hub retries).
    A server that ignores the range is read only as far as needed."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    if length <= 0:
        return b""
    headers = {**build_hf_headers(token=token), "Range": f"bytes={start}-{start + length - 1}"}
    with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0
        got = bytearray()
        for chunk in r.iter_bytes():
            got += chunk
            if len(got) >= skip + length:
                break
    return bytes(got[skip:skip + length])


def from_cache(repo: str, revision: str, reason: str) -> tuple[Path, str]:
    """The cached snapshot of ``repo`` at ``revision``, without any network call, checked to hold every file expq
    needs (the ones ``select_files`` chooses from the cached file list, or from what the snapshot holds).

    Args:
        reason: why the Hub is not used (for the message), e.g. "HF_HUB_OFFLINE is set".

    Returns:
        (the snapshot directory, its commit sha).

    Raises:
        HubOfflineError: nothing of the repo (or of that commit) is cached.
        IncompleteCacheError: a branch or tag without its ``refs/`` entry (the message suggests ``--revision <sha>``),
            or a needed file missing from the snapshot (named).
    """
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(constants.HF_HUB_CACHE).expanduser()
    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    snapshots = storage / "snapshots"
    cached = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    if COMMIT.fullmatch(revision):
        commit = revision
    elif (storage / "refs" / revision).is_file():
        commit = (storage / "refs" / revision).read_text().strip()
    elif cached:
        raise IncompleteCacheError(f"not resolvable offline ({reason}): the cache has no refs/{revision} saying "
                                   f"which commit {revision} is", repo=repo, revision=revision,
                                   hint=f"cached commits: {', '.join(cached[:3])}; pass --revision {cached[-1]}"
                                   if len(cached) > 1 else f"pass --revision {cached[0]}")
    else:
        raise HubOfflineError(f"not in the local cache ({cache}) and {reason}", repo=repo, revision=revision,
                              hint=_online_hint(reason))
    snap = snapshots / commit
    if not snap.is_dir():
        raise HubOfflineError(f"commit {commit} is not in the local cache ({cache}) and {reason}", repo=repo,
                              revision=revision, hint=_online_hint(reason))
    paths = _cached_listing(repo, commit, cache)
    if paths is None:  # no cached file list (an older client): what the snapshot holds, plus what the index names
        paths = [p.relative_to(snap).as_posix() for p in snap.rglob("*") if not p.is_dir()] + ["config.json"]
    files = select_files(repo, revision, paths, index_or_none(snap / INDEX_NAME))
    if INDEX_NAME in files and not (snap / INDEX_NAME).is_file():
        files = [INDEX_NAME]  # what else is missing cannot be known without the index
    missing = [f for f in files if not (snap / f).exists()]  # exists(): a link into blobs/ must resolve
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])})" if len(missing) > 1 else ""
        raise IncompleteCacheError(f"missing from the cached snapshot {commit}{more}, and {reason}", repo=repo,
                                   revision=revision, file=missing[0],
                                   hint=_online_hint(reason) + " to complete the download")
    return snap, commit


def _online_hint(reason: str) -> str:
    """How to get the files: what to change depends on why the Hub was not used."""
    if reason == OFFLINE:
        return "unset HF_HUB_OFFLINE and run once with network access"
    return "run once with the Hub reachable (check the network and HF_ENDPOINT)"


def _cached_listing(repo: str, commit: str, cache: Path) -> list[str] | None:
    """The file list ``snapshot_download`` cached for a commit (huggingface_hub >= 2.3), or None."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:
        return None
    try:
        return [f.path for f in get_cached_repo_tree(repo, revision=commit, cache_dir=cache)]
    except Exception:  # noqa: BLE001 - no listing cached (CachedRepoTreeNotFoundError) or an unreadable one
        return None

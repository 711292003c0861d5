"""The source checkpoint: resolving a directory or Hub repo id, and opening it: config.json, which files are the
weights, their headers checked against the index, the side files, and the decoder for how the weights are stored.
The bytes themselves (headers, reads, the index) are read through ``expq.io``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .decoders.base import Decoder, LogicalTensor
from .errors import SourceError
from .io import files
from .io.files import Inside
from .io.regular import check_regular, read_regular
from .io.index import INDEX_NAME, check_index, is_weight_file, shard_files
from .io.safetensors import Shard, TensorInfo, json_kind, printable_name, read_header, read_tensor
from .options import check_source, is_repo_id  # noqa: F401  (is_repo_id: source.is_repo_id, as before)


@dataclass
class Source:
    """A resolved, validated source checkpoint.

    Attributes:
        root: the local directory (a Hub snapshot for a repo id; with ``--stream``, the stream folder, where the
            shards appear as they are downloaded).
        repo_id, revision, commit: where it came from when resolved from the Hub (else None).
        config: ``config.json`` as a dict.
        shards: safetensors files in name order; ``tensors``: name -> TensorInfo over all shards (as stored).
        decoder: how the source stores its weights (``decoders``); ``logical``: name -> LogicalTensor, the tensors
            as an unquantized checkpoint would hold them (what the rest of expq works on).
        side_files: every other file to copy (relative paths), sorted; ``skipped_files``: weight files not copied.
    """

    root: Path
    config: dict
    shards: list[Shard]
    tensors: dict[str, TensorInfo]
    side_files: list[str]
    skipped_files: list[str]
    decoder: Decoder
    logical: dict[str, LogicalTensor]
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    hub_sha256: dict[str, str] = field(default_factory=dict)  # Hub repo: shard -> the Hub's sha256 (LFS oid)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def id(self) -> str:
        return self.repo_id or str(self.root)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """One stored tensor (``read_tensor`` under this source's root)."""
        return read_tensor(self.root, info)

    def read_logical(self, tensor: LogicalTensor) -> torch.Tensor:
        """One logical tensor: its stored bytes, or decoded by the source's decoder (CPU tensor)."""
        if not tensor.decoded:
            return read_tensor(self.root, tensor.stored)
        return self.decoder.decode(tensor, self.read)


@dataclass(frozen=True)
class RemoteShards:
    """Shard files that are not on disk yet (``--stream``: they are downloaded while the conversion runs).

    Attributes:
        files: the weight files the repo holds that the checkpoint uses (repo paths), sorted; with an index they
            must be the files its ``weight_map`` names.
        read_header: ``read_header(rel) -> Shard`` reads one file's header without its data (same checks as
            ``read_header``; ``Shard.path`` is where the file will be under the source root).
    """

    files: list[str]
    read_header: Callable[[str], Shard]


def open_source(root: str | Path, *, repo_id: str | None = None, revision: str | None = None,
                commit: str | None = None, allow_outside_links: bool = False,
                remote: RemoteShards | None = None) -> Source:
    """Read and validate a local checkpoint directory.

    Steps: read config.json; find the shard files (index, or the single file); read and check every shard header;
    check the index against the headers; list the side files; detect the source format (``decoders``).

    Every file read or copied must stay inside ``root``: a symbolic link (or an index entry) that resolves outside it
    is refused, unless ``allow_outside_links``. In a Hub cache snapshot (``<cache>/models--org--name/snapshots/<sha>``)
    links into the repo's ``blobs/`` folder are how the cache stores files, and are accepted.

    ``remote`` (``--stream``): the shard files are not under ``root`` yet; their headers are read through
    ``remote.read_header`` and the files are looked for under ``root`` only when they are read.

    Raises:
        SourceError: missing config.json or weights, an index that names missing files or tensors, a tensor stored
            twice, a file that resolves outside the checkpoint directory, any shard error from ``read_header``, or a
            quantized format no decoder handles.
    """
    from .decoders import detect

    root = Path(root)
    if not root.is_dir():
        raise SourceError("not a directory", file=str(root))
    inside = Inside(root, enabled=not allow_outside_links)
    inside.check("config.json", "config.json")
    config = read_config(root)
    index, files = shard_files(root, remote.files if remote is not None else None)
    what = f"listed in {INDEX_NAME}, but" if index is not None else "weights file"
    if index is not None:
        inside.check(INDEX_NAME, INDEX_NAME)
    for rel in files:
        inside.check(rel, what)
    shards, tensors = _read_shards(root, files, remote.read_header if remote is not None else None)
    if index is not None:
        check_index(root, index, tensors)
    side, skipped = _side_files(root, set(files), inside)
    decoder = detect(config, tensors)
    return Source(root=root, config=config, shards=shards, tensors=tensors, side_files=side, skipped_files=skipped,
                  decoder=decoder, logical=decoder.logical_tensors(tensors), repo_id=repo_id, revision=revision,
                  commit=commit)


def refuse_links_out(root: Path) -> None:
    """Refuse a symbolic link under ``root`` that resolves outside it (for a Hub cache snapshot, outside it and its
    repo's ``blobs/``), naming the first; no link is followed to find them.

    Raises:
        SourceError: ``a symbolic link resolves to TARGET, outside the checkpoint directory``.
    """
    inside = Inside(root)
    for rel in files.links(root):
        inside.check(rel, "a symbolic link")


def read_config(root: Path) -> dict:
    """``root/config.json`` as a dict.

    Raises:
        SourceError: missing, not JSON, or not a JSON object.
    """
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise SourceError("no config.json: not a Hugging Face checkpoint directory", file=str(root))
    raw = read_regular(cfg_path, "config.json", MAX_CONFIG_BYTES)
    try:
        config = json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"not valid JSON: {e}", file=str(cfg_path)) from None
    except RecursionError:
        raise SourceError("not valid JSON: nested too deeply", file=str(cfg_path)) from None
    if not isinstance(config, dict):
        raise SourceError("config.json must hold a JSON object", file=str(cfg_path))
    _refuse_long_ints(config, cfg_path)
    check_config_types(config, cfg_path)
    return config


MAX_CONFIG_BYTES = 64 << 20  # config.json (real ones are a few KiB; some carry large vocab tables)
MAX_INT_DIGITS = 4300  # Python's default limit on converting decimal strings to int


class _LongInt(str):
    """An integer literal with more digits than Python converts (kept as text, found and named afterwards)."""


def _bounded_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _LongInt(text)


def _refuse_long_ints(config: dict, cfg_path: Path) -> None:
    """Refuse an integer longer than Python converts, naming its dotted key (walked without recursion)."""
    todo: list[tuple[Any, str]] = [(config, "")]
    while todo:
        v, key = todo.pop()
        if isinstance(v, _LongInt):
            raise SourceError(f"{printable_name(key) or 'the top level'} is an integer of {len(v.lstrip('-'))} digits "
                              f"(at most {MAX_INT_DIGITS})", file=str(cfg_path))
        if isinstance(v, dict):
            todo += [(x, f"{key}.{k}" if key else str(k)) for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(x, f"{key}[{i}]") for i, x in enumerate(v)]


def check_config_types(config: dict, cfg_path: Path | str = "config.json") -> None:
    """Check the types of the config.json keys that name the model: ``model_type`` (a string), ``architectures`` (a
    list of strings) and the nested model configs (``text_config``...: objects), and the same keys inside those.
    ``null`` counts as absent. The numbers expq reads are checked where they are read (``experts``, ``layouts``).

    Example:
        >>> check_config_types({"model_type": "mixtral", "text_config": "qwen3"})
        Traceback (most recent call last):
        expq.errors.SourceError: file config.json: text_config must be a JSON object, got "qwen3"

    Raises:
        SourceError: one line naming config.json and the key (dotted for nested keys).
    """
    from .layouts import shared_facts

    nested = shared_facts().nested_config_sections
    scopes = [("", config)]
    for n in nested:
        v = config.get(n)
        if v is not None and not isinstance(v, dict):
            raise SourceError(f"{n} must be a JSON object, got {json_kind(v)}", file=str(cfg_path))
        if v is not None:
            scopes.append((f"{n}.", v))
    for prefix, scope in scopes:
        mt = scope.get("model_type")
        if mt is not None and not isinstance(mt, str):
            raise SourceError(f"{prefix}model_type must be a string, got {json_kind(mt)}", file=str(cfg_path))
        archs = scope.get("architectures")
        if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
            raise SourceError(f"{prefix}architectures must be a list of strings, got {json_kind(archs)}",
                              file=str(cfg_path))


def _read_shards(root: Path, files: list[str], remote: Callable[[str], Shard] | None = None
                 ) -> tuple[list[Shard], dict[str, TensorInfo]]:
    shards, tensors = [], {}
    for sh in _headers(root, files, remote):
        p = sh.path
        shards.append(sh)
        for ti in sh.tensors:
            if ti.name in tensors:
                raise SourceError(f"tensor stored twice (also in {tensors[ti.name].file})", file=str(p),
                                  tensor=ti.name)
            tensors[ti.name] = ti
    return shards, tensors


def _headers(root: Path, files: list[str], remote: Callable[[str], Shard] | None):
    """Each file's Shard, in order: read from ``root``, or through ``remote`` for files not on disk yet."""
    if remote is not None:
        yield from _in_threads(remote, files)
        return
    for rel in files:
        p = root / rel
        if not p.exists():
            raise SourceError(f"listed in {INDEX_NAME} but missing", file=str(p))
        yield read_header(p, rel)


def _in_threads(fn: Callable[[str], Shard], files: list[str], threads: int = 8):
    """``fn`` over ``files`` on a few threads (remote header reads are round trips), results in order; the first
    error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(files)))) as pool:
        futures = [pool.submit(fn, rel) for rel in files]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def _side_files(root: Path, shards: set[str], inside: Inside | None = None) -> tuple[list[str], list[str]]:
    """(files to copy, weight files in other formats that are not copied), relative paths, sorted. Each file to copy
    must stay inside the checkpoint directory (``inside``); a link to a missing file is refused."""
    side, skipped = [], []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        if p.is_dir() or rel in shards or rel in (INDEX_NAME, "config.json"):
            continue
        if is_weight_file(rel):
            skipped.append(rel)
            continue
        if inside is not None:
            inside.check(rel, "side file")
        if not p.exists():
            raise SourceError(f"side file is a symbolic link to a missing file ({os.readlink(p)})", file=str(p))
        check_regular(p, "side file")  # a named pipe would block the copy, a device never end it
        side.append(rel)
    return side, skipped


def resolve_source(src: str | Path, *, revision: str | None = None, token: str | bool | None = None) -> Source:
    """Open ``src``: an existing local directory, else a Hub repo id fetched with ``huggingface_hub``.

    A Hub repo is fetched by ``hub.download.fetch``: the user's cache and token, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``
    are honoured, and only the files a conversion needs are downloaded (the shards its index names, the index, and
    the root-level side files: no ``onnx/``, ``metal/``, ``original/``, no unindexed or other-format weights).

    Raises:
        SourceError: the directory is not a checkpoint. UsageError: ``src`` is neither a directory nor a repo id.
        HubNotFoundError (exit 3), HubAccessError (4), HubAuthError (5), HubOfflineError (6), IncompleteCacheError
            (7): see ``hub.download.fetch``; all are ``SourceError`` subclasses.
    """
    p = Path(src).expanduser()
    if p.exists():
        if revision is not None:
            raise SourceError("--revision applies to Hub repo ids, not to a local directory", file=str(p))
        src = open_source(p)
        src.commit = local_download_commit(src)
        return src
    s = str(src)
    check_source(s)
    from .hub.download import fetch

    local, commit = fetch(s, revision=revision, token=token)
    src = open_source(local, repo_id=s, revision=revision or "main", commit=commit)
    src.hub_sha256 = {sh.file: _blob_name(sh.path) for sh in src.shards}
    return src


def _blob_name(path: Path) -> str:
    """The name of the cache blob a Hub snapshot file links to: the Hub's ETag of the file, which for an LFS file
    (every shard) is its sha256, as the Hub lists it. Read from the link, no byte of the file."""
    return Path(os.path.realpath(path)).name


def local_download_commit(src: Source) -> str | None:
    """The Hub commit a ``hf download --local-dir`` copy came from: the one commit its
    ``.cache/huggingface/download/<file>.metadata`` records (first line) for config.json and every shard, else None
    (not such a copy, or files of different commits). The repo id is not recorded there."""
    meta = src.root / ".cache" / "huggingface" / "download"
    commits = set()
    for rel in ["config.json", *(sh.file for sh in src.shards)]:
        try:
            with open(meta / f"{rel}.metadata", encoding="utf-8") as f:
                commits.add(f.readline().strip())
        except (OSError, UnicodeDecodeError):
            return None
    (commit,) = commits if len(commits) == 1 else (None,)
    return commit if commit and re.fullmatch(r"[0-9a-f]{40}", commit) else None


# --- identity --------------------------------------------------------------------------------------------------------
def local_identity(src: Source, threads: int | None = None, cancel: threading.Event | None = None) -> list[list]:
    """A directory source's identity, what a resume and a no-op re-run compare (``conversion.run_settings``):
    [file, size, sha256] of every shard and side file (config.json first, then the shards, then the side files),
    each file read whole in chunks, ``threads`` files at a time (default: one per core, at most 8; sha256 releases
    the GIL), or taken from the hashes the command line began while it started up (``io.early_hash``: a file still
    as it was hashed). ``docs/benchmarks.md`` has what it costs against a conversion. With ``--ray`` a task calls
    it, never the driver.

    Raises:
        SourceError: a file is not a regular file or cannot be read (EIO...), naming it; or ``cancel`` was set.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .io import early_hash
    from .io.regular import sha256_regular

    def one(rel: str) -> tuple[int, str]:
        path = src.root / rel
        return early_hash.take(path, cancel) or sha256_regular(path, "source file", cancel=cancel)

    rels = ["config.json", *(sh.file for sh in src.shards), *src.side_files]
    with ThreadPoolExecutor(max_workers=threads or early_hash.identity_threads(),
                            thread_name_prefix="expq-identity") as pool:
        sums = list(pool.map(one, rels))
    return [[rel, size, digest] for rel, (size, digest) in zip(rels, sums)]

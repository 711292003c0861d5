"""The source checkpoint: resolving a directory or Hub repo id, reading the index and shard headers, validating the
files, and lazy, bounded reads of one tensor at a time.

A safetensors file is ``u64 little-endian header length | JSON header | data``; each header entry gives ``dtype``,
``shape`` and ``data_offsets`` relative to the data start (https://github.com/huggingface/safetensors). We read the
header ourselves because passthrough tensors are copied as raw bytes (byte-identical by construction, any dtype).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import SourceError
from .options import check_source, is_repo_id  # noqa: F401  (is_repo_id: source.is_repo_id, as before)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100_000_000  # the safetensors library's limit (bytes of JSON header)
MAX_USIZE = 2**64 - 1  # shapes and offsets are u64 in the library
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
ENTRY_KEYS = ("dtype", "shape", "data_offsets")

# Bits per element of every safetensors dtype.
DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64, "U32": 32,
    "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
    "C64": 64, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
}
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
ST_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = ("F32", "F16", "BF16")

# Files that hold weights in other formats (or weights the index does not reference): never copied to OUT.
WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx|tflite|ot|npz)$|(^|/)original/")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a shard: its name, safetensors dtype string, shape and absolute byte range in the file."""

    name: str
    file: str  # path relative to the checkpoint directory
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Shard:
    """One safetensors file: its tensors in file order and its ``__metadata__``."""

    file: str
    path: Path
    size: int
    tensors: list[TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)


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
    decoder: Any = None
    logical: dict[str, Any] = field(default_factory=dict)
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def id(self) -> str:
        return self.repo_id or str(self.root)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """One stored tensor (``read_tensor`` under this source's root)."""
        return read_tensor(self.root, info)

    def read_logical(self, tensor) -> torch.Tensor:
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


def read_header(path: Path, rel: str) -> Shard:
    """Parse and validate one safetensors file's header as strictly as the safetensors library does.

    The header must be UTF-8 JSON (at most 100,000,000 bytes) holding an object; ``__metadata__`` (optional) maps
    strings to strings; every other key is a tensor whose entry holds ``dtype`` (a safetensors dtype name), ``shape``
    (non-negative integers) and ``data_offsets`` (``[begin, end]``, non-negative integers, ``begin <= end``) whose
    length matches dtype and shape. Sorted by offset, the tensors must cover the data area exactly: no overlap, no
    gap, nothing after the last tensor (the library refuses trailing bytes too). Unknown keys inside an entry are
    ignored, as the library ignores them.

    Example:
        >>> shard = read_header(Path("ckpt/model.safetensors"), "model.safetensors")  # doctest: +SKIP
        >>> [(t.name, t.dtype, t.shape) for t in shard.tensors]  # doctest: +SKIP
        [('lm_head.weight', 'BF16', (32, 64)), ...]

    Raises:
        SourceError: one line naming the file (and the tensor where one is at fault): unreadable file, a Git LFS
            pointer instead of the weights, bad header length, header not UTF-8 JSON or not an object, a malformed
            entry or metadata, unknown dtype, offsets that overlap, leave gaps, disagree with the shape, stop short
            of the end of the file or run past it (a truncated download).
    """
    size, blob = _header_bytes(path)
    return parse_header(blob, size, rel, path=path)


def header_length(prefix: bytes, size: int, where: str) -> int:
    """The header length a safetensors file's first bytes give (``prefix``: at least its first 8 bytes, or the whole
    file when it is shorter), checked against the file's ``size`` in bytes.

    Raises:
        SourceError: (naming ``where``) a Git LFS pointer, a file shorter than 8 bytes, or a length that is 0, over
            100,000,000 or past the end of the file.
    """
    if prefix.startswith(LFS_POINTER):
        raise SourceError("a Git LFS pointer, not the weights", file=where, hint="run git lfs pull")
    if len(prefix) < 8:
        raise SourceError("not a safetensors file (shorter than its 8-byte header length)", file=where)
    n = int.from_bytes(prefix[:8], "little")
    if n <= 0 or n > MAX_HEADER or 8 + n > size:
        raise SourceError(f"not a safetensors file (header length {n}, file size {size})", file=where)
    return n


def parse_header(blob: bytes, size: int, rel: str, *, path: Path, where: str | None = None) -> Shard:
    """Validate a safetensors header given as bytes (``read_header``'s checks, without reading a file): ``blob`` is
    the header JSON (the ``n`` bytes after the 8-byte length), ``size`` the whole file's size in bytes.

    Args:
        rel: the file's path relative to the checkpoint directory (``TensorInfo.file``).
        path: where the file is (or will be) on disk (``Shard.path``).
        where: how error lines name the file (default: ``path``), e.g. ``hf://org/name/model.safetensors``.

    Returns:
        the Shard, each TensorInfo with its absolute byte range in the file (``8 + len(blob)`` + data offsets).

    Raises:
        SourceError: as ``read_header``, naming ``where``.
    """
    where = str(path) if where is None else where
    base = 8 + len(blob)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"not a safetensors file (header is not UTF-8: byte {e.start})", file=where) from None
    header = _header_json(text, where)
    meta = _header_metadata(header.pop("__metadata__", None), where)
    tensors = [_header_entry(name, e, rel, base, where) for name, e in header.items()]
    tensors.sort(key=lambda x: (x.start, x.end))
    pos = base
    for ti in tensors:
        if ti.start != pos:
            raise SourceError("tensor data overlaps or leaves a gap (corrupt header)", file=where,
                              tensor=_shown(ti.name))
        pos = ti.end
    last = _shown(tensors[-1].name) if tensors else None
    if pos > size:
        raise SourceError(f"file is truncated: data ends at byte {pos} but the file has {size} bytes",
                          file=where, tensor=last)
    if pos < size:
        extra = size - pos
        raise SourceError(f"{extra} byte{'s' if extra != 1 else ''} after the end of the last tensor's data (byte "
                          f"{pos}): the header does not cover the file", file=where, tensor=last)
    return Shard(rel, path, size, tensors, meta)


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, header bytes) of a safetensors file; Git LFS pointers named as such."""
    where = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if raw.startswith(LFS_POINTER[:8]):
                raw += f.read(len(LFS_POINTER) - 8)
            n = header_length(raw, size, where)
            f.seek(8)
            blob = f.read(n)
    except OSError as e:
        raise SourceError(f"cannot read: {e.strerror or e}", file=where) from None
    if len(blob) != n:
        raise SourceError(f"short read of the header ({len(blob)} of {n} bytes): file changed or truncated",
                          file=where)
    return size, blob


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _header_json(text: str, where: str) -> dict:
    """The header text as a dict (strict JSON: no NaN/Infinity, no lone surrogates, bounded nesting)."""
    try:
        header = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise SourceError("not a safetensors file (header JSON is nested too deeply)", file=where) from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers too long to convert
        raise SourceError(f"not a safetensors file (header is not JSON: {_brief_error(e)})", file=where) from None
    if not isinstance(header, dict):
        raise SourceError(f"not a safetensors file (header is {_kind(header)}, not a JSON object)", file=where)
    for key in header:
        if not _valid_text(key):
            raise SourceError(f"tensor name {ascii(key)[:80]} is not valid Unicode", file=where)
    return header


def _header_metadata(meta: Any, where: str) -> dict[str, str]:
    """``__metadata__``: absent, null or a str -> str object."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise SourceError(f"__metadata__ must be an object of strings, got {_kind(meta)}", file=where)
    for k, v in meta.items():
        if not isinstance(v, str) or not _valid_text(k) or not _valid_text(v):
            raise SourceError(f"__metadata__[{ascii(k)[:80]}] must be a string, got {_kind(v)}", file=where)
    return meta


def _header_entry(name: str, e: Any, rel: str, base: int, where: str) -> TensorInfo:
    """One tensor entry of a header, checked: dtype, shape, offsets and their agreement."""
    def bad(what: str) -> SourceError:
        return SourceError(f"malformed header entry: {what}", file=where, tensor=_shown(name))

    if not isinstance(e, dict):
        raise bad(f"expected an object with {', '.join(ENTRY_KEYS)}, got {_kind(e)}")
    missing = [k for k in ENTRY_KEYS if k not in e]
    if missing:
        raise bad(f"no {', '.join(missing)}")
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SourceError(f"unknown dtype {_kind(dtype)}", file=where, tensor=_shown(name))
    if not isinstance(shape, list) or not all(_is_u64(x) for x in shape):
        raise bad(f"shape must be a list of non-negative integers, got {_kind(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(x) for x in offsets):
        raise bad(f"data_offsets must be [begin, end] (non-negative integers), got {_kind(offsets)}")
    s, t = offsets
    if s > t:
        raise bad(f"data_offsets {offsets} end before they begin")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits > MAX_USIZE:
        raise bad(f"shape {shape} is too large")
    if bits % 8:
        raise bad(f"{dtype}{shape} does not fill whole bytes ({bits} bits)")
    if t - s != bits // 8:
        raise SourceError(f"byte range {t - s} does not match {dtype}{shape} ({bits // 8} bytes)",
                          file=where, tensor=_shown(name))
    return TensorInfo(name, rel, dtype, tuple(shape), base + s, base + t)


def _is_u64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_USIZE


def _valid_text(s: str) -> bool:
    """A string that UTF-8 can hold (JSON lets ``\\ud800`` through; the safetensors library refuses it)."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _shown(name: str) -> str:
    """A tensor name as an error line shows it: as is when printable, else escaped; long names cut."""
    shown = name if name.isprintable() else ascii(name)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def _kind(v: Any) -> str:
    """A JSON value in a few words for an error line (never a deep or huge repr)."""
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        if len(v) <= 8 and all(isinstance(x, (int, float, str, bool)) or x is None for x in v):
            return _kind_short(json.dumps(v))
        return f"a list of {len(v)}"
    if v is None:
        return "null"
    return _kind_short(json.dumps(v))


def _kind_short(text: str) -> str:
    return text if len(text) <= 60 else text[:60] + "..."


def _brief_error(e: Exception) -> str:
    return _kind_short(str(e).splitlines()[0] if str(e) else type(e).__name__)


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
    inside = _Inside(root, enabled=not allow_outside_links)
    inside.check("config.json", "config.json")
    config = read_config(root)
    weight_map, files = _shard_files(root, remote.files if remote is not None else None)
    what = f"listed in {INDEX_NAME}, but" if weight_map is not None else "weights file"
    if weight_map is not None:
        inside.check(INDEX_NAME, INDEX_NAME)
    for rel in files:
        inside.check(rel, what)
    shards, tensors = _read_shards(root, files, remote.read_header if remote is not None else None)
    if weight_map is not None:
        _check_index(root, weight_map, tensors)
    side, skipped = _side_files(root, set(files), inside)
    decoder = detect(config, tensors)
    return Source(root=root, config=config, shards=shards, tensors=tensors, side_files=side, skipped_files=skipped,
                  decoder=decoder, logical=decoder.logical_tensors(tensors), repo_id=repo_id, revision=revision,
                  commit=commit)


class _Inside:
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


def read_config(root: Path) -> dict:
    """``root/config.json`` as a dict.

    Raises:
        SourceError: missing, not JSON, or not a JSON object.
    """
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise SourceError("no config.json: not a Hugging Face checkpoint directory", file=str(root))
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SourceError(f"not valid JSON: {e}", file=str(cfg_path)) from None
    if not isinstance(config, dict):
        raise SourceError("config.json must hold a JSON object", file=str(cfg_path))
    check_config_types(config, cfg_path)
    return config


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
            raise SourceError(f"{n} must be a JSON object, got {_kind(v)}", file=str(cfg_path))
        if v is not None:
            scopes.append((f"{n}.", v))
    for prefix, scope in scopes:
        mt = scope.get("model_type")
        if mt is not None and not isinstance(mt, str):
            raise SourceError(f"{prefix}model_type must be a string, got {_kind(mt)}", file=str(cfg_path))
        archs = scope.get("architectures")
        if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
            raise SourceError(f"{prefix}architectures must be a list of strings, got {_kind(archs)}",
                              file=str(cfg_path))


def _shard_files(root: Path, remote: list[str] | None = None) -> tuple[dict[str, str] | None, list[str]]:
    """(the index's weight map or None, the shard files in name order). Without an index, ``remote`` (the weight
    files of a streamed source, not on disk yet) stands for what the directory would hold."""
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            raise SourceError("not a valid safetensors index (needs a weight_map)", file=str(index_path)) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SourceError("weight_map must map tensor names to file names", file=str(index_path))
        files = sorted(set(weight_map.values()))
        for rel in files:  # lexically: Hub cache snapshots are symlinks into the blob store, which is fine
            norm = os.path.normpath(rel)
            if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
                raise SourceError(f"weight_map names a file outside the checkpoint directory: {rel!r}",
                                  file=str(index_path))
        return weight_map, files
    if remote is not None and len(remote) == 1:
        return None, list(remote)
    if (root / SINGLE_NAME).is_file():
        return None, [SINGLE_NAME]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    if len(found) == 1:
        return None, found
    if found:
        raise SourceError(f"{len(found)} safetensors files but no {INDEX_NAME}: cannot tell which are the "
                          "model's weights", file=str(root))
    others = sorted(p.name for p in root.iterdir() if WEIGHT_FILE.search(p.name))
    extra = f" (found {', '.join(others[:3])}: convert them to safetensors first)" if others else ""
    raise SourceError(f"no safetensors weights{extra}", file=str(root))


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
        if not p.is_file():
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


def _check_index(root: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    for name, rel in weight_map.items():
        got = tensors.get(name)
        if got is None:
            raise SourceError(f"listed in {INDEX_NAME} but not in the file", file=str(root / rel), tensor=name)
        if got.file != rel:
            raise SourceError(f"{INDEX_NAME} says {rel} but the tensor is in {got.file}", file=str(root / rel),
                              tensor=name)
    extra = sorted(set(tensors) - set(weight_map))
    if extra:
        raise SourceError(f"tensor not listed in {INDEX_NAME}", file=str(root / tensors[extra[0]].file),
                          tensor=extra[0])


def _side_files(root: Path, weight_files: set[str], inside: _Inside | None = None) -> tuple[list[str], list[str]]:
    """(files to copy, weight files in other formats that are not copied), relative paths, sorted. Each file to copy
    must stay inside the checkpoint directory (``inside``); a link to a missing file is refused."""
    side, skipped = [], []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        if p.is_dir() or rel in weight_files or rel in (INDEX_NAME, "config.json"):
            continue
        if WEIGHT_FILE.search(rel):
            skipped.append(rel)
            continue
        if inside is not None:
            inside.check(rel, "side file")
        if not p.exists():
            raise SourceError(f"side file is a symbolic link to a missing file ({os.readlink(p)})", file=str(p))
        side.append(rel)
    return side, skipped


def resolve_source(src: str | Path, *, revision: str | None = None, token: str | bool | None = None) -> Source:
    """Open ``src``: an existing local directory, else a Hub repo id fetched with ``huggingface_hub``.

    A Hub repo is fetched by ``hubsource.fetch``: the user's cache and token, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``
    are honoured, and only the files a conversion needs are downloaded (the shards its index names, the index, and
    the root-level side files: no ``onnx/``, ``metal/``, ``original/``, no unindexed or other-format weights).

    Raises:
        SourceError: the directory is not a checkpoint. UsageError: ``src`` is neither a directory nor a repo id.
        HubNotFoundError (exit 3), HubAccessError (4), HubAuthError (5), HubOfflineError (6), IncompleteCacheError
            (7): see ``hubsource.fetch``; all are ``SourceError`` subclasses.
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
    from .hubsource import fetch

    local, commit = fetch(s, revision=revision, token=token)
    return open_source(local, repo_id=s, revision=revision or "main", commit=commit)


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


def read_tensor(src_root: Path, info: TensorInfo, pinned: bool = False) -> torch.Tensor:
    """Read one tensor from its file: one ``readinto`` of its whole byte span (nothing else of the shard is loaded).

    Args:
        pinned: read into page-locked host memory (for asynchronous copies to a GPU).

    Returns:
        a CPU tensor of ``info.shape`` in the matching torch dtype.

    Raises:
        SourceError: the dtype has no torch equivalent here, or the read came back short.
    """
    dt = TORCH_DTYPES.get(info.dtype)
    if dt is None:
        raise SourceError(f"dtype {info.dtype} cannot be read as a torch tensor", file=str(src_root / info.file), tensor=info.name)
    buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=pinned)
    view, got = memoryview(buf.numpy()), 0
    with open(src_root / info.file, "rb", buffering=0) as f:
        if f.seek(info.start) == info.start:
            while got < info.nbytes and (n := f.readinto(view[got:])):  # one syscall reads at most ~2 GiB
                got += n
    if got != info.nbytes:
        raise SourceError(f"short read ({got} of {info.nbytes} bytes): file changed or truncated",
                          file=str(src_root / info.file), tensor=info.name)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dt)
    return buf.view(dt).view(info.shape)


def map_tensor(src_root: Path, info: TensorInfo) -> torch.Tensor:
    """One tensor of a file as a view of the file's pages (``mmap``, private: nothing is copied, and writing to
    the view would never reach the file). For a pass that only reads the values once (the scale pass of
    ``pipeline``): no read buffer, no copy out of the page cache.

    Returns:
        a CPU tensor of ``info.shape`` in the matching torch dtype; the mapping lives as long as the tensor.

    Raises:
        SourceError: the dtype has no torch equivalent here, or the file is shorter than the header says.
    """
    import mmap

    dt = TORCH_DTYPES.get(info.dtype)
    path = src_root / info.file
    if dt is None:
        raise SourceError(f"dtype {info.dtype} cannot be read as a torch tensor", file=str(path), tensor=info.name)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dt)
    start = info.start - info.start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size < info.start + info.nbytes:
            raise SourceError("file is shorter than its header says: changed or truncated", file=str(path),
                              tensor=info.name)
        m = mmap.mmap(f.fileno(), info.start + info.nbytes - start, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    if hasattr(m, "madvise"):
        m.madvise(mmap.MADV_SEQUENTIAL)
    return torch.frombuffer(m, dtype=torch.uint8, offset=info.start - start, count=info.nbytes).view(dt).view(
        info.shape)


def copy_bytes(src_root: Path, info: TensorInfo, dst_fd: int, dst_offset: int, chunk: int = 64 << 20) -> None:
    """Copy a tensor's raw bytes into an open output file at ``dst_offset`` (byte-identical, bounded memory): in the
    kernel with ``copy_file_range`` where the OS allows it, else by ``pread``/``pwrite`` in 64 MiB chunks.

    Raises:
        SourceError: the source came back short.
    """
    with open(src_root / info.file, "rb", buffering=0) as f:
        fd = f.fileno()
        pos, left = info.start, info.nbytes
        if hasattr(os, "copy_file_range"):
            try:
                while left:
                    n = os.copy_file_range(fd, dst_fd, min(left, 1 << 30), pos, dst_offset + (pos - info.start))
                    if n == 0:
                        raise SourceError("short read: file changed or truncated", file=str(src_root / info.file), tensor=info.name)
                    pos += n
                    left -= n
                return
            except OSError:  # another filesystem, or not supported: fall back to plain reads and writes
                pass
        while left:
            data = os.pread(fd, min(chunk, left), pos)
            if not data:
                raise SourceError("short read: file changed or truncated", file=str(src_root / info.file), tensor=info.name)
            os.pwrite(dst_fd, data, dst_offset + (pos - info.start))
            pos += len(data)
            left -= len(data)

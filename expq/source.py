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
from typing import Any

import torch

from .errors import SourceError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024

# Bits per element of every safetensors dtype.
DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64, "U32": 32,
    "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
    "C64": 64,
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
        root: the local directory (a Hub snapshot for a repo id).
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


def read_header(path: Path, rel: str) -> Shard:
    """Parse and validate one safetensors file's header.

    Raises:
        SourceError: unreadable file, bad header, unknown dtype, offsets that overlap, leave gaps, disagree with the
            shape, or run past the end of the file (a truncated download).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SourceError("not a safetensors file (shorter than its 8-byte header length)", file=str(path))
            n = int.from_bytes(raw, "little")
            if n <= 0 or n > MAX_HEADER or 8 + n > size:
                raise SourceError(f"not a safetensors file (header length {n}, file size {size})", file=str(path))
            header = json.loads(f.read(n))
    except OSError as e:
        raise SourceError(f"cannot read: {e.strerror or e}", file=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SourceError("not a safetensors file (header is not JSON)", file=str(path)) from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = []
    for name, e in header.items():
        try:
            dtype, shape, (s, t) = e["dtype"], tuple(int(x) for x in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SourceError("malformed header entry", file=str(path), tensor=name) from None
        if dtype not in DTYPE_BITS:
            raise SourceError(f"unknown dtype {dtype}", file=str(path), tensor=name)
        expect = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
        if t - s != expect:
            raise SourceError(f"byte range {t - s} does not match {dtype}{list(shape)} ({expect} bytes)",
                              file=str(path), tensor=name)
        tensors.append(TensorInfo(name, rel, dtype, shape, base + s, base + t))
    tensors.sort(key=lambda x: x.start)
    pos = base
    for ti in tensors:
        if ti.start != pos:
            raise SourceError("tensor data overlaps or leaves a gap (corrupt header)", file=str(path),
                              tensor=ti.name)
        pos = ti.end
    if pos > size:
        last = tensors[-1].name if tensors else None
        raise SourceError(f"file is truncated: data ends at byte {pos} but the file has {size} bytes",
                          file=str(path), tensor=last)
    return Shard(rel, path, size, tensors, meta)


def open_source(root: str | Path, *, repo_id: str | None = None, revision: str | None = None,
                commit: str | None = None) -> Source:
    """Read and validate a local checkpoint directory.

    Steps: read config.json; find the shard files (index, or the single file); read and check every shard header;
    check the index against the headers; list the side files; detect the source format (``decoders``).

    Raises:
        SourceError: missing config.json or weights, an index that names missing files or tensors, a tensor stored
            twice, any shard error from ``read_header``, or a quantized format no decoder handles.
    """
    from .decoders import detect

    root = Path(root)
    if not root.is_dir():
        raise SourceError("not a directory", file=str(root))
    config = read_config(root)
    weight_map, files = _shard_files(root)
    shards, tensors = _read_shards(root, files)
    if weight_map is not None:
        _check_index(root, weight_map, tensors)
    side, skipped = _side_files(root, set(files))
    decoder = detect(config, tensors)
    return Source(root=root, config=config, shards=shards, tensors=tensors, side_files=side, skipped_files=skipped,
                  decoder=decoder, logical=decoder.logical_tensors(tensors), repo_id=repo_id, revision=revision,
                  commit=commit)


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
    return config


def _shard_files(root: Path) -> tuple[dict[str, str] | None, list[str]]:
    """(the index's weight map or None, the shard files in name order)."""
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


def _read_shards(root: Path, files: list[str]) -> tuple[list[Shard], dict[str, TensorInfo]]:
    shards, tensors = [], {}
    for rel in files:
        p = root / rel
        if not p.is_file():
            raise SourceError(f"listed in {INDEX_NAME} but missing", file=str(p))
        sh = read_header(p, rel)
        shards.append(sh)
        for ti in sh.tensors:
            if ti.name in tensors:
                raise SourceError(f"tensor stored twice (also in {tensors[ti.name].file})", file=str(p),
                                  tensor=ti.name)
            tensors[ti.name] = ti
    return shards, tensors


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


def _side_files(root: Path, weight_files: set[str]) -> tuple[list[str], list[str]]:
    """(files to copy, weight files in other formats that are not copied), relative paths, sorted."""
    side, skipped = [], []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir() or rel.startswith(".") or "/." in rel:
            continue
        if rel in weight_files or rel in (INDEX_NAME, "config.json"):
            continue
        (skipped if WEIGHT_FILE.search(rel) else side).append(rel)
    return side, skipped


def resolve_source(src: str | Path, *, revision: str | None = None, token: str | bool | None = None) -> Source:
    """Open ``src``: an existing local directory, else a Hub repo id fetched with ``huggingface_hub``.

    A Hub repo is fetched by ``hubsource.fetch``: the user's cache and token, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``
    are honoured, and only the files a conversion needs are downloaded (the shards its index names, the index, and
    the root-level side files: no ``onnx/``, ``metal/``, ``original/``, no unindexed or other-format weights).

    Raises:
        SourceError: the directory is not a checkpoint, or ``src`` is neither a directory nor a repo id.
        HubNotFoundError (exit 3), HubAccessError (4), HubAuthError (5), HubOfflineError (6), IncompleteCacheError
            (7): see ``hubsource.fetch``; all are ``SourceError`` subclasses.
    """
    p = Path(src).expanduser()
    if p.exists():
        if revision is not None:
            raise SourceError("--revision applies to Hub repo ids, not to a local directory", file=str(p))
        return open_source(p)
    s = str(src)
    if not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", s) or s.startswith((".", "/")):
        raise SourceError("no such directory, and not a Hub repo id", file=s)
    from .hubsource import fetch

    local, commit = fetch(s, revision=revision, token=token)
    return open_source(local, repo_id=s, revision=revision or "main", commit=commit)


def read_tensor(src_root: Path, info: TensorInfo) -> torch.Tensor:
    """Read one tensor from its file (one ``pread``; nothing else of the shard is loaded).

    Returns:
        a CPU tensor of ``info.shape`` in the matching torch dtype.

    Raises:
        SourceError: the dtype has no torch equivalent here, or the read came back short.
    """
    dt = TORCH_DTYPES.get(info.dtype)
    if dt is None:
        raise SourceError(f"dtype {info.dtype} cannot be read as a torch tensor", file=str(src_root / info.file), tensor=info.name)
    buf = bytearray(info.nbytes)
    with open(src_root / info.file, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf)) if f.seek(info.start) == info.start else 0
    if got != info.nbytes:
        raise SourceError(f"short read ({got} of {info.nbytes} bytes): file changed or truncated",
                          file=str(src_root / info.file), tensor=info.name)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dt)
    return torch.frombuffer(buf, dtype=dt).view(info.shape)


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

"""Safetensors files: the dtype table, a file's tensors, its header parsed and validated as strictly as the
safetensors library does or encoded for writing, and bounded reads and copies of one tensor's bytes.

A safetensors file is ``u64 little-endian header length | JSON header | data``; each header entry gives ``dtype``,
``shape`` and ``data_offsets`` relative to the data start (https://github.com/huggingface/safetensors). expq reads
the header itself because passthrough tensors are copied as raw bytes (byte-identical by construction, any dtype).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

import torch

from ..errors import SourceError
from . import buffers
from .regular import open_regular

MAX_HEADER = 100_000_000  # the safetensors library's limit (bytes of JSON header)
MAX_USIZE = 2**64 - 1  # shapes and offsets are u64 in the library
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype: its name in headers, bits per element, and the torch dtype its bytes read as (None:
    torch has none, or expq does not read it as a tensor)."""

    name: str
    bits: int
    torch_dtype: torch.dtype | None = None


DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("F64", 64, torch.float64), Dtype("F32", 32, torch.float32), Dtype("F16", 16, torch.float16),
    Dtype("BF16", 16, torch.bfloat16), Dtype("I64", 64, torch.int64), Dtype("I32", 32, torch.int32),
    Dtype("I16", 16, torch.int16), Dtype("I8", 8, torch.int8), Dtype("U64", 64), Dtype("U32", 32), Dtype("U16", 16),
    Dtype("U8", 8, torch.uint8), Dtype("BOOL", 8, torch.bool), Dtype("F8_E4M3", 8, torch.float8_e4m3fn),
    Dtype("F8_E5M2", 8, torch.float8_e5m2), Dtype("F8_E8M0", 8, torch.float8_e8m0fnu), Dtype("F6_E2M3", 6),
    Dtype("F6_E3M2", 6), Dtype("F4", 4), Dtype("C64", 64), Dtype("F8_E4M3FNUZ", 8), Dtype("F8_E5M2FNUZ", 8),
)}
"""Every safetensors dtype by its header name (the one table; the two below are views of it)."""

DTYPE_BITS = {n: d.bits for n, d in DTYPES.items()}
"""Bits per element of every safetensors dtype."""

TORCH_DTYPES = {n: d.torch_dtype for n, d in DTYPES.items() if d.torch_dtype is not None}
"""Header name -> torch dtype, for the dtypes read as tensors."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors header name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``).

    Raises:
        KeyError: a torch dtype with no safetensors name in ``DTYPES``.
    """
    for n, d in DTYPES.items():
        if d.torch_dtype == dtype:
            return n
    raise KeyError(dtype)


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

    def narrow(self, start: int, stop: int) -> "TensorInfo":
        """The tensor's ``[start:stop]`` along its leading dimension: the same file, name and dtype, the byte range
        that holds those rows (a leading-dimension range of a row-major tensor is one contiguous span).

        Example:
            >>> TensorInfo("w", "f", "BF16", (4, 3), 100, 124).narrow(1, 3)
            TensorInfo(name='w', file='f', dtype='BF16', shape=(2, 3), start=106, end=118)

        Raises:
            ValueError: not ``0 <= start <= stop <= shape[0]``, a 0-D tensor, or rows that are not whole bytes.
        """
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"cannot narrow {list(self.shape)} to [{start}:{stop}] along its leading dimension")
        row_bits = math.prod(self.shape[1:]) * DTYPE_BITS[self.dtype]
        if row_bits % 8:
            raise ValueError(f"rows of {self.dtype} {list(self.shape)} are not whole bytes")
        row = row_bits // 8
        return TensorInfo(self.name, self.file, self.dtype, (stop - start, *self.shape[1:]),
                          self.start + start * row, self.start + stop * row)


@dataclass
class Shard:
    """One safetensors file: its tensors in file order and its ``__metadata__``; ``data_start``: the byte where its
    data area begins (8 + the header's length); ``header_sha256``: the sha256 (hex) of its header JSON, as read."""

    file: str
    path: Path
    size: int
    tensors: list[TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0
    header_sha256: str = ""


class PlacedTensor(Protocol):
    """A tensor planned into a file: name, safetensors dtype, shape, ``offset`` in the data area, size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def encode_header(tensors: Iterable[PlacedTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The header of a safetensors file holding ``tensors`` at their planned offsets: 8-byte little-endian length,
    then JSON padded with spaces to a multiple of 8 bytes (so the data area starts aligned). ``metadata``: the
    ``__metadata__`` object (default ``{"format": "pt"}``)."""
    entries: dict = {"__metadata__": metadata or {"format": "pt"}}
    for o in sorted(tensors, key=lambda o: o.offset):
        entries[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [o.offset, o.offset + o.nbytes]}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


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
            beyond = next((t for t in tensors if t.end > size), None)  # the entry that lies, where one points out
            if beyond is not None:
                raise SourceError(f"tensor data at bytes {beyond.start}-{beyond.end} lies past the end of the file "
                                  f"({size} bytes; corrupt header)", file=where, tensor=printable_name(beyond.name))
            raise SourceError("tensor data overlaps or leaves a gap (corrupt header)", file=where,
                              tensor=printable_name(ti.name))
        pos = ti.end
    last = printable_name(tensors[-1].name) if tensors else None
    if pos > size:
        raise SourceError(f"file is truncated: data ends at byte {pos} but the file has {size} bytes",
                          file=where, tensor=last)
    if pos < size:
        extra = size - pos
        raise SourceError(f"{extra} byte{'s' if extra != 1 else ''} after the end of the last tensor's data (byte "
                          f"{pos}): the header does not cover the file", file=where, tensor=last)
    return Shard(rel, path, size, tensors, meta, data_start=base,
                 header_sha256=hashlib.sha256(blob).hexdigest())


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, header bytes) of a safetensors file; Git LFS pointers named as such."""
    where = str(path)
    fd = open_regular(path, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        with open(fd, "rb") as f:
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
        raise SourceError(f"not a safetensors file (header is {json_kind(header)}, not a JSON object)", file=where)
    for key in header:
        if not _valid_text(key):
            raise SourceError(f"tensor name {ascii(key)[:80]} is not valid Unicode", file=where)
    return header


def _header_metadata(meta: Any, where: str) -> dict[str, str]:
    """``__metadata__``: absent, null or a str -> str object."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise SourceError(f"__metadata__ must be an object of strings, got {json_kind(meta)}", file=where)
    for k, v in meta.items():
        if not isinstance(v, str) or not _valid_text(k) or not _valid_text(v):
            raise SourceError(f"__metadata__[{ascii(k)[:80]}] must be a string, got {json_kind(v)}", file=where)
    return meta


def _header_entry(name: str, e: Any, rel: str, base: int, where: str) -> TensorInfo:
    """One tensor entry of a header, checked: dtype, shape, offsets and their agreement."""
    def bad(what: str) -> SourceError:
        return SourceError(f"malformed header entry: {what}", file=where, tensor=printable_name(name))

    if not isinstance(e, dict):
        raise bad(f"expected an object with {', '.join(ENTRY_KEYS)}, got {json_kind(e)}")
    missing = [k for k in ENTRY_KEYS if k not in e]
    if missing:
        raise bad(f"no {', '.join(missing)}")
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SourceError(f"unknown dtype {json_kind(dtype)}", file=where, tensor=printable_name(name))
    if not isinstance(shape, list) or not all(_is_u64(x) for x in shape):
        raise bad(f"shape must be a list of non-negative integers, got {json_kind(shape)}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(x) for x in offsets):
        raise bad(f"data_offsets must be [begin, end] (non-negative integers), got {json_kind(offsets)}")
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
                          file=where, tensor=printable_name(name))
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


def printable_name(name: str) -> str:
    """A tensor name as an error line shows it: as is when printable, else escaped; long names cut."""
    shown = name if name.isprintable() else ascii(name)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def json_kind(v: Any) -> str:
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



def read_tensor(src_root: Path, info: TensorInfo, pinned: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor from its file: one ``readinto`` of its whole byte span (nothing else of the shard is loaded).

    Args:
        pinned: read into page-locked host memory (for asynchronous copies to a GPU); else into a buffer of the
            pool in use (``buffers.empty``: reused during a CPU conversion).
        into: read into the front of this contiguous CPU uint8 tensor instead (at least ``info.nbytes`` long; the
            result is a view of it, valid until the caller reuses it).

    Returns:
        a CPU tensor of ``info.shape`` in the matching torch dtype.

    Raises:
        SourceError: the dtype has no torch equivalent here, or the read came back short.
    """
    dt = TORCH_DTYPES.get(info.dtype)
    if dt is None:
        raise SourceError(f"dtype {info.dtype} cannot be read as a torch tensor", file=str(src_root / info.file), tensor=info.name)
    if into is not None:
        buf = into[:info.nbytes]
    else:
        buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=True) if pinned else \
            buffers.empty((info.nbytes,), torch.uint8)
    view, got = memoryview(buf.numpy()), 0
    try:
        with open(src_root / info.file, "rb", buffering=0) as f:
            if f.seek(info.start) == info.start:
                while got < info.nbytes and (n := f.readinto(view[got:])):  # one syscall reads at most ~2 GiB
                    got += n
    except OSError as e:
        raise SourceError(f"cannot read: {e.strerror or e}", file=str(src_root / info.file), tensor=info.name) from None
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
    kernel with ``copy_file_range`` where the OS allows it, else by ``pread``/``pwrite`` in 64 MiB chunks (also
    after ``copy_file_range`` failed, so that a failure is told apart: reading the source, or writing the output).

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
            try:
                data = os.pread(fd, min(chunk, left), pos)
            except OSError as e:  # EIO...: the source's fault, not the output's
                raise SourceError(f"cannot read: {e.strerror or e}", file=str(src_root / info.file),
                                  tensor=info.name) from None
            if not data:
                raise SourceError("short read: file changed or truncated", file=str(src_root / info.file), tensor=info.name)
            os.pwrite(dst_fd, data, dst_offset + (pos - info.start))
            pos += len(data)
            left -= len(data)


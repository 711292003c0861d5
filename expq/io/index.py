"""Which files of a checkpoint hold its weights, and its safetensors index (``model.safetensors.index.json``): read
and validated, checked against the shard headers, and written.

The index is ``{"metadata": {"total_size": N}, "weight_map": {tensor name: shard file}}``; a checkpoint without
one holds a single ``model.safetensors`` (or a single ``*.safetensors`` file at its root).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from ..errors import SourceError
from .regular import read_regular

if TYPE_CHECKING:  # imported by the command line before torch (``io.early_hash``)
    from .safetensors import TensorInfo

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 256 << 20  # bytes of an index file (tens of MB for the largest models)
SINGLE_NAME = "model.safetensors"

# Files that hold weights in other formats (or weights the index does not reference): never copied to OUT.
WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx|tflite|ot|npz)$|(^|/)original/")


def is_weight_file(rel: str) -> bool:
    """Whether a file (path relative to the checkpoint, ``/``-separated) holds weights, in any format, or lies
    under ``original/`` (a release's other-format weights): such a file is copied only when it is a shard."""
    return WEIGHT_FILE.search(rel) is not None


@dataclass(frozen=True)
class Index:
    """A checkpoint's safetensors index, validated.

    Attributes:
        weight_map: tensor name -> shard file (relative path; none resolves outside the checkpoint lexically).
        total_size: ``metadata.total_size`` as the file gives it (any JSON value; None when absent).
    """

    weight_map: dict[str, str]
    total_size: object = None

    @property
    def files(self) -> list[str]:
        """The shard files it names, sorted."""
        return sorted(set(self.weight_map.values()))


def read_index(path: Path) -> Index:
    """Read and validate an index file: JSON holding a ``weight_map`` object of strings, none naming a file outside
    the checkpoint directory (checked lexically: a Hub cache snapshot's files are links into its blob store).

    Raises:
        SourceError: naming ``path``: unreadable, not JSON, no ``weight_map``, a value that is not a string, or a
            file outside the checkpoint directory.
    """
    raw = read_regular(path, "index", MAX_INDEX_BYTES)
    try:
        index = json.loads(raw.decode("utf-8"))
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise SourceError("not a valid safetensors index (needs a weight_map)", file=str(path)) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError("weight_map must map tensor names to file names", file=str(path))
    for rel in sorted(set(weight_map.values())):
        norm = os.path.normpath(rel)
        if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
            raise SourceError(f"weight_map names a file outside the checkpoint directory: {rel!r}", file=str(path))
    meta = index.get("metadata")
    return Index(weight_map, meta.get("total_size") if isinstance(meta, dict) else None)


def shard_files(root: Path, remote: list[str] | None = None) -> tuple[Index | None, list[str]]:
    """(the index or None, the shard files in name order): ``weight_files``'s rule over the directory ``root``.
    Without an index, ``remote`` (the weight files of a streamed source, not on disk yet) stands for what the
    directory would hold.

    Raises:
        SourceError: as ``read_index`` (naming the index) and ``weight_files`` (naming ``root``); OSError: ``root``
            cannot be listed.
    """
    names = sorted(p.name for p in root.iterdir())
    index = read_index(root / INDEX_NAME) if INDEX_NAME in names else None
    if index is None and remote is not None and len(remote) == 1:
        return None, list(remote)
    try:
        return index, weight_files(names, index)
    except SourceError as e:
        raise SourceError(e.message, file=str(root)) from None


def weight_files(paths: Iterable[str], index: Index | None) -> list[str]:
    """The files that hold a checkpoint's weights, sorted: the shards its index names (when ``paths`` holds the
    index; none when the index could not be read), else ``model.safetensors``, else the one ``*.safetensors`` file
    at the root.

    Args:
        paths: the checkpoint's files (relative, ``/``-separated): all of them, or at least those at its root.
        index: the index read from it (``read_index``), or None.

    Raises:
        SourceError (no location: the caller names the checkpoint): several ``*.safetensors`` files at the root
            and no index, or no safetensors weights (naming up to three weight files of other formats found).
    """
    paths = list(paths)
    if INDEX_NAME in paths:
        return index.files if index is not None else []
    if SINGLE_NAME in paths:
        return [SINGLE_NAME]
    found = sorted(p for p in paths if "/" not in p and not p.startswith(".") and p.endswith(".safetensors"))
    if len(found) == 1:
        return found
    if found:
        raise SourceError(f"{len(found)} safetensors files but no {INDEX_NAME}: cannot tell which are the model's "
                          "weights")
    others = sorted(p for p in paths if is_weight_file(p))
    extra = f" (found {', '.join(others[:3])}: convert them to safetensors first)" if others else ""
    raise SourceError(f"no safetensors weights{extra}")


def check_index(root: Path, index: Index, tensors: Mapping[str, TensorInfo]) -> None:
    """The index and the shard headers agree: every tensor it lists is in the file it names, and it lists every
    tensor the shards hold.

    Args:
        root: the checkpoint directory (error lines name ``root / file``).
        tensors: name -> TensorInfo over every shard.

    Raises:
        SourceError: naming the file and the tensor.
    """
    for name, rel in index.weight_map.items():
        got = tensors.get(name)
        if got is None:
            raise SourceError(f"listed in {INDEX_NAME} but not in the file", file=str(root / rel), tensor=name)
        if got.file != rel:
            raise SourceError(f"{INDEX_NAME} says {rel} but the tensor is in {got.file}", file=str(root / rel),
                              tensor=name)
    extra = sorted(set(tensors) - set(index.weight_map))
    if extra:
        raise SourceError(f"tensor not listed in {INDEX_NAME}", file=str(root / tensors[extra[0]].file),
                          tensor=extra[0])


def index_json(weight_map: Mapping[str, str], total_size: int) -> str:
    """The text of an index file: ``total_size`` (bytes of tensor data in all shards) and the weight map sorted by
    tensor name, indented by 2, ending in a newline."""
    ordered = {name: weight_map[name] for name in sorted(weight_map)}
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": ordered}, indent=2) + "\n"

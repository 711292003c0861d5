"""Output formats (one file each; see ``formats/base.py`` for the protocol)."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..experts import ExpertMap
from .base import Format, TensorSpec
from .compressed_tensors import CompressedTensorsFormat

FORMATS: dict[str, type] = {CompressedTensorsFormat.name: CompressedTensorsFormat}

__all__ = ["Format", "TensorSpec", "FORMATS", "get_format"]


def get_format(name: str, experts: ExpertMap, compute_dtype: torch.dtype) -> Format:
    """The format called ``name`` for one model and compute dtype.

    Raises:
        UsageError: an unknown format name (the message lists the known ones).
    """
    cls = FORMATS.get(name)
    if cls is None:
        raise UsageError(f"unknown --format {name!r}; supported: {', '.join(FORMATS)}")
    return cls(experts, compute_dtype)

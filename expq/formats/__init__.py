"""Output formats (one file each; see ``formats/base.py`` for the protocol)."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..experts import ExpertMap
from .base import Format, TensorSpec
from .compressed_tensors import CompressedTensorsFormat
from .experts_int8 import ExpertsInt8Format

FORMATS: dict[str, type] = {f.name: f for f in (CompressedTensorsFormat, ExpertsInt8Format)}
AUTO = "auto"  # the family's default (its layout's ``[clients] format``)

__all__ = ["Format", "TensorSpec", "FORMATS", "AUTO", "get_format", "format_for_quant_method"]


def format_for_quant_method(method: object) -> str | None:
    """The format whose ``quantization_config`` names ``quant_method`` ``method``, else None."""
    return next((name for name, cls in FORMATS.items() if cls.quant_method == method), None)


def get_format(name: str, experts: ExpertMap, compute_dtype: torch.dtype) -> Format:
    """The format called ``name`` for one model and compute dtype.

    Raises:
        UsageError: an unknown format name (the message lists the known ones).
    """
    cls = FORMATS.get(name)
    if cls is None:
        raise UsageError(f"unknown --format {name!r}; supported: {AUTO}, {', '.join(FORMATS)}")
    return cls(experts, compute_dtype)

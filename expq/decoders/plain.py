"""An unquantized source (bf16 / fp16 / fp32 weights): every stored tensor is its own logical tensor.

The file to copy when adding a source format (see ``decoders/base.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import SourceError
from ..io.safetensors import TensorInfo
from .base import LogicalTensor, ReadFn, narrow_stored

if TYPE_CHECKING:
    from ..experts import ExpertMap


class PlainDecoder:
    """No decoding: the source holds its weights unquantized."""

    name: ClassVar[str] = "none"

    @classmethod
    def detect(cls, config: dict, tensors: dict[str, TensorInfo]) -> "PlainDecoder | None":
        """Always applies when no quantized format claimed the source (``decoders.detect`` tries it last)."""
        return cls()

    def check_experts(self, experts: ExpertMap) -> None:
        """Nothing to refuse: any routed expert stored in this format is decoded."""

    def logical_tensors(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Each stored tensor as it is."""
        return {name: LogicalTensor(name, ti.dtype, ti.shape, (ti,)) for name, ti in tensors.items()}

    def row_absmax(self, tensor: LogicalTensor, read: ReadFn, dim: int = -1) -> torch.Tensor | None:
        """Not offered (None): the caller decodes. See ``Decoder.row_absmax``."""
        return None

    def narrow(self, tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor | None:
        """Its stored bytes of those rows (``narrow_stored``). See ``Decoder.narrow``."""
        return narrow_stored(tensor, start, stop)

    def decode(self, tensor: LogicalTensor, read: ReadFn, device: torch.device | None = None) -> torch.Tensor:
        """Never called: nothing is stored quantized. Raises SourceError if it is."""
        raise SourceError("internal: the plain decoder has nothing to decode", file=tensor.file, tensor=tensor.name)

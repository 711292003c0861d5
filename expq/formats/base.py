"""The output-format protocol: what one quantized routed-expert matrix becomes in the checkpoint, and back.

A format is built for one model (``ExpertMap``) and compute dtype. The plan asks it for each matrix's output tensor
specs (names, dtypes, shapes) before anything is written; the pipeline hands it the experts_int8 codes and scales
and writes exactly the tensors ``encode`` returns, at the planned places; ``checkpoint`` asks ``decode`` for codes
and scales back. The format also owns its ``quantization_config`` and the check of it that ``verify`` runs.

To add a format: copy ``formats/experts_int8.py``, implement the protocol, and add it to ``formats.FORMATS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Protocol, Sequence

import torch

from ..experts import ExpertMap, Matrix, TensorLike


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: its name, safetensors dtype string and shape; ``value``: its bytes, when the format knows
    them before any weight is read (e.g. a stored shape). Such a tensor is written when its shard is opened and is
    not among what ``encode`` returns."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    value: bytes | None = None


ReadByName = Callable[[str], torch.Tensor]
"""Reads one tensor of a converted checkpoint by name (raises ``SourceError`` if it is absent)."""


class Format(Protocol):
    """An output format for experts_int8 codes and scales."""

    name: ClassVar[str]
    quant_method: ClassVar[str]  # what its quantization_config calls it
    # Whether stock transformers (no expq) loads checkpoints in this format instead of refusing them; whether the
    # experts it loads are right then depends on the family (its layout's ``[clients] transformers``).
    stock_transformers_loads: ClassVar[bool]
    experts: ExpertMap
    compute_dtype: torch.dtype

    def tensor_specs(self, matrix: Matrix) -> list[TensorSpec]:
        """The tensors one matrix becomes, in write order (kept together in one shard)."""
        ...

    def encode(self, codes: torch.Tensor, scales: torch.Tensor,
               matrices: Sequence[Matrix]) -> list[list[tuple[TensorSpec, torch.Tensor]]]:
        """The complete output tensors of a batch of matrices.

        Args:
            codes: int8 [sum of rows, cols], the matrices stacked by rows in ``matrices`` order (any device).
            scales: [sum of rows] in the compute dtype (the experts_int8 scales).
            matrices: the matrices, in row order.

        Returns:
            per matrix, ``[(spec, tensor), ...]`` in ``tensor_specs`` order, the specs with a ``value`` left out:
            tensors of exactly the spec's dtype and shape, on the device of ``codes`` (the pipeline copies them
            back to the host).
        """
        ...

    def describe(self) -> str:
        """One sentence for the model card: how the codes and scales are stored."""
        ...

    def decode(self, module: str, read: ReadByName) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [out, in], scales [out] in their stored dtype) of one quantized module.

        Raises:
            ValueError: the module's tensors do not fit together (shapes, dtypes).
            SourceError: one is missing.
        """
        ...

    def owns(self, name: str) -> bool:
        """Whether an output tensor belongs to a quantized routed-expert module of this format."""
        ...

    def quantized_modules(self, names: Sequence[str]) -> dict[tuple[int, int, str], str]:
        """(layer, expert, proj) -> module name for every quantized module present among tensor ``names``."""
        ...

    def targets(self) -> list[str]:
        """The module patterns the ``quantization_config`` quantizes (what ``inspect`` shows)."""
        ...

    def quantization_config(self, tensors: Mapping[str, TensorLike]) -> dict:
        """The ``quantization_config`` of config.json for a model whose logical tensors are ``tensors``."""
        ...

    def check_model(self, config: dict) -> list[str]:
        """Problems with this format's tensors for the transformers model class of ``config`` (config.json as a
        dict); empty when there are none (or nothing to check)."""
        ...

    def check_config(self, config: dict, tensors: Mapping[str, TensorLike]) -> list[str]:
        """Problems with a converted checkpoint's ``quantization_config`` (empty list: it is right), given the
        checkpoint's tensors."""
        ...

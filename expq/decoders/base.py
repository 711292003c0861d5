"""The source-decoder slot: how a tensor stored quantized in the source (FP8 blocks, MXFP4, compressed-tensors) is
turned back into the compute dtype before anything else sees it.

Everything downstream of ``source`` (the expert map, the plan, the pipeline, verify) works on *logical tensors*: the
tensors an unquantized checkpoint of the same model would hold, under the names and in the orientation the layout
files describe. A ``Decoder`` maps the stored tensors of a checkpoint onto logical tensors (a weight and the tensors
it depends on, such as its ``weight_scale_inv``, possibly in another shard) and decodes one logical tensor at a time.
A plain (unquantized) checkpoint maps every stored tensor to itself (``decoders/plain.py``).

To add a source format: copy ``decoders/plain.py``, implement its methods (``narrow``: how to cut a tensor by
experts), and add the class to ``decoders/__init__.py``'s ``DECODERS`` (tried in order by ``detect``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol

import torch

from ..io.safetensors import TensorInfo

if TYPE_CHECKING:
    from ..experts import ExpertMap

ReadFn = Callable[[TensorInfo], torch.Tensor]
"""Reads one stored tensor (its raw dtype, on the CPU): ``io.safetensors.read_tensor`` bound to the source root."""


@dataclass(frozen=True)
class LogicalTensor:
    """A tensor as an unquantized checkpoint would hold it.

    Attributes:
        name: its name in an unquantized checkpoint (e.g. ``model.layers.3.mlp.experts.7.gate_proj.weight``).
        dtype: the safetensors dtype string after decoding (``"BF16"``...; the stored dtype when not decoded).
        shape: its shape after decoding.
        parts: the stored tensors it is made from; ``parts[0]`` is the main one (the weight, or the MXFP4 blocks),
            the rest what it depends on (scales). One part and ``decoded == False``: stored as it is.
        decoded: whether it must go through the decoder (False: its bytes are the stored bytes).
        how: a short description for ``inspect`` (e.g. ``"fp8 e4m3 x 128x128 block scale -> bf16"``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[TensorInfo, ...]
    decoded: bool = False
    how: str = "stored as is"

    @property
    def stored(self) -> TensorInfo:
        """The main stored tensor."""
        return self.parts[0]

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def nbytes_stored(self) -> int:
        """Bytes read from the source for this tensor (all parts)."""
        return sum(p.nbytes for p in self.parts)


class Decoder(Protocol):
    """A source format. Stateless apart from what it read from the config at construction."""

    name: ClassVar[str]
    """Short name shown by ``inspect`` and recorded in ``expq.json`` (``"none"`` for an unquantized source)."""

    @classmethod
    def detect(cls, config: dict, tensors: dict[str, TensorInfo]) -> "Decoder | None":
        """This format's decoder if ``config`` (its ``quantization_config``) and the stored dtypes say the source is
        in this format, else None.

        Raises:
            SourceError: the source claims this format but its config is inconsistent (names the key).
        """
        ...

    def check_experts(self, experts: ExpertMap) -> None:
        """Refuse what this format stores for the routed experts that expq must not decode (called by
        ``plan.make_plan`` with the expert map of the layout in use; most formats refuse nothing).

        Raises:
            SourceError: names the tensor.
        """
        ...

    def logical_tensors(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Map every stored tensor onto the logical tensors (each stored tensor is a part of exactly one).

        Args:
            tensors: name -> stored TensorInfo over every shard of the source.

        Returns:
            logical name -> LogicalTensor, in the stored order of each tensor's main part.

        Raises:
            SourceError: a weight without its scale, a scale without its weight, a shape or block size that does
                not fit (naming file and tensor).
        """
        ...

    def decode(self, tensor: LogicalTensor, read: ReadFn, device: torch.device | None = None) -> torch.Tensor:
        """Decode one logical tensor (``tensor.decoded`` is True) from its parts.

        Args:
            device: where to compute (the parts are moved there): None or a CPU for the CPU path
                (``cpu_kernels``, on the conversion's thread pool), a CUDA device for torch ops on it. The values do
                not depend on it.

        Returns:
            a tensor of ``tensor.shape`` in the torch dtype of ``tensor.dtype``, on ``device`` (a CPU if None).

        Raises:
            SourceError: the stored values cannot be decoded (names file and tensor).
        """
        ...

    def row_absmax(self, tensor: LogicalTensor, read: ReadFn, dim: int = -1) -> torch.Tensor | None:
        """``|decode(tensor)|``'s maximum over dimension ``dim`` (-1: the last; -2: the one before it), keepdim,
        without the decoded tensor, where this format can take it for less than a decode: the decoded shape with
        ``dim`` of size 1, in the decoded dtype on the CPU, bit for bit the largest magnitude of the decoded values
        it reduces (NaN as the canonical quiet NaN, -0.0 as +0.0). None where it is not offered, for that ``dim``
        or at all (the caller decodes). The experts-int8 front pass takes the scales from it, over the dimension
        along which the matrices' rows run (``experts.ExpertTensor.row_dim``): -1 for the FP8 block decoder
        (``[out, in]``), -2 for the MXFP4 one (``[E, in, out]``).

        Raises:
            SourceError: as ``decode``.
        """
        ...

    def narrow(self, tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor | None:
        """``tensor[start:stop]`` along its leading dimension as a logical tensor of its own: the same name, dtype
        and decoding, shape ``(stop - start, *tensor.shape[1:])``, parts narrowed to the stored bytes that hold those
        rows (``TensorInfo.narrow``), so that ``decode`` and ``row_absmax`` of it give exactly the rows
        ``[start:stop]`` of theirs on the whole tensor. The pipeline quantizes a stacked expert tensor ``[E, ...]``
        by slices of experts this way (``plan.Slice``). None where this format cannot cut the tensor there without
        reading other rows (e.g. a block of scales straddling ``start``): the caller takes the tensor whole.
        A tensor stored as it is: ``narrow_stored``.
        """
        ...


def narrow_stored(tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor:
    """``tensor[start:stop]`` along its leading dimension for a tensor stored as it is (not decoded): its one part
    narrowed (``TensorInfo.narrow``). What every decoder's ``narrow`` answers for such a tensor."""
    if tensor.decoded or len(tensor.parts) != 1:
        raise ValueError(f"internal: {tensor.name} is not stored as it is")
    return LogicalTensor(tensor.name, tensor.dtype, (stop - start, *tensor.shape[1:]),
                         (tensor.stored.narrow(start, stop),), how=tensor.how)


def source_quantization_config(config: dict) -> dict | None:
    """The source's ``quantization_config`` (top level, else a nested text config's), or None."""
    from ..layouts import nested_configs

    for _, scope in [("", config), *nested_configs(config)]:
        qc = scope.get("quantization_config")
        if qc:
            return qc if isinstance(qc, dict) else {"quant_method": repr(qc)}
    return None

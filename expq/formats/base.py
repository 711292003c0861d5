"""The output-format protocol: what one quantized routed-expert matrix becomes in the checkpoint, and back.

A format is built for one model (``ExpertMap``) and compute dtype. The plan asks it for each matrix's output tensor
specs (names, dtypes, shapes) before anything is written; the pipeline hands it the experts_int8 codes and scales
and writes exactly the tensors ``encode`` returns, at the planned places; ``checkpoint`` asks ``decode`` for codes
and scales back. The format also owns its ``quantization_config`` and the check of it that ``verify`` runs, says
what each of its tensors is (``classify``: the engines load through it) and which engines load it (``clients``:
``inspect`` and the model card).

To add a format: copy ``formats/experts_int8.py``, implement the protocol, and add one line to ``formats.FORMATS``
(or, outside expq, ``FORMATS[MyFormat.name] = MyFormat``). A format with ``expq_loads`` is loaded by transformers
after ``import expq`` (expq's quantizer, registered under its ``quant_method``) and by ``expq.load_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:  # names for annotations only: this module imports nothing at run time (see formats/__init__.py)
    import torch

    from ..engines.clients import Client
    from ..experts import ExpertMap, Matrix, TensorLike
    from ..layouts import Layout


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: its name, safetensors dtype string and shape; ``value``: its bytes, when the format knows
    them before any weight is read (e.g. a stored shape). Such a tensor is written when its shard is opened and is
    not among what ``encode`` returns."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    value: bytes | None = None


ReadByName = Callable[[str], "torch.Tensor"]
"""Reads one tensor of a converted checkpoint by name (raises ``SourceError`` if it is absent)."""


class TensorRole(NamedTuple):
    """What one output tensor is: a piece of the quantized module ``(layer, expert, proj)``, ``role`` being a key of
    the format's ``suffixes`` (``"codes"``: int8 [out, in] as stored; ``"scale"``: the per-row scales [out]), or a
    layer's marker: ``(layer, -1, "", "marker")``."""

    layer: int
    expert: int
    proj: str
    role: str


class Format(Protocol):
    """An output format for experts_int8 codes and scales."""

    name: ClassVar[str]  # --format and expq.json's format
    quant_method: ClassVar[str]  # what its quantization_config calls it
    # True: no stock engine knows ``quant_method``; expq registers it (transformers after ``import expq``) and stock
    # clients refuse the checkpoint. False: stock clients load it themselves (stock transformers too, whose experts
    # are then right or not depending on the family: its layout's ``[clients] transformers``).
    expq_loads: ClassVar[bool]
    # role -> tensor-name suffix of one quantized module's tensors (``M.<suffix>``); "scale" is always among them,
    # and "codes" where a tensor holds the int8 codes [out, in] as they are.
    suffixes: ClassVar[Mapping[str, str]]
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

    def classify(self, name: str) -> TensorRole | None:
        """What an output tensor is (a quantized module's piece, or a layer's marker), else None: a tensor that is
        no part of this format, which every engine loads as it is."""
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

    def check_model(self, config: dict, *, use_cache: bool = True) -> list[str]:
        """Problems with this format's tensors for the transformers model class of ``config`` (config.json as a
        dict); empty when there are none (or nothing to check). ``use_cache=False``: nothing remembered from an
        earlier run is trusted (``verify``: the proof computes its answer)."""
        ...

    def check_config(self, config: dict, tensors: Mapping[str, TensorLike]) -> list[str]:
        """Problems with a converted checkpoint's ``quantization_config`` (empty list: it is right), given the
        checkpoint's tensors."""
        ...

    def clients(self, layout: Layout, hidden_size: int | None, *, local: bool = False) -> list[Client]:
        """Which engines load checkpoints of ``layout``'s family in this format, and with which command
        (``engines.clients``: vLLM, SGLang, transformers, expq); ``hidden_size``: the model's, or None;
        ``local``: the model is a local directory."""
        ...

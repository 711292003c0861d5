"""Putting a converted checkpoint's routed-expert tensors into a vLLM-style fused-MoE layer (pure torch, no vLLM).

A fused-MoE layer on one rank holds (vLLM's experts_int8 layout, ``E_local`` experts, ``I_r = I / tp_size``):

* ``w13_weight`` int8 [E_local, 2*I_r, H]: gate rows ``[0, I_r)``, then up rows ``[I_r, 2*I_r)``; or, for an
  activation that reads gate/up interleaved (vLLM's ``swigluoai``, gpt-oss), gate in the even rows and up in the odd
  rows (``Partition.interleaved``);
* ``w2_weight`` int8 [E_local, H, I_r];
* ``w13_scale`` fp32 [E_local, 2*I_r] (same row order as ``w13_weight``); ``w2_scale`` fp32 [E_local, H].

The checkpoint holds, per expert and projection, the codes int8 [out, in] (gate/up: [I, H]; down: [H, I]) and the
scales [out]. Tensor parallelism: rank ``r`` takes gate and up rows ``[r*I_r, (r+1)*I_r)`` (codes and scales) and
down columns ``[r*I_r, (r+1)*I_r)`` with every H row; the down scale is the full row's [H], never sliced (full-row
scales: what vLLM >= 0.28 uses at any tensor-parallel size). Expert parallelism: a global -> local expert id map,
``-1`` for an expert held by another rank (its tensors are skipped).

``LayerLoader`` does this for one layer and remembers which (expert, projection, kind) slots were filled;
``route_weights`` sends a checkpoint's tensor stream through a set of loaders and passes every other tensor on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

from ..errors import LayoutError, SourceError
from ..experts import w13_rows
from ..layouts import PROJECTIONS

KINDS = ("codes", "scale")
"""The two tensors of one expert projection: the int8 codes [out, in] and the per-row scales [out]."""

PARAM_NAMES = ("w13_weight", "w2_weight", "w13_scale", "w2_scale")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widening to fp32 is exact

Classify = Callable[[str], "tuple[int, int, str, str] | None"]
"""A checkpoint tensor name -> (layer, expert, proj, kind) with kind "codes", "scale" or "marker", else None."""


def per_rank(intermediate: int, tp_size: int, *, tensor: str | None = None) -> int:
    """The intermediate size one tensor-parallel rank holds: ``intermediate // tp_size``.

    Raises:
        LayoutError: ``tp_size`` < 1, or ``intermediate`` is not a multiple of it (vLLM splits experts evenly).
    """
    if tp_size < 1:
        raise LayoutError(f"tensor-parallel size must be >= 1, got {tp_size}", tensor=tensor)
    if intermediate % tp_size:
        raise LayoutError(f"the experts' intermediate size {intermediate} is not divisible by the tensor-parallel "
                          f"size {tp_size}", tensor=tensor, hint="choose a tensor-parallel size that divides it")
    return intermediate // tp_size


def empty_params(local_experts: int, hidden: int, intermediate_per_rank: int,
                 device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zero-filled ``w13_weight`` int8 [E, 2*I_r, H], ``w2_weight`` int8 [E, H, I_r], ``w13_scale`` fp32
    [E, 2*I_r], ``w2_scale`` fp32 [E, H] on ``device`` (None: torch's default device)."""
    E, H, I_r = local_experts, hidden, intermediate_per_rank
    return {"w13_weight": torch.zeros(E, 2 * I_r, H, dtype=torch.int8, device=device),
            "w2_weight": torch.zeros(E, H, I_r, dtype=torch.int8, device=device),
            "w13_scale": torch.zeros(E, 2 * I_r, dtype=torch.float32, device=device),
            "w2_scale": torch.zeros(E, H, dtype=torch.float32, device=device)}


@dataclass(frozen=True)
class Partition:
    """Which part of a layer one rank holds.

    Attributes:
        tp_rank, tp_size: tensor-parallel rank and size (the MoE layer's own, e.g. vLLM's
            ``moe_parallel_config.tp_rank / tp_size``; 0 and 1 under expert parallelism).
        expert_map: global expert id -> local id on this rank, ``-1`` where another rank holds it; None: every
            expert is local under its own id.
        interleaved: w13 rows hold gate and up interleaved (even rows gate, odd rows up) instead of gate then up.
    """

    tp_rank: int = 0
    tp_size: int = 1
    expert_map: tuple[int, ...] | None = None
    interleaved: bool = False

    def local(self, expert: int) -> int:
        """The local id of global ``expert`` (``-1``: not on this rank).

        Raises:
            LayoutError: ``expert`` is outside the map.
        """
        if self.expert_map is None:
            return expert
        if not 0 <= expert < len(self.expert_map):
            raise LayoutError(f"expert id outside the layer's {len(self.expert_map)} experts", expert=expert)
        return self.expert_map[expert]


class LayerLoader:
    """Loads one MoE layer's per-projection codes and scales into its fused parameters, tracking what arrived.

    Args:
        layer: the decoder-layer index (for messages).
        params: ``w13_weight`` int8 [E_local, 2*I_r, H], ``w2_weight`` int8 [E_local, H, I_r], ``w13_scale`` fp32
            [E_local, 2*I_r], ``w2_scale`` fp32 [E_local, H] (e.g. a module's parameters; written in place).
        num_experts: the layer's global expert count.
        partition: this rank's share (default: everything, tensor-parallel size 1).
        describe: ``(expert, proj) -> name`` of the checkpoint module, for messages (default
            ``"layer L expert e proj"``).

    Raises:
        LayoutError: a parameter is missing or has the wrong dtype or rank, or the four disagree on E_local, H, I_r.
    """

    def __init__(self, layer: int, params: Mapping[str, torch.Tensor], num_experts: int,
                 partition: Partition = Partition(), *, describe: Callable[[int, str], str] | None = None):
        self.layer = layer
        self.partition = partition
        self.num_experts = num_experts
        self.describe = describe or (lambda e, p: f"layer {layer} expert {e} {p}")
        self.params = {k: params[k] for k in PARAM_NAMES if k in params}
        self._check_params()
        w13 = self.params["w13_weight"]
        self.local_experts, self.hidden, self.intermediate_per_rank = w13.shape[0], w13.shape[2], w13.shape[1] // 2
        self.expected = {(e, p, k) for e in range(num_experts) if partition.local(e) >= 0
                         for p in PROJECTIONS for k in KINDS}
        self.filled: set[tuple[int, str, str]] = set()

    def _check_params(self) -> None:
        missing = [k for k in PARAM_NAMES if k not in self.params]
        if missing:
            raise LayoutError(f"layer {self.layer}: fused-MoE parameters missing: {', '.join(missing)}")
        want = {"w13_weight": (torch.int8, 3), "w2_weight": (torch.int8, 3), "w13_scale": (torch.float32, 2),
                "w2_scale": (torch.float32, 2)}
        for k, (dtype, dim) in want.items():
            t = self.params[k]
            if t.dtype != dtype or t.dim() != dim:
                raise LayoutError(f"layer {self.layer}: {k} is {t.dtype} {list(t.shape)}, expected {dtype} "
                                  f"{dim}-D")
        w13 = self.params["w13_weight"]
        E, I2, H = w13.shape
        shapes = {"w2_weight": (E, H, I2 // 2), "w13_scale": (E, I2), "w2_scale": (E, H)}
        for k, s in shapes.items():
            if I2 % 2 or tuple(self.params[k].shape) != s:
                raise LayoutError(f"layer {self.layer}: {k} {list(self.params[k].shape)} does not fit w13_weight "
                                  f"{list(w13.shape)} (expected {list(s)})")

    # --- loading --------------------------------------------------------------------------------------------------
    def load(self, expert: int, proj: str, kind: str, tensor: torch.Tensor, name: str) -> bool:
        """Put one checkpoint tensor into this rank's parameters.

        Args:
            expert: global expert id. proj: "gate", "up" or "down". kind: "codes" or "scale".
            tensor: codes int8 [out, in] (gate/up [I, H], down [H, I]) or scales [out] (fp32; bf16/fp16 are
                widened exactly); on any device.
            name: the tensor's checkpoint name (for messages).

        Returns:
            True if loaded, False if the expert belongs to another rank (nothing is written).

        Raises:
            LayoutError: unknown proj or kind, a wrong dtype or shape (the message names the tensor and both shapes),
                or an intermediate size the tensor-parallel size does not divide.
            SourceError: the same slot was loaded twice.
        """
        if proj not in PROJECTIONS or kind not in KINDS:
            raise LayoutError(f"unknown projection/kind {proj!r}/{kind!r}", tensor=name, expert=expert)
        local = self.partition.local(expert)
        if local < 0:
            return False
        slot = (expert, proj, kind)
        if slot in self.filled:
            raise SourceError(f"layer {self.layer}: {proj} {kind} loaded twice", tensor=name, expert=expert)
        self._check_tensor(proj, kind, tensor, name, expert)
        with torch.no_grad():
            self._write(local, proj, kind, tensor)
        self.filled.add(slot)
        return True

    def _check_tensor(self, proj: str, kind: str, t: torch.Tensor, name: str, expert: int) -> None:
        tp, H, I_r = self.partition.tp_size, self.hidden, self.intermediate_per_rank
        if kind == "codes" and t.dtype != torch.int8:
            raise LayoutError(f"codes must be int8, got {t.dtype}", tensor=name, expert=expert)
        if kind == "scale" and t.dtype not in _SCALE_DTYPES:
            raise LayoutError(f"scales must be float32 (or bfloat16/float16), got {t.dtype}", tensor=name,
                              expert=expert)
        i_dim = {("codes", "down"): 1, ("scale", "down"): None}.get((kind, proj), 0)  # the intermediate dim
        if i_dim is not None and t.dim() > i_dim:
            per_rank(t.shape[i_dim], tp, tensor=name)
        full = (H, I_r * tp) if proj == "down" else (I_r * tp, H)
        want = full if kind == "codes" else full[:1]
        if tuple(t.shape) != want:
            target = "w2" if proj == "down" else "w13"
            target += "_weight" if kind == "codes" else "_scale"
            raise LayoutError(f"layer {self.layer}: shape {list(t.shape)} does not fit {target} "
                              f"{list(self.params[target].shape)} at tensor-parallel size {tp} (expected "
                              f"{list(want)})", tensor=name, expert=expert)

    def _write(self, local: int, proj: str, kind: str, t: torch.Tensor) -> None:
        r, I_r = self.partition.tp_rank, self.intermediate_per_rank
        mine = slice(r * I_r, (r + 1) * I_r)
        if proj == "down":
            if kind == "codes":
                self.params["w2_weight"][local].copy_(t[:, mine])
            else:
                self.params["w2_scale"][local].copy_(t)  # the full row: never sliced
            return
        rows = w13_rows(proj, I_r, interleaved=self.partition.interleaved)
        target = self.params["w13_weight" if kind == "codes" else "w13_scale"]
        target[local, rows].copy_(t[mine])

    # --- completeness ---------------------------------------------------------------------------------------------
    def missing(self) -> list[tuple[int, str, str]]:
        """The (expert, proj, kind) slots of this rank's experts not loaded yet, sorted by expert."""
        order = {p: i for i, p in enumerate(PROJECTIONS)}
        return sorted(self.expected - self.filled, key=lambda s: (s[0], order[s[1]], KINDS.index(s[2])))

    @property
    def complete(self) -> bool:
        return not (self.expected - self.filled)

    def check_complete(self) -> None:
        """Raises ``SourceError`` naming the layer, expert and projection of the first missing piece (and how many
        are missing), unless every slot of this rank's experts was loaded."""
        gone = self.missing()
        if gone:
            e, p, k = gone[0]
            more = f" ({len(gone)} pieces missing in this layer)" if len(gone) > 1 else ""
            raise SourceError(f"layer {self.layer}: the {p} projection's {k} never arrived{more}",
                              tensor=self.describe(e, p), expert=e)


def route_weights(weights: Iterable[tuple[str, torch.Tensor]], classify: Classify,
                  loaders: Mapping[int, LayerLoader]) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the routed-expert tensors of a (name, tensor) stream into ``loaders``; yield every other tensor.

    Tensors ``classify`` does not recognise pass through unchanged; markers are dropped; codes and scales go to the
    loader of their layer (dropped when this model holds no such layer, e.g. another pipeline stage's; a layer
    that is held gets checked below). When the stream ends, every loader must be complete.

    Raises:
        ExpqError: what ``LayerLoader.load`` raises; at the end, ``check_complete`` of the first incomplete loader.
    """
    for name, tensor in weights:
        key = classify(name)
        if key is None:
            yield name, tensor
            continue
        layer, expert, proj, kind = key
        if kind == "marker":
            continue
        loader = loaders.get(layer)
        if loader is not None:
            loader.load(expert, proj, kind, tensor, name)
    for loader in loaders.values():
        loader.check_complete()


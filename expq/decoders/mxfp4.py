"""MXFP4 sources: GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b) ships its routed experts as OCP microscaling FP4.

Stored (config ``quantization_config.quant_method == "mxfp4"``), for each expert projection ``P`` (e.g.
``model.layers.0.mlp.experts.gate_up_proj``):

- ``P_blocks`` U8 ``[E, R, G, 16]``: for expert ``e`` and output row ``r``, ``G`` blocks of 32 E2M1 (FP4) values along
  the input dimension, two a byte, **low nibble first** (element ``2j`` of a block is the low nibble of byte ``j``).
- ``P_scales`` U8 ``[E, R, G]``: one E8M0 exponent ``s`` per block; the block's scale is ``2**(s - 127)``.

E2M1 nibble ``n``: sign ``n >> 3``, magnitude ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)[n & 7]`` (OCP Microscaling Formats
spec v1.0, §5.3.3; the same table as transformers' ``integrations/mxfp4.py`` ``FP4_VALUES``).

Logical tensor: ``P`` bf16 ``[E, G*32, R]``, i.e. the stored ``[E, out, in]`` dequantized and transposed to the
``[E, in, out]`` that the bf16 GPT-OSS checkpoint and transformers' ``GptOssExperts`` hold (``gate_up_proj`` ``[E, H,
2I]`` with gate/up columns interleaved as stored, even = gate; ``down_proj`` ``[E, I, H]``; ``configs/gpt_oss.toml``
``in_out``). Established from transformers 5.24: ``integrations/mxfp4.py`` ``_convert_moe_packed_tensors`` decodes
``[*prefix, G, B]`` blocks to ``[*prefix, G*B*2]`` and returns ``out.transpose(1, 2)``; ``models/gpt_oss/
modeling_gpt_oss.py`` ``GptOssExperts`` holds ``gate_up_proj`` as ``[E, H, 2I]``, ``down_proj`` as ``[E, I, H]``, and
computes ``x @ gate_up_proj[e]`` with ``gate = gate_up[..., ::2]``.

The values are bit-identical to transformers' ``convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)`` on
the CPU (torch 2.13, tested for every byte and every scale). Its edge cases, as measured there:

- ``value * 2**(s - 127)`` is computed by ``torch.ldexp`` as the exact product rounded once to bf16: results past the
  bf16 range become ``±inf`` (``s >= 253`` for the larger magnitudes), and zeros stay (signed) zeros for every ``s``,
  including ``s = 255``, which the OCP spec reserves for NaN: no NaN is produced. ``s <= 1`` gives bf16 subnormals
  (down to ``2**-128``), kept, not flushed. Every finite product has at most two significant bits, so it is exact in
  bf16. (``torch._decomp``'s ldexp, ``self * pow(2, other)`` in the input dtype, would give NaN for ``0 * 2**128``; the
  eager CPU kernel does not.) Rows holding ``inf`` are then refused by the quantizer as non-finite, like any other.
- It reads the scales as integers (``scales.to(torch.int32)``): right for the published U8 scales, wrong for scales
  stored as F8_E8M0 (that cast converts values, not bits); this decoder accepts U8 only.
- It does not check the block width ``B`` (any ``B`` decodes ``2*B`` values) nor the rank (``transpose(1, 2)`` on
  other ranks misorders or fails); this decoder requires ``[E, R, G, 16]``.
- Its ``rows_per_chunk`` (32768*1024 block rows) only bounds memory; chunking does not change any value.

This decoder builds the bf16 bit patterns with integer arithmetic (no float multiply, no ldexp), so its result does not
depend on the torch version's ldexp; it runs on a CPU (a fused kernel or torch ops, bounded tiles of rows over the
conversion's pool) or on a GPU (torch ops). The experts-int8 front pass takes the absmax of each stored row
(``Mxfp4Decoder.row_absmax``) from one read of the packed bytes with a fused kernel, without the decoded tensor.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, ClassVar

import torch

from .. import cpu_kernels, parallel
from ..errors import SourceError
from ..io import buffers
from ..io.safetensors import TensorInfo
from .base import LogicalTensor, ReadFn, narrow_stored, source_quantization_config

if TYPE_CHECKING:
    from ..experts import ExpertMap

BLOCK = 32
"""E2M1 values per block (one E8M0 scale each)."""
BLOCK_BYTES = BLOCK // 2
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
HOW = "mxfp4 e2m1 x e8m0 (32-element blocks) -> bf16"
CHUNK_BYTES = 16 << 20
"""Stored block bytes per task of the torch decode on a CPU (its temporaries are about 8x this) and of the row
absmax."""
TILE_ROWS = 256
"""Rows of one expert per call of the fused CPU kernel: their 32 output rows per block stay in cache."""


class Mxfp4Decoder:
    """GPT-OSS MXFP4 experts: ``P_blocks`` + ``P_scales`` (both U8) -> ``P`` bf16 ``[E, in, out]``."""

    name: ClassVar[str] = "mxfp4"

    def __init__(self, quantization_config: dict):
        self.quantization_config = quantization_config
        self.modules_to_not_convert = list(quantization_config.get("modules_to_not_convert") or [])

    @classmethod
    def detect(cls, config: dict, tensors: dict[str, TensorInfo]) -> "Mxfp4Decoder | None":
        """This decoder if the config's ``quantization_config.quant_method`` is ``"mxfp4"`` (top level or a nested
        text config), else None. Other keys (``modules_to_not_convert``...) are accepted as the published
        openai/gpt-oss-20b and gpt-oss-120b configs write them.

        The stored tensors must agree, judged by their safetensors dtype strings: at least one ``*_blocks`` tensor, and
        every ``*_blocks`` / ``*_scales`` tensor ``U8``.

        Raises:
            SourceError: the config says mxfp4 but no tensor is stored as MXFP4 blocks (names config.json), or a
                ``*_blocks`` / ``*_scales`` tensor is not U8 (names file and tensor).
        """
        qc = source_quantization_config(config)
        if not qc or str(qc.get("quant_method", "")).lower() != "mxfp4":
            return None
        parts = [ti for n, ti in tensors.items() if _suffix(n)]
        for ti in parts:
            if ti.dtype != "U8":
                raise SourceError(f"quantization_config says mxfp4 but this MXFP4 {_suffix(ti.name)[1:]} tensor is "
                                  f"{ti.dtype}, not U8", file=ti.file, tensor=ti.name)
        if not any(_suffix(ti.name) == BLOCKS_SUFFIX for ti in parts):
            raise SourceError("quantization_config says quant_method 'mxfp4' but no tensor is stored as MXFP4 "
                              "(no *_blocks U8 tensor)", file="config.json",
                              hint="remove the quantization_config if the weights were dequantized")
        return cls(qc)

    def check_experts(self, experts: ExpertMap) -> None:
        """Nothing to refuse: any routed expert stored in this format is decoded."""

    def logical_tensors(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Pair each ``P_blocks`` U8 ``[E, R, G, 16]`` with ``P_scales`` U8 ``[E, R, G]`` (possibly in another shard)
        into the logical tensor ``P``: BF16 ``[E, G*32, R]``, parts (blocks, scales), decoded. Every other tensor is
        its own logical tensor, stored as is.

        Returns:
            logical name -> LogicalTensor, in the stored order of each main part (an MXFP4 tensor where its blocks are).

        Raises:
            SourceError: blocks without scales, scales without blocks, a dtype other than U8, blocks that are not 4-D
                with 16 bytes a block, scales whose shape is not the blocks' first three dimensions, or a stored
                tensor already named ``P`` (each naming file and tensor).
        """
        out: dict[str, LogicalTensor] = {}
        for name, ti in tensors.items():
            suffix = _suffix(name)
            if suffix is None:
                if name + BLOCKS_SUFFIX in tensors:
                    raise SourceError(f"stored both unquantized and as MXFP4 ({name}{BLOCKS_SUFFIX})", file=ti.file,
                                      tensor=name)
                out[name] = LogicalTensor(name, ti.dtype, ti.shape, (ti,))
                continue
            base = name[: -len(suffix)]
            if suffix == SCALES_SUFFIX:
                if base + BLOCKS_SUFFIX not in tensors:
                    raise SourceError(f"MXFP4 scales without their blocks ({base}{BLOCKS_SUFFIX} is not in the "
                                      "checkpoint)", file=ti.file, tensor=name)
                continue
            scales = tensors.get(base + SCALES_SUFFIX)
            if scales is None:
                raise SourceError(f"MXFP4 blocks without their scales ({base}{SCALES_SUFFIX} is not in the "
                                  "checkpoint)", file=ti.file, tensor=name)
            out[base] = LogicalTensor(base, "BF16", _logical_shape(ti, scales), (ti, scales), decoded=True, how=HOW)
        return out

    def row_absmax(self, tensor: LogicalTensor, read: ReadFn, dim: int = -1) -> torch.Tensor | None:
        """``|decode(tensor)|``'s maximum over dimension -2 (the input dimension of ``[E, in, out]``: the values of
        one stored row, its ``G`` blocks), keepdim: ``[E, 1, R]`` bfloat16 on the CPU (-0.0 as +0.0; the decode
        gives no NaN), from one read of the packed bytes and without the decoded tensor
        (``cpu_kernels.mxfp4_row_absmax_into``, tiles of rows over the conversion's pool): bit for bit the
        magnitude-bits maximum of ``decode(tensor)`` over that dimension. None for ``dim`` -1 (not offered: a
        maximum across the stored rows) and where the fused kernels are not active (the caller decodes). See
        ``Decoder.row_absmax``.

        Raises:
            SourceError: as ``decode``.
        """
        if dim != -2 or cpu_kernels.active() != "numba":
            return None
        blocks, scales = _read(tensor, read)
        E, R, G, _ = blocks.shape
        out = torch.empty((E, R), dtype=torch.bfloat16)  # no block (G == 0): the amax of none, 0
        blocks, scales, mags = blocks.contiguous(), scales.contiguous(), _magnitude_bits()
        rows = max(1, CHUNK_BYTES // max(1, G * BLOCK_BYTES))

        def tile(er: tuple[int, int]) -> None:
            cpu_kernels.mxfp4_row_absmax_into(blocks, scales, mags, out, er[0], er[1], min(R, er[1] + rows))

        parallel.each(tile, [(e, r0) for e in range(E) for r0 in range(0, R, rows)])
        return out.view(E, 1, R)

    def narrow(self, tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor | None:
        """Experts ``[start:stop]``: the blocks ``[E, R, G, 16]`` and the scales ``[E, R, G]`` narrowed alike along
        their leading dimension (each expert's blocks and scales are its own; the logical ``[E, in, out]`` keeps the
        leading ``E``). A tensor stored as it is: ``narrow_stored``. See ``Decoder.narrow``."""
        if not tensor.decoded:
            return narrow_stored(tensor, start, stop)
        return LogicalTensor(tensor.name, tensor.dtype, (stop - start, *tensor.shape[1:]),
                             tuple(p.narrow(start, stop) for p in tensor.parts), decoded=True, how=tensor.how)

    def decode(self, tensor: LogicalTensor, read: ReadFn, device: torch.device | None = None) -> torch.Tensor:
        """Dequantize one MXFP4 tensor.

        Formula (OCP MX v1.0; bit-identical to transformers 5.24 ``convert_moe_packed_tensors`` on the CPU): for
        expert ``e``, stored row ``r``, block ``g`` and element ``i`` in ``0..31``::

            byte = blocks[e, r, g, i // 2];  n = byte & 0xF if i is even else byte >> 4
            out[e, g*32 + i, r] = E2M1[n] * 2**(scales[e, r, g] - 127)      (rounded to bf16; see the module doc)

        Args:
            tensor: a logical tensor from ``logical_tensors`` (parts: blocks U8 [E, R, G, 16], scales U8 [E, R, G]).
            read: reads one stored tensor.
            device: where to compute (None: the CPU).

        Returns:
            a bfloat16 tensor ``[E, G*32, R]`` (contiguous) on ``device``.

        Raises:
            SourceError: the tensor is not an MXFP4 one, or what was read does not have the header's shape and dtype.
        """
        blocks, scales = _read(tensor, read)
        if device is not None and device.type != "cpu":
            blocks, scales = blocks.to(device, non_blocking=True), scales.to(device, non_blocking=True)
        return dequantize(blocks, scales)


def _read(tensor: LogicalTensor, read: ReadFn) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks and scales of an MXFP4 logical tensor as stored (checked against their headers).

    Raises:
        SourceError: the tensor is not an MXFP4 one, or what was read does not have the header's shape and dtype.
    """
    if not tensor.decoded or len(tensor.parts) != 2:
        raise SourceError("internal: not an MXFP4 tensor (needs blocks and scales)", file=tensor.file,
                          tensor=tensor.name)
    binfo, sinfo = tensor.parts
    blocks, scales = read(binfo), read(sinfo)
    for info, t in ((binfo, blocks), (sinfo, scales)):
        if t.dtype != torch.uint8 or tuple(t.shape) != info.shape:
            raise SourceError(f"read {t.dtype} {list(t.shape)}, expected uint8 {list(info.shape)}",
                              file=info.file, tensor=info.name)
    return blocks, scales


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 ``[E, R, G, 16]`` and ``scales`` uint8 ``[E, R, G]`` -> bfloat16 ``[E, G*32, R]``, on
    the inputs' device.

    The formula is in ``Mxfp4Decoder.decode``. On a CPU: tiles of rows of one expert spread over the conversion's
    thread pool (``parallel``), through the fused kernel (``cpu_kernels.mxfp4_decode_into``) or torch ops (one
    gather of both values of a byte from ``_pair_table``, at most ``CHUNK_BYTES`` of blocks at a time); on a GPU the
    torch ops, an expert at a time. The inputs are not modified.

    Raises:
        ValueError: wrong dtypes or shapes (``Mxfp4Decoder`` checks them before, naming the tensor).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_BYTES or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)}: expected [E, R, G, 16] / "
                         "[E, R, G]")
    E, R, G, _ = blocks.shape
    out = buffers.empty((E, G * BLOCK, R), torch.bfloat16) if blocks.device.type == "cpu" else \
        torch.empty(E, G * BLOCK, R, dtype=torch.bfloat16, device=blocks.device)  # on a CPU: a conversion's pool
    if blocks.device.type == "cpu" and cpu_kernels.active() == "numba":
        blocks, scales, values = blocks.contiguous(), scales.contiguous(), _value_bits()

        def tile(er: tuple[int, int]) -> None:
            cpu_kernels.mxfp4_decode_into(blocks, scales, values, out, er[0], er[1], min(R, er[1] + TILE_ROWS))

        parallel.each(tile, [(e, r0) for e in range(E) for r0 in range(0, R, TILE_ROWS)])
        return out
    pairs = _pair_table().to(blocks.device).view(torch.int32).view(-1)  # both bf16 values of a byte as one word
    rows = R if blocks.device.type != "cpu" else max(1, CHUNK_BYTES // max(1, G * BLOCK_BYTES))

    def chunk(er: tuple[int, int]) -> None:
        e, r0 = er
        r1 = min(R, r0 + rows)
        idx = scales[e, r0:r1].to(torch.int32).unsqueeze(-1) * 256 + blocks[e, r0:r1].to(torch.int32)
        bits = pairs.index_select(0, idx.reshape(-1))  # [rows*G*16] words, each (low nibble, high nibble)
        out[e, :, r0:r1] = bits.view(torch.bfloat16).view(r1 - r0, G * BLOCK).t()

    items = [(e, r0) for e in range(E) for r0 in range(0, R, rows)]
    if blocks.device.type == "cpu":
        parallel.each(chunk, items)  # the conversion's pool, if any
    else:  # launched from this thread, on its stream (a pool's threads would launch on their default streams)
        for it in items:
            chunk(it)
    return out


@cache
def _pair_table() -> torch.Tensor:
    """int16 ``[256 * 256, 2]``: row ``s * 256 + byte`` holds the bf16 bit patterns of the byte's low-nibble and
    high-nibble E2M1 values times ``2**(s - 127)``, built from integers (see ``_value_bits``)."""
    vals = _value_bits()  # [256 scales, 16 nibbles]
    b = torch.arange(256)
    return torch.stack([vals[:, b & 0xF], vals[:, b >> 4]], dim=-1).reshape(256 * 256, 2).contiguous()


@cache
def _value_bits() -> torch.Tensor:
    """int16 ``[256, 16]``: bf16 bits of ``E2M1[n] * 2**(s - 127)`` for scale byte ``s`` and nibble ``n``.

    A nonzero E2M1 magnitude is ``(1 + f/2) * 2**k``: code 1 is ``1.0 * 2**-1``, codes ``m = 2..7`` have ``k = (m >> 1)
    - 1`` and ``f = m & 1``. Times ``2**(s - 127)`` its bf16 biased exponent is ``k + s``: in ``1..254`` a normal
    number (exponent bits ``k + s``, top mantissa bit ``f``); ``>= 255`` overflows to infinity; ``0`` or ``-1`` (only
    for ``s <= 1``) a subnormal with mantissa ``(2 + f) << (k + s + 5)`` (``2**-133`` units). Code 0 is zero. The sign
    is bit 15. Exact: no product needs rounding.
    """
    s = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    n = torch.arange(16, dtype=torch.int32).unsqueeze(0)
    m = n & 7
    k = torch.where(m >= 2, (m >> 1) - 1, -1)
    f = torch.where(m >= 2, m & 1, 0)
    eb = k + s  # [256, 16]
    normal = (eb.clamp(1, 254) << 7) | (f << 6)
    sub = (2 + f) << (eb + 5).clamp(0, 5)
    mag = torch.where(eb >= 255, 0x7F80, torch.where(eb >= 1, normal, sub))
    mag = torch.where(m == 0, 0, mag)
    bits = ((n >> 3) << 15) | mag
    return bits.to(torch.int32).sub(torch.where(bits >= 1 << 15, 1 << 16, 0)).to(torch.int16)


@cache
def _magnitude_bits() -> torch.Tensor:
    """int16 ``[256, 8]``: bf16 bits of ``|E2M1[c]| * 2**(s - 127)`` for scale byte ``s`` and magnitude code ``c``
    (``_value_bits`` of the positive nibbles; a negative nibble ``n`` has the bits of ``c = n & 7`` and the sign).
    Non-decreasing along each row (every product exact, or infinity past the range), which
    ``cpu_kernels.mxfp4_row_absmax_into`` relies on: checked here."""
    mags = _value_bits()[:, :8].contiguous()
    if not bool((mags[:, 1:] >= mags[:, :-1]).all()):  # (positive bf16 bits: int16 orders them as their values)
        raise AssertionError("MXFP4 magnitude table not monotonic in the code")
    return mags


def _suffix(name: str) -> str | None:
    """``"_blocks"`` / ``"_scales"`` if ``name`` is an MXFP4 part, else None."""
    for suf in (BLOCKS_SUFFIX, SCALES_SUFFIX):
        if name.endswith(suf) and len(name) > len(suf):
            return suf
    return None


def _logical_shape(blocks: TensorInfo, scales: TensorInfo) -> tuple[int, ...]:
    """``(E, G*32, R)`` for blocks ``[E, R, G, 16]`` and scales ``[E, R, G]``. Raises SourceError otherwise."""
    for ti in (blocks, scales):
        if ti.dtype != "U8":
            raise SourceError(f"MXFP4 {_suffix(ti.name)[1:]} must be U8, not {ti.dtype}", file=ti.file, tensor=ti.name)
    if len(blocks.shape) != 4 or blocks.shape[3] != BLOCK_BYTES:
        raise SourceError(f"MXFP4 blocks must be [experts, rows, blocks, {BLOCK_BYTES}], not {list(blocks.shape)}",
                          file=blocks.file, tensor=blocks.name)
    if scales.shape != blocks.shape[:3]:
        raise SourceError(f"MXFP4 scales {list(scales.shape)} do not fit blocks {list(blocks.shape)} (expected "
                          f"{list(blocks.shape[:3])}; blocks {blocks.name} in {blocks.file})", file=scales.file,
                          tensor=scales.name)
    E, R, G, _ = blocks.shape
    return (E, G * BLOCK, R)

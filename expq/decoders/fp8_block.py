"""FP8 sources with block scales (``quant_method: fp8`` + ``weight_block_size``): DeepSeek-V3/R1/V3.1/V3.2,
Kimi-K2, Qwen3-*-FP8, MiniMax-M2 and every checkpoint written the same way.

Stored format (DeepSeek-V3 ``README_WEIGHTS.md``; transformers' and vLLM's ``fp8`` loaders read the same): a linear
weight ``X.weight`` is stored as ``F8_E4M3`` (or ``F8_E5M2``) ``[rows, cols]`` next to ``X.weight_scale_inv``,
one float per ``br x bc`` block, ``[ceil(rows / br), ceil(cols / bc)]`` with ``(br, bc) = weight_block_size``.
The scale may sit in another shard. Despite its name the scale *multiplies*: the vendor's own conversion to bf16
(DeepSeek-V3 ``inference/fp8_cast_bf16.py`` calling ``weight_dequant`` of ``inference/kernel.py``) computes,
element by element,

    out[r, c] = bf16( float32(w[r, c]) * float32(scale[r // br, c // bc]) )

the fp32 product rounded once to bf16 (round to nearest even); the partial blocks at the right and bottom edges use
their block's scale as the full ones do. ``decode`` does exactly this: on a CPU with a fused kernel or torch ops, one
band of block rows at a time over the conversion's pool; on a GPU with torch ops.

Without ``weight_block_size`` (per-tensor FP8) the scale is one value (shape ``[]`` or ``[1]``, named
``weight_scale_inv`` or ``weight_scale``) applied the same way to the whole tensor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch

from .. import cpu_kernels, parallel
from ..errors import SourceError
from ..io import buffers
from ..io.safetensors import TORCH_DTYPES, TensorInfo
from ..scheme import canonical_nan_
from .base import LogicalTensor, ReadFn, narrow_stored, source_quantization_config

if TYPE_CHECKING:
    from ..experts import ExpertMap

FP8_WEIGHT_DTYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
"""Stored weight dtypes this decoder reads (decided from the safetensors dtype string, never from element size)."""
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
"""Stored scale dtypes: floats (DeepSeek ships F32, Qwen BF16); E8M0 power-of-two scales convert to F32 exactly."""
SCALE_SUFFIX = "_scale_inv"
PER_TENSOR_SUFFIXES = ("_scale_inv", "_scale")
BAND_BYTES = 64 << 20  # fp32 working set of one band of block rows in decode


def _block_size(qc: dict) -> tuple[int, int] | None:
    """``weight_block_size`` as ``(rows, cols)``, None when absent.

    Raises:
        SourceError: present but not a list of two positive ints (names config.json and the key).
    """
    if "weight_block_size" not in qc or qc["weight_block_size"] is None:
        return None
    v = qc["weight_block_size"]
    ok = (isinstance(v, (list, tuple)) and len(v) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v))
    if not ok:
        raise SourceError(f"quantization_config.weight_block_size must be a list of two positive integers, got {v!r}",
                          file="config.json")
    return int(v[0]), int(v[1])


class Fp8BlockDecoder:
    """FP8 weights with per-block (or per-tensor) float scales, decoded to bf16 as the vendor's script does.

    Attributes:
        block: ``(br, bc)`` from ``weight_block_size``; None for per-tensor FP8.
    """

    name: ClassVar[str] = "fp8-block"

    def __init__(self, block: tuple[int, int] | None):
        self.block = block

    # --- detection ----------------------------------------------------------------------------------------------
    @classmethod
    def detect(cls, config: dict, tensors: dict[str, TensorInfo]) -> "Fp8BlockDecoder | None":
        """The decoder when the source's ``quantization_config`` (top level or nested, see
        ``decoders.source_quantization_config``) says ``quant_method: fp8``, else None.

        Accepts every published variant seen (extra keys such as ``fmt`` ``e4m3``/``float8_e4m3fn``,
        ``activation_scheme``, ``scale_fmt: ue8m0``, ``modules_to_not_convert``, ``ignored_layers`` are not used:
        the stored dtypes decide).

        Raises:
            SourceError: ``weight_block_size`` malformed (names config.json and the key); a weight that has a
                ``weight_scale_inv`` partner but is not stored F8_E4M3/F8_E5M2; no tensor stored in FP8 at all.
        """
        qc = source_quantization_config(config)
        if not qc or qc.get("quant_method") != "fp8":
            return None
        dec = cls(_block_size(qc))
        for name in tensors:
            if name.endswith(".weight" + SCALE_SUFFIX):
                w = tensors.get(name[: -len(SCALE_SUFFIX)])
                if w is not None and w.dtype not in FP8_WEIGHT_DTYPES:
                    raise SourceError(f"has a {SCALE_SUFFIX} partner but is stored {w.dtype}, not F8_E4M3/F8_E5M2 as "
                                      "quantization_config quant_method=fp8 says", file=w.file, tensor=w.name)
        if not any(ti.dtype in FP8_WEIGHT_DTYPES for ti in tensors.values()):
            raise SourceError("quantization_config says quant_method=fp8 but no tensor is stored in F8_E4M3/F8_E5M2",
                              file="config.json", hint="if the weights were dequantized, remove quantization_config")
        return dec

    # --- mapping ------------------------------------------------------------------------------------------------
    def check_experts(self, experts: ExpertMap) -> None:
        """Nothing to refuse: any routed expert stored in this format is decoded."""

    def logical_tensors(self, tensors: dict[str, TensorInfo]) -> dict[str, LogicalTensor]:
        """Pair every FP8 weight with its scale; everything else maps to itself.

        Args:
            tensors: name -> stored TensorInfo over every shard (a weight and its scale may be in different files).

        Returns:
            logical name -> LogicalTensor in stored order: ``X.weight`` (dtype ``"BF16"``, the weight's shape,
            parts ``(weight, scale)``, ``decoded=True``) for each FP8 weight; every other tensor as it is stored.

        Raises:
            SourceError (naming file and tensor): an FP8 weight without its scale; a scale without its weight (or
            whose weight is not FP8); a scale whose shape is not ``[*lead, ceil(rows/br), ceil(cols/bc)]`` (``[]``
            or ``[1]`` per tensor); a scale not stored as a float; an FP8 tensor that is not a weight with a scale;
            static activation scales (``input_scale``).
        """
        scales: dict[str, TensorInfo] = {}  # FP8 weight name -> its scale
        for name, ti in tensors.items():
            if ti.dtype in FP8_WEIGHT_DTYPES:
                scales[name] = self._scale_of(name, ti, tensors)
                self._check_scale(ti, scales[name])
        used = {s.name for s in scales.values()}
        out: dict[str, LogicalTensor] = {}
        for name, ti in tensors.items():  # in stored order; scales ride along with their weight
            if name in scales:
                out[name] = LogicalTensor(name, "BF16", ti.shape, (ti, scales[name]), decoded=True,
                                          how=self._how(ti))
            elif name not in used:
                self._check_unpaired(name, ti, tensors)
                out[name] = LogicalTensor(name, ti.dtype, ti.shape, (ti,))
        return out

    def _check_unpaired(self, name: str, ti: TensorInfo, tensors: dict[str, TensorInfo]) -> None:
        """A tensor that is neither an FP8 weight nor its scale must not look like either."""
        if name.endswith("input_scale"):
            raise SourceError("static activation scales (input_scale) are not supported: expq reads FP8 "
                              "checkpoints with dynamic activation scaling", file=ti.file, tensor=name)
        if name.endswith(".weight" + SCALE_SUFFIX) or (self.block is None and name.endswith(".weight_scale")):
            w = tensors.get(name.rsplit("_scale", 1)[0])
            why = ("has no weight" if w is None else f"belongs to a weight stored {w.dtype}, not in FP8"
                   if w.dtype not in FP8_WEIGHT_DTYPES else f"is a second scale for {w.name}")
            raise SourceError(f"scale {why}", file=ti.file, tensor=name)
        if ti.dtype.startswith("F8_"):
            raise SourceError(f"stored {ti.dtype} but is not an FP8 weight with a scale: refusing to copy FP8 "
                              "bytes into a bf16 checkpoint", file=ti.file, tensor=name)

    def _scale_of(self, name: str, ti: TensorInfo, tensors: dict[str, TensorInfo]) -> TensorInfo:
        if not name.endswith(".weight"):
            raise SourceError(f"stored {ti.dtype} but is not an FP8 weight with a scale: refusing to copy FP8 bytes "
                              "into a bf16 checkpoint", file=ti.file, tensor=name)
        suffixes = (SCALE_SUFFIX,) if self.block is not None else PER_TENSOR_SUFFIXES
        for suf in suffixes:
            s = tensors.get(name + suf)
            if s is not None:
                return s
        raise SourceError(f"FP8 weight ({ti.dtype}) without its scale {name}{SCALE_SUFFIX} in any shard",
                          file=ti.file, tensor=name)

    def _check_scale(self, w: TensorInfo, s: TensorInfo) -> None:
        if s.dtype not in SCALE_DTYPES:
            raise SourceError(f"scale stored {s.dtype}; expected a float ({', '.join(SCALE_DTYPES)})", file=s.file,
                              tensor=s.name)
        if self.block is None:
            if s.shape not in ((), (1,)):
                raise SourceError(f"per-tensor FP8 (no weight_block_size) needs a scale of shape [] or [1], got "
                                  f"{list(s.shape)} for weight {list(w.shape)}", file=s.file, tensor=s.name)
            return
        if len(w.shape) < 2:
            raise SourceError(f"FP8 weight of shape {list(w.shape)}: block scales need at least 2 dimensions",
                              file=w.file, tensor=w.name)
        br, bc = self.block
        *lead, rows, cols = w.shape
        want = (*lead, math.ceil(rows / br), math.ceil(cols / bc))
        if s.shape != want:
            raise SourceError(f"scale shape {list(s.shape)} does not fit weight {list(w.shape)} with "
                              f"weight_block_size [{br}, {bc}] (expected {list(want)})", file=s.file, tensor=s.name)

    def _how(self, w: TensorInfo) -> str:
        fmt = FP8_WEIGHT_DTYPES[w.dtype]
        if self.block is None:
            return f"fp8 {fmt} x per-tensor scale -> bf16"
        return f"fp8 {fmt} x {self.block[0]}x{self.block[1]} block scale_inv -> bf16"

    # --- decoding -----------------------------------------------------------------------------------------------
    def decode(self, tensor: LogicalTensor, read: ReadFn, device: torch.device | None = None) -> torch.Tensor:
        """Dequantize one FP8 weight as DeepSeek-V3's ``fp8_cast_bf16.py`` / ``weight_dequant`` do.

        ``out[..., r, c] = bf16(float32(w[..., r, c]) * float32(scale[..., r // br, c // bc]))``: one fp32 multiply,
        one rounding to bf16 (nearest even); a NaN product is stored as the canonical quiet NaN (0x7FC0). On a CPU
        the fused kernel (``cpu_kernels.fp8_block_decode_into``: each byte's float32 value from its bits, the
        product and the rounding, vectorized) or torch ops, one band of block rows at a time over the conversion's pool; on a GPU torch ops over
        the whole tensor. Peak host memory is the stored weight, the bf16 result and (torch on a CPU) one fp32 band
        of block rows (about 64 MiB).

        Args:
            tensor: a LogicalTensor from ``logical_tensors`` with ``decoded`` True (parts: weight, scale).
            read: reads one stored tensor in its raw dtype on the CPU.
            device: where to compute (None: the CPU).

        Returns:
            a ``torch.bfloat16`` tensor of ``tensor.shape`` on ``device``.

        Raises:
            SourceError: the tensor is not one of this decoder's (names file and tensor).
        """
        w, s = self._read(tensor, read)
        if device is not None and device.type != "cpu":
            w, s = w.to(device, non_blocking=True), s.to(device, non_blocking=True)
        s = s.to(torch.float32)
        if w.numel() == 0:
            return torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
        w3, s3, block = self._as_blocks(w, s)
        if w.device.type != "cpu":
            out = _decode_whole(w3, s3, block)
        elif cpu_kernels.active() == "numba":
            out = _decode_cpu(w3, s3, block, fused=True)
        else:
            out = _decode_cpu(w3, s3, block, fused=False)
        return out.view(w.shape)

    def narrow(self, tensor: LogicalTensor, start: int, stop: int) -> LogicalTensor | None:
        """Rows ``[start:stop]`` of the leading dimension of an FP8 weight: per-tensor FP8, the weight narrowed and
        the one scale kept; block scales over a weight of 3 or more dimensions (stacked ``[E, rows, cols]``: each
        expert has its own blocks), weight and scale narrowed alike; a 2-D weight (flat ``[E*rows, cols]``), the
        weight narrowed and the scale to the block rows that cover it, where ``start`` and ``stop`` fall on block-row
        boundaries (``stop`` may be the end), else None (a block would straddle the cut). A tensor stored as it is:
        ``narrow_stored``. See ``Decoder.narrow``."""
        if not tensor.decoded:
            return narrow_stored(tensor, start, stop)
        w, s = tensor.parts
        if self.block is None:
            parts = (w.narrow(start, stop), s)
        elif len(w.shape) >= 3:
            parts = (w.narrow(start, stop), s.narrow(start, stop))
        else:
            br = self.block[0]
            if start % br or (stop % br and stop != w.shape[0]):
                return None
            parts = (w.narrow(start, stop), s.narrow(start // br, math.ceil(stop / br)))
        return LogicalTensor(tensor.name, tensor.dtype, (stop - start, *tensor.shape[1:]), parts, decoded=True,
                             how=tensor.how)

    @staticmethod
    def _read(tensor: LogicalTensor, read: ReadFn) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight and its scale as stored (the weight's dtype checked against its header)."""
        if not tensor.decoded or len(tensor.parts) != 2:
            raise SourceError("internal: not an FP8 weight with a scale", file=tensor.file, tensor=tensor.name)
        wi, si = tensor.parts
        w = read(wi)
        if w.dtype != TORCH_DTYPES[wi.dtype]:
            raise SourceError(f"read as {w.dtype}, expected {wi.dtype}", file=wi.file, tensor=wi.name)
        return w, read(si)

    def row_absmax(self, tensor: LogicalTensor, read: ReadFn, dim: int = -1) -> torch.Tensor | None:
        """``|decode(tensor)|``'s maximum over the last dimension, [*shape[:-1], 1] bfloat16 on the CPU (NaN as
        the canonical quiet NaN, -0.0 as +0.0), from one read of the FP8 bytes and without the decoded tensor
        (``cpu_kernels.fp8_block_row_absmax_into``, one band of block rows at a time over the conversion's pool):
        bit for bit the magnitude-bits maximum of ``decode(tensor)``'s rows. None for ``dim`` -2 (not offered) and
        where the fused kernels are not active (the caller decodes instead).

        Raises:
            SourceError: as ``decode``.
        """
        if dim != -1 or cpu_kernels.active() != "numba":
            return None
        w, s = self._read(tensor, read)
        s = s.to(torch.float32)
        shape = (*tensor.shape[:-1], 1)
        if w.numel() == 0:
            return torch.zeros(shape, dtype=torch.bfloat16)  # no row, or rows without elements: the amax of none
        w3, s3, (br, bc) = self._as_blocks(w, s)
        E, rows, cols = w3.shape
        out = torch.empty((E, rows), dtype=torch.bfloat16)
        band = max(1, min(br, BAND_BYTES // max(1, cols)))

        def one(er: tuple[int, int]) -> None:
            e, r0 = er
            cpu_kernels.fp8_block_row_absmax_into(w3, s3, out, (br, bc), e, r0, min(rows, r0 + band,
                                                                                    (r0 // br + 1) * br))

        parallel.each(one, [(e, r0) for e in range(E) for b0 in range(0, rows, br)
                            for r0 in range(b0, min(rows, b0 + br), band)])
        return out.view(shape)

    def _as_blocks(self, w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """``w`` as [E, rows, cols], ``s`` as [E, ceil(rows/br), ceil(cols/bc)] fp32, and (br, bc); a per-tensor
        scale is one block covering the whole tensor."""
        if self.block is None:
            w3 = w.reshape(1, -1, w.shape[-1]) if w.dim() >= 2 else w.reshape(1, 1, -1)
            return w3, s.reshape(1, 1, 1), (w3.shape[1], w3.shape[2])
        rows, cols = w.shape[-2:]
        return w.reshape(-1, rows, cols), s.reshape(-1, *s.shape[-2:]), self.block


def _decode_cpu(w3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int], fused: bool) -> torch.Tensor:
    """The CPU decode, band by band over the conversion's pool: a band is rows of one block row (at most about
    ``BAND_BYTES`` of fp32), fused kernel or torch ops."""
    E, rows, cols = w3.shape
    br, bc = block
    out = buffers.empty(w3.shape, torch.bfloat16)  # a conversion's pool: reused once nothing holds it
    band = max(1, min(br, BAND_BYTES // max(1, 4 * cols)))
    if parallel.pool() is None and not fused:
        band = br  # in turn in this thread: whole block rows
    srow = None if fused else s3.repeat_interleave(bc, dim=-1)[..., :cols]  # [E, ceil(rows/br), cols]

    def one(er: tuple[int, int]) -> None:
        e, r0 = er
        r1 = min(rows, r0 + band, (r0 // br + 1) * br)
        if fused:
            cpu_kernels.fp8_block_decode_into(w3, s3, out, block, e, r0, r1)
        else:
            out[e, r0:r1] = w3[e, r0:r1].to(torch.float32) * srow[e, r0 // br]

    items = [(e, r0) for e in range(E) for b0 in range(0, rows, br) for r0 in range(b0, min(rows, b0 + br), band)]
    parallel.each(one, items)
    return out if fused else canonical_nan_(out)


def _decode_whole(w3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The decode in torch ops over the whole tensor at once (a GPU): the scales spread to every element."""
    E, rows, cols = w3.shape
    br, bc = block
    sfull = s3.repeat_interleave(br, dim=-2)[:, :rows].repeat_interleave(bc, dim=-1)[..., :cols]
    return canonical_nan_((w3.to(torch.float32) * sfull).to(torch.bfloat16))

"""The experts_int8 scheme: vLLM's per-output-row int8 quantization of routed-expert weights, bit for bit.

Source of the formula: vLLM ``model_executor/layers/quantization/experts_int8.py``,
``quantize_in_place_and_get_scales`` (vLLM <= 0.19; the online ``Int8OnlineMoEMethod`` of vLLM >= 0.20 runs the same
arithmetic in the parameter dtype). For a matrix ``w`` [out, in] held in the compute dtype ``d``:

    scale = amax(|w|, dim=1) / 127          (in d)
    q     = clamp(round(w / scale), -127, 127)   (w / scale rounded to d first, then half-to-even to an integer)
    codes = int8(q), one scale per output row

Two points decide bit-exactness (measured on an H200; README "The scheme"):

* On CUDA, ``tensor / python_scalar`` is computed as a multiplication by the fp32 reciprocal (``opmath``):
  ``d(float(amax) * fp32(1/127))``. The CPU divides instead, which differs for fp32 inputs. We follow CUDA, on every
  device, so a CPU conversion equals vLLM on the GPU.
* ``w / scale`` (tensor by tensor) is a true division in fp32, rounded to ``d`` before ``round()``: a double rounding
  that must be kept (doing it all in fp32 changes about 6% of the codes).

All-zero rows: amax 0 gives scale 0 and 0/0 = NaN, which vLLM's cast to int8 turns into 0; we store code 0 and scale
0.0 (vLLM's own value: finite, and 0 x 0 dequantizes to exactly 0). Rows whose scale underflows (fp16 rows with
0 < amax < ~7.6e-6) are reproduced bit for bit and reported. Rows holding NaN or infinity poison the whole row in vLLM;
they are refused unless explicitly allowed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from . import cpu_kernels, parallel
from .io import buffers
from .options import DTYPE_ALIASES, DTYPE_NAMES

INT8_MAX = 127
"""Largest code magnitude: vLLM clamps to [-127, 127] (symmetric; -128 is never produced)."""

ZERO_ROW_SCALE = 0.0
"""The scale an all-zero row gets (vLLM's value): codes are 0 and the row dequantizes to exactly 0."""

# fp32(1/127), computed as CUDA computes the reciprocal of a scalar divisor: in fp32.
_RECIP_INT8_MAX = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(INT8_MAX), dtype=torch.float32)

COMPUTE_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""The compute dtypes by name (``options.DTYPE_NAMES``; torch names them the same)."""
_DTYPE_ALIASES = DTYPE_ALIASES  # the names are options' (checked there before torch is imported)


def resolve_compute_dtype(config_dtype: str | None, requested: str = "auto") -> tuple[torch.dtype, str]:
    """The dtype vLLM would hold the expert weights in, and a sentence saying why.

    Args:
        config_dtype: the checkpoint config's ``torch_dtype`` / ``dtype`` string (e.g. ``"bfloat16"``), or None.
        requested: ``"auto"`` or an explicit ``"bfloat16" | "float16" | "float32"`` (``--dtype``), which wins.

    Returns:
        (dtype, reason).

    ``auto`` follows vLLM's ``--dtype auto`` (``vllm/config/model.py``, ``_resolve_auto_dtype``): the config's dtype,
    except that float32 checkpoints (and configs without a dtype, which transformers reads as float32) are served in
    the platform's preferred half type, bfloat16 on every GPU experts_int8 supports (compute capability >= 8.0).

    Raises:
        ValueError: an unknown dtype name.
    """
    req = _DTYPE_ALIASES.get(requested, requested)
    if req != "auto":
        if req not in COMPUTE_DTYPES:
            raise ValueError(f"unknown --dtype {requested!r}; use auto, bfloat16, float16 or float32")
        return COMPUTE_DTYPES[req], f"--dtype {req}"
    cfg = _DTYPE_ALIASES.get(config_dtype or "", config_dtype)
    if cfg in ("bfloat16", "float16"):
        return COMPUTE_DTYPES[cfg], f"config dtype {cfg} (vLLM --dtype auto keeps it)"
    if cfg in (None, "float32"):
        what = "config dtype float32" if cfg else "no dtype in config (float32)"
        return torch.bfloat16, f"{what} -> bfloat16 (vLLM --dtype auto serves float32 checkpoints in bfloat16)"
    raise ValueError(f"config dtype {config_dtype!r} is not a float type vLLM serves; pass --dtype explicitly")


def row_absmax(w: torch.Tensor) -> torch.Tensor:
    """``amax(|w|, dim=1)`` [rows] in ``w.dtype`` (exact in any dtype; NaN or inf in a row propagates to its amax)."""
    return w.abs().amax(dim=1)


def scales_from_absmax(amax: torch.Tensor) -> torch.Tensor:
    """Per-row scales ``amax / 127`` exactly as vLLM computes them on CUDA.

    Args:
        amax: [rows] row absmax in the compute dtype.

    Returns:
        [rows] in ``amax.dtype``: ``dtype(float32(amax) * fp32(1/127))`` (CUDA's rule for division by a scalar).
    """
    return (amax.to(torch.float32) * _RECIP_INT8_MAX.to(amax.device)).to(amax.dtype)


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row scales of ``w`` [rows, in] (compute dtype): ``scales_from_absmax(row_absmax(w))``, [rows]."""
    return scales_from_absmax(row_absmax(w))


def quantize_rows(w: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row of ``w`` to int8 codes with the experts_int8 arithmetic.

    Args:
        w: [rows, in] float tensor already in the compute dtype (bfloat16, float16 or float32), on any device.
        scales: optional precomputed ``row_scales(w)``.

    Returns:
        (codes, scales): codes int8 [rows, in] in [-127, 127]; scales [rows] in ``w.dtype`` (the exact values vLLM
        stores, as fp32, in ``w13_scale`` / ``w2_scale``).

    Rows whose quotient is NaN (all-zero rows: 0/0; non-finite rows) get code 0, as vLLM's float-to-int8 cast gives
    on CUDA and CPU; this is made explicit here rather than left to the cast.

    Raises:
        ValueError: ``w`` is not 2-D or not a float tensor.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rows expects a 2-D float tensor, got {tuple(w.shape)} {w.dtype}")
    if scales is None:
        scales = row_scales(w)
    q = w / scales.unsqueeze(1)  # true division, rounded to w.dtype (first rounding)
    q.round_()  # half to even (second rounding)
    q.clamp_(-INT8_MAX, INT8_MAX)
    q.nan_to_num_(nan=0.0)
    return q.to(torch.int8), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales`` per row, computed in fp32 and returned in ``dtype``.

    Args:
        codes: int8 [..., rows, in]; scales: [..., rows] (any float dtype).
    """
    return (codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)


@dataclass
class RowReport:
    """What a quantization found in one matrix (row indices): zero rows, underflowed scales, non-finite rows."""

    zero_rows: list[int] = field(default_factory=list)
    underflow_rows: list[int] = field(default_factory=list)
    nonfinite_rows: list[int] = field(default_factory=list)


def inspect_rows(amax: torch.Tensor, scales: torch.Tensor) -> RowReport:
    """Classify rows from their absmax [rows] and scales [rows] (compute dtype).

    * zero row: every element is 0 (scale 0, codes 0);
    * underflow row: a finite row with amax > 0 whose scale is 0 or subnormal in the compute dtype (its codes saturate
      or lose precision; reproduced bit for bit, and reported);
    * non-finite row: holds NaN or +-inf (its amax is then NaN or inf).
    """
    finite = torch.isfinite(amax)
    tiny = torch.finfo(amax.dtype).tiny
    zero = amax == 0
    underflow = finite & (amax > 0) & (scales < tiny)

    def idx(m: torch.Tensor) -> list[int]:
        return torch.nonzero(m).flatten().tolist() if bool(m.any()) else []

    return RowReport(zero_rows=idx(zero), underflow_rows=idx(underflow), nonfinite_rows=idx(~finite))


CPU_BLOCK_ELEMS = 1 << 20
"""Elements per row block on a CPU (2 MiB of bf16): one item of work for the thread pool; for the torch path, the
block and its quotient stay in cache while its passes run over it (measured best of 64K-4M on 2 cores)."""


def quantize_matrix(w: torch.Tensor, block_elems: int | None = None) -> tuple[torch.Tensor, torch.Tensor, RowReport]:
    """``quantize_rows`` plus the row report, computing the absmax once: bit-identical to ``quantize_rows(w)``.

    Args:
        w: [rows, in] in the compute dtype, on any device.
        block_elems: elements per row block (default: ``CPU_BLOCK_ELEMS`` on a CPU, the whole matrix on a GPU). The
            result does not depend on it: every row is computed on its own.

    Returns:
        (codes int8 [rows, in], scales [rows] in w.dtype, RowReport).

    On a CPU with ``cpu_kernels.active() == "numba"`` each row block goes through the fused one-pass kernel
    (``cpu_kernels.quantize_rows_into``); otherwise through torch ops (``_torch_block``), which also run on a GPU.
    Both give the same bits (``tests/test_scheme.py`` runs against each).

    Absmax: ``|w|`` is ``w``'s bits with the sign bit cleared, and for non-negative IEEE values the order of the
    bits as integers is the order of the values (+inf below every NaN), so the row absmax is taken as the integer
    maximum of those bits (about twice as fast as ``abs`` then ``amax`` in bf16 on a CPU; the same value, -0.0
    giving +0.0). A NaN scale (a row holding NaN) is stored as the canonical quiet NaN (``canonical_nan_``). The
    quotient can be NaN only where the scale is 0 or not finite; only those rows go through the NaN-to-0 step (the
    rest of the arithmetic is then redone for them by ``quantize_rows``).

    The blocks go through ``parallel.each``: spread over the conversion's thread pool while a CPU conversion runs
    (torch single-threaded, one thread per core: OpenMP's spinning teams collapse when the cores are shared with the
    pipeline's I/O threads), in turn in this thread otherwise.

    Raises:
        ValueError: ``w`` is not 2-D or not a float tensor.
    """
    codes, scales, amax = _quantize(w, block_elems, with_codes=True)
    return codes, scales, inspect_rows(amax, scales)


def matrix_scales(w: torch.Tensor, block_elems: int | None = None) -> torch.Tensor:
    """The scales ``quantize_matrix(w)`` returns (NaN stored canonical), without computing the codes: one pass of
    the absmax. [rows] in ``w.dtype``. ``block_elems`` as ``quantize_matrix``'s (``w.numel()``: the whole matrix in
    this thread, e.g. from a task of the pool).

    Raises:
        ValueError: ``w`` is not 2-D or not a float tensor.
    """
    return _quantize(w, block_elems, with_codes=False)[1]


def _quantize(w: torch.Tensor, block_elems: int | None, with_codes: bool):
    """(codes or None, scales, amax) of ``w`` by row blocks; see ``quantize_matrix``."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_matrix expects a 2-D float tensor, got {tuple(w.shape)} {w.dtype}")
    rows, cols = w.shape
    if block_elems is None:
        block_elems = CPU_BLOCK_ELEMS if w.device.type == "cpu" else rows * cols
    step = max(1, block_elems // max(cols, 1))
    codes = None
    if with_codes:  # on a CPU from the pool in use (a conversion's: reused once written and hashed)
        codes = buffers.empty((rows, cols), torch.int8) if w.device.type == "cpu" else \
            torch.empty((rows, cols), dtype=torch.int8, device=w.device)
    amax = torch.empty(rows, dtype=w.dtype, device=w.device)
    scales = torch.empty(rows, dtype=w.dtype, device=w.device)
    fused = w.device.type == "cpu" and w.is_contiguous() and cpu_kernels.active() == "numba"

    def block(r0: int) -> None:
        r1 = min(rows, r0 + step)
        if fused:
            cpu_kernels.quantize_rows_into(w, codes, amax, scales, r0, r1)
        else:
            _torch_block(w[r0:r1], None if codes is None else codes[r0:r1], amax[r0:r1], scales[r0:r1])

    parallel.each(block, range(0, rows, step))
    nan_rows = ~(scales != 0) | ~torch.isfinite(scales)  # only there can w / scale be NaN (0/0, x/NaN, inf/inf)
    if bool(nan_rows.any()):
        if codes is not None:
            codes[nan_rows] = quantize_rows(w[nan_rows], scales[nan_rows])[0]
        canonical_nan_(scales)
    return codes, scales, amax


def _torch_block(wb: torch.Tensor, cb: torch.Tensor | None, ab: torch.Tensor, sb: torch.Tensor) -> None:
    """One row block in torch ops (the reference path, and the GPU's): absmax, scales, then the codes into ``cb``.

    Clamp: division by a positive scale and rounding are both monotonic, so a row's largest rounded quotient
    magnitude is that of its absmax, ``round(amax / scale)``; where no row of a block exceeds 127 the clamp changes
    nothing and is skipped (nearly always: it can only bite when the scale rounded far below amax/127, i.e.
    subnormal fp16 scales)."""
    rows, cols = wb.shape
    qb = _scratch(rows, cols, wb.dtype, wb.device)
    bits, sign_off = _MAGNITUDE_BITS[wb.dtype]  # |w| as integers: the sign bit cleared
    torch.amax(torch.bitwise_and(wb.view(bits), sign_off, out=qb.view(bits)), dim=1, out=ab.view(bits))
    sb.copy_(scales_from_absmax(ab))
    if cb is None:
        return
    torch.div(wb, sb.unsqueeze(1), out=qb)  # true division, rounded to w.dtype (first rounding)
    qb.round_()  # half to even (second rounding)
    if bool((torch.div(ab, sb).round_() > INT8_MAX).any()):
        qb.clamp_(-INT8_MAX, INT8_MAX)
    cb.copy_(qb)


_local = threading.local()
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}


def _scratch(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's quotient buffer for one row block (kept between blocks and matrices: no allocation per block;
    grown when a larger block comes)."""
    key = (dtype, device)
    buf = getattr(_local, "buf", None)
    if buf is None or buf[0] != key or buf[1].numel() < rows * cols:
        _local.buf = buf = (key, torch.empty(rows * cols, dtype=dtype, device=device))
    return buf[1][: rows * cols].view(rows, cols)


_QUIET_NAN = {torch.bfloat16: (torch.int16, 0x7FC0), torch.float16: (torch.int16, 0x7E00),
              torch.float32: (torch.int32, 0x7FC00000)}


def canonical_nan_(x: torch.Tensor) -> torch.Tensor:
    """Set every NaN of ``x`` (bf16/fp16/fp32) to the positive quiet NaN with an empty payload, in place.

    The sign and payload of a NaN that arithmetic produces differ between vectorised and scalar code paths and
    between devices; scales of non-finite rows (kept only with ``--allow-nonfinite``) are stored canonical so that
    the output bytes never depend on the device or the block size.
    """
    int_dtype, bits = _QUIET_NAN[x.dtype]
    x.view(int_dtype).masked_fill_(torch.isnan(x), bits)
    return x



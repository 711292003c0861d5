"""Fused one-pass CPU kernels (numba) for the scheme and the source decoders, bit for bit the torch arithmetic.

The torch code in ``scheme`` and ``decoders`` is the reference (and what runs on a GPU). On a CPU, torch needs one
pass over a row block per operation (absmax, division, rounding, cast...); the kernels here do each element once,
with the same IEEE arithmetic in the same order, compiled by numba (LLVM) on first use and cached on disk:

* ``quantize_rows_into``: per row, the absmax as the integer maximum of the magnitude bits, the scale
  ``d(float32(amax) * fp32(1/127))`` (CUDA's reciprocal rule), then per element ``w / scale`` divided in fp32 and
  rounded to the compute dtype ``d`` (bf16: round to nearest even on the bits; fp16: LLVM's ``fptrunc`` to half),
  ``rint`` (half to even), clamp to [-127, 127], int8. Rows whose scale is 0 or not finite get code 0 here and are
  redone by the caller's torch path (``scheme.quantize_matrix``), as before;
* ``fp8_block_decode_into``: per element, the FP8 byte's exact float32 value from its bits (exponent rebiased,
  subnormals as ``m * 2**-9`` / ``2**-16``, NaN and infinity as the format has them), times its block's scale in
  fp32, rounded once to bf16 (nearest even; NaN as the canonical quiet NaN): the torch reference's arithmetic, in
  selects only, so that LLVM vectorizes the row (about 2.5 times the speed of a 256-entry table look-up per element);
* ``fp8_block_row_absmax_into``: the row absmax of that decode without writing it (per block of a row the largest
  and smallest magnitude code, looked up in a table of the block's decoded values: the experts-int8 front pass's
  scales of an FP8 source from one read of its bytes);
* ``mxfp4_decode_into``: per 32-value block, the 16 values of its scale byte looked up (``decoders.mxfp4``'s exact
  integer table), written transposed in tiles of rows;
* ``mxfp4_row_absmax_into``: the absmax of each stored row of that decode without writing it (per block the
  largest magnitude code, found bit by bit on the block's two 64-bit words, looked up for the block's scale: the
  experts-int8 front pass's scales of an MXFP4 source from one read of its bytes).

Which path runs is ``EXPQ_CPU_KERNEL``: ``numba``, ``torch``, or ``auto`` (the default: numba when it imports).
Every kernel releases the GIL, so the conversion's thread pool (``parallel``) runs them on every core.
``tests/test_cpu_kernels.py`` and ``tests/test_scheme.py`` prove each path against the reference.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from .options import CPU_KERNEL_ENV as ENV
from .options import cpu_kernel_choice


class KernelUnavailable(RuntimeError):
    """``EXPQ_CPU_KERNEL=numba`` but numba does not import."""


def active() -> str:
    """The CPU path in use: ``"numba"`` or ``"torch"`` (from ``EXPQ_CPU_KERNEL``; read at each call).

    Raises:
        UsageError: an unknown ``EXPQ_CPU_KERNEL`` value (``options.cpu_kernel_choice``).
        KernelUnavailable: ``numba`` asked for but not importable.
    """
    want = cpu_kernel_choice()
    if want == "torch":
        return "torch"
    if _kernels() is not None:
        return "numba"
    if want == "numba":
        raise KernelUnavailable(f"{ENV}=numba but numba does not import ({_import_error()}); "
                                f"pip install numba, or set {ENV}=torch")
    return "torch"


@cache
def _import_error() -> str:
    try:
        import numba  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not available
        return f"{type(e).__name__}: {e}"
    return ""


@cache
def _kernels():
    """The compiled kernels (a namespace), or None when numba is not available."""
    if _import_error():
        return None
    from . import _numba_kernels

    return _numba_kernels


# --- numpy views of torch tensors (no copy) ---------------------------------------------------------------------------
_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float16: (torch.int16, np.uint16),
         torch.float32: (torch.int32, np.uint32)}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a bf16/fp16/fp32 CPU tensor as an unsigned numpy array (shares memory)."""
    int_dtype, np_dtype = _BITS[t.dtype]
    return t.view(int_dtype).numpy().view(np_dtype)


# --- the scheme -------------------------------------------------------------------------------------------------------
def quantize_rows_into(w: torch.Tensor, codes: torch.Tensor | None, amax: torch.Tensor, scales: torch.Tensor,
                       r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of ``w`` quantized with the experts_int8 arithmetic (see the module docstring).

    Args:
        w: [rows, cols] contiguous CPU tensor in the compute dtype (bfloat16, float16 or float32).
        codes: int8 [rows, cols], or None for the absmax and scales only (no codes).
        amax, scales: [rows] in ``w.dtype``: receive the row absmax (``|w|``'s maximum; NaN/inf propagate as
            ``amax(|w|)`` gives them, -0.0 as +0.0) and the scales (bit for bit ``scheme.scales_from_absmax``).

    Rows whose scale is 0 or not finite get code 0 (the caller redoes them).
    """
    k = _kernels()
    x = _bits(w)
    c = codes.numpy() if codes is not None else np.empty((0, 0), np.int8)
    if w.dtype == torch.bfloat16:
        k.quantize_bf16(x, c, _bits(amax), _bits(scales), r0, r1, codes is not None)
    elif w.dtype == torch.float16:
        k.quantize_f16(x, c, _bits(amax), _bits(scales), r0, r1, codes is not None)
    else:
        k.quantize_f32(x, c, _bits(amax), _bits(scales), r0, r1, codes is not None)


# --- FP8 block decode -------------------------------------------------------------------------------------------------
def fp8_values(dtype: torch.dtype) -> np.ndarray:
    """fp32 [256]: the value of every byte as ``dtype`` (float8_e4m3fn or float8_e5m2), converted by torch (the
    table ``fp8_block_row_absmax_into`` looks its extreme codes up in)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy().copy()


def fp8_block_decode_into(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block: tuple[int, int],
                          e: int, r0: int, r1: int) -> None:
    """``out[e, r0:r1] = bf16(float32(w[e, r0:r1]) * s[e, r // br, c // bc])``; rows ``r0:r1`` inside one block row.

    Args:
        w: float8 (e4m3fn or e5m2) [E, rows, cols] CPU; s: float32 [E, ceil(rows/br), ceil(cols/bc)];
        out: bfloat16 [E, rows, cols]; block: (br, bc).
    """
    k = _kernels()
    kernel = {torch.float8_e4m3fn: k.fp8_e4m3_block_decode, torch.float8_e5m2: k.fp8_e5m2_block_decode}[w.dtype]
    kernel(w.view(torch.uint8).numpy(), s.numpy(), _bits(out), block[0], block[1], e, r0, r1)


def fp8_block_row_absmax_into(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block: tuple[int, int],
                              e: int, r0: int, r1: int) -> None:
    """``out[e, r] = max_c |bf16(float32(w[e, r, c]) * s[e, r // br, c // bc])|`` for rows ``r0:r1`` inside one
    block row (NaN as the canonical quiet NaN, -0.0 as +0.0): bit for bit the row absmax of
    ``fp8_block_decode_into``'s output, without writing it.

    Per block of a row it takes the largest and the smallest magnitude code (``byte & 0x7F``) and looks both up
    in a 128-entry table of ``|decoded|`` bits for the block's scale. That is exact for every scale: as a
    function of the magnitude code (finite codes in increasing order, then E5M2's inf, then NaN) the decoded
    magnitude never decreases for a finite scale (the product and the rounding to nearest even are monotonic; a
    zero scale gives 0 for finite codes and NaN for inf and NaN), and for an infinite one it is NaN at code 0
    (``0 * inf``) and never decreases above it (inf, then NaN); a NaN scale gives NaN everywhere. So the block's
    largest magnitude is the larger of the two codes' entries (NaN's bits above every other).

    Args:
        w: float8 (e4m3fn or e5m2) [E, rows, cols] CPU; s: float32 [E, ceil(rows/br), ceil(cols/bc)];
        out: bfloat16 [E, rows]; block: (br, bc).
    """
    _kernels().fp8_block_row_absmax(w.view(torch.uint8).numpy(), s.numpy(), _bits(out), fp8_values(w.dtype),
                                    block[0], block[1], e, r0, r1)


# --- MXFP4 decode -----------------------------------------------------------------------------------------------------
def mxfp4_decode_into(blocks: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                      e: int, r0: int, r1: int) -> None:
    """``out[e, :, r0:r1]`` from ``blocks[e, r0:r1]`` and ``scales[e, r0:r1]``: each nibble's bf16 bits looked up in
    ``values`` (int16 [256 scales, 16 nibbles], ``decoders.mxfp4``'s table), low nibble first.

    Args:
        blocks: uint8 [E, R, G, 16]; scales: uint8 [E, R, G]; out: bfloat16 [E, G*32, R] (contiguous).
    """
    _kernels().mxfp4_decode(blocks.numpy(), scales.numpy(), values.numpy().view(np.uint16), _bits(out), e, r0, r1)


def mxfp4_row_absmax_into(blocks: torch.Tensor, scales: torch.Tensor, mags: torch.Tensor, out: torch.Tensor,
                          e: int, r0: int, r1: int) -> None:
    """``out[e, r] = max_{g, i} |decoded value i of block g of row r|`` for rows ``r0:r1`` of expert ``e``: bit for
    bit the maximum over dimension -2 of ``mxfp4_decode_into``'s ``[E, G*32, R]`` output (-0.0 as +0.0; the table
    has no NaN), without writing it.

    A nibble's decoded magnitude is ``mags[s, n & 7]`` (the sign is bit 3 of the nibble and bit 15 of the value),
    and ``mags`` never decreases along a row (every product is exact or overflows to infinity, see
    ``decoders.mxfp4._value_bits``), so a block's largest magnitude is the entry of its largest magnitude code
    ``max(n & 7)``; the largest of those bits over the row's blocks is its largest magnitude (non-negative bf16 bit
    patterns order as their values).

    Args:
        blocks: uint8 [E, R, G, 16] (the last dimension contiguous); scales: uint8 [E, R, G];
        mags: int16 [256, 8], the bf16 bits of ``|E2M1[c]| * 2**(s - 127)`` (``decoders.mxfp4``'s table);
        out: bfloat16 [E, R].
    """
    _kernels().mxfp4_row_absmax(blocks.numpy().view(np.uint64), scales.numpy(), mags.numpy().view(np.uint16),
                                _bits(out), e, r0, r1)

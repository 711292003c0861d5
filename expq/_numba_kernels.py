"""The numba kernels behind ``cpu_kernels`` (imported only when numba is available; see that module for what each
computes and why it is exact). Bit patterns travel as unsigned integers (bf16/fp16 as uint16, fp32 as uint32);
float <-> bits and half <-> float conversions are LLVM instructions (``bitcast``, ``fpext``, ``fptrunc``), which
are exact IEEE operations (no rounding mode other than nearest even is ever set)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_RECIP_127 = np.float32(np.float32(1.0) / np.float32(127.0))  # fp32(1/127), as CUDA computes the reciprocal
_LO, _HI = np.float32(-127.0), np.float32(127.0)
_BF16_NAN = np.uint16(0x7FC0)  # the canonical quiet NaN (scheme.canonical_nan_)


@intrinsic
def _f32(typingctx, u):
    """uint32 bits -> float32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _u32(typingctx, f):
    """float32 -> its uint32 bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _half_to_f32(typingctx, u):
    """fp16 bits (uint16) -> float32 (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_half(typingctx, f):
    """float32 -> fp16 bits (uint16), rounded to nearest even (overflow to inf, subnormals kept)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(inline="always")
def _bf16_round(f):
    """float32 -> the float32 value of its bf16 rounding (nearest even; finite or inf input, not NaN)."""
    b = _u32(f)
    b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return _f32(b)


@njit(inline="always")
def _bf16_bits(f):
    """float32 -> bf16 bits, nearest even; NaN -> the canonical quiet NaN."""
    if f != f:
        return _BF16_NAN
    b = _u32(f)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(inline="always")
def _code(q):
    return np.int8(min(max(np.rint(q), _LO), _HI))


# --- the scheme: one kernel per compute dtype ------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def quantize_bf16(x, codes, amax, scales, r0, r1, with_codes):
    cols = x.shape[1]
    for r in range(r0, r1):
        row = x[r]
        m = np.uint16(0)
        for c in range(cols):  # (ufunc and compare: both stay 16-bit, so LLVM vectorizes the loop)
            v = np.bitwise_and(row[c], np.uint16(0x7FFF))
            if v > m:
                m = v
        amax[r] = m
        if m > np.uint16(0x7F80):  # NaN
            scales[r] = _BF16_NAN
            s = np.float32(np.nan)
        else:
            sb = _bf16_bits(_f32(np.uint32(m) << np.uint32(16)) * _RECIP_127)
            scales[r] = sb
            s = _f32(np.uint32(sb) << np.uint32(16))
        if not with_codes:
            continue
        out = codes[r]
        if not (s > np.float32(0.0) and s < np.float32(np.inf)):
            out[:] = 0
            continue
        for c in range(cols):
            out[c] = _code(_bf16_round(_f32(np.uint32(row[c]) << np.uint32(16)) / s))


@njit(nogil=True, cache=True)
def quantize_f16(x, codes, amax, scales, r0, r1, with_codes):
    cols = x.shape[1]
    for r in range(r0, r1):
        row = x[r]
        m = np.uint16(0)
        for c in range(cols):  # (ufunc and compare: both stay 16-bit, so LLVM vectorizes the loop)
            v = np.bitwise_and(row[c], np.uint16(0x7FFF))
            if v > m:
                m = v
        amax[r] = m
        sb = _f32_to_half(_half_to_f32(m) * _RECIP_127)  # NaN stays NaN (the caller stores it canonical)
        scales[r] = sb
        s = _half_to_f32(sb)
        if not with_codes:
            continue
        out = codes[r]
        if not (s > np.float32(0.0) and s < np.float32(np.inf)):
            out[:] = 0
            continue
        for c in range(cols):
            out[c] = _code(_half_to_f32(_f32_to_half(_half_to_f32(row[c]) / s)))


@njit(nogil=True, cache=True)
def quantize_f32(x, codes, amax, scales, r0, r1, with_codes):
    cols = x.shape[1]
    for r in range(r0, r1):
        row = x[r]
        m = np.uint32(0)
        for c in range(cols):
            v = np.bitwise_and(row[c], np.uint32(0x7FFFFFFF))
            if v > m:
                m = v
        amax[r] = m
        s = _f32(m) * _RECIP_127
        scales[r] = _u32(s)
        if not with_codes:
            continue
        out = codes[r]
        if not (s > np.float32(0.0) and s < np.float32(np.inf)):
            out[:] = 0
            continue
        for c in range(cols):
            out[c] = _code(_f32(row[c]) / s)


# --- FP8 block decode ------------------------------------------------------------------------------------------------
_E4M3_SUB = np.float32(2.0 ** -9)  # an E4M3 subnormal is m * 2**-9 (exponent field 0, mantissa m of 3 bits)
_E5M2_SUB = np.float32(2.0 ** -16)  # an E5M2 subnormal is m * 2**-16 (mantissa m of 2 bits)
_F32_QNAN = np.uint32(0x7FC00000)


@njit(inline="always")
def _e4m3_f32(b):
    """An F8_E4M3 (``float8_e4m3fn``) byte -> its float32 value, exactly: a normal byte's exponent rebiased (7 ->
    127) and its mantissa moved up; a subnormal one (exponent field 0) as ``m * 2**-9``; 0x7F / 0xFF are NaN (the
    format has no infinity). Selects, no branch: the loop vectorizes."""
    em = np.uint32(b & np.uint8(0x7F))
    sign = np.uint32(b & np.uint8(0x80)) << np.uint32(24)
    sub = _u32(np.float32(em) * _E4M3_SUB)
    bits = sub if em < np.uint32(8) else (em << np.uint32(20)) + np.uint32(120 << 23)
    bits = _F32_QNAN if em == np.uint32(0x7F) else bits
    return _f32(bits | sign)


@njit(inline="always")
def _e5m2_f32(b):
    """An F8_E5M2 byte -> its float32 value, exactly: exponent rebiased (15 -> 127), subnormals ``m * 2**-16``,
    exponent field 31 infinity (mantissa 0) or NaN."""
    em = np.uint32(b & np.uint8(0x7F))
    sign = np.uint32(b & np.uint8(0x80)) << np.uint32(24)
    sub = _u32(np.float32(em) * _E5M2_SUB)
    bits = sub if em < np.uint32(4) else (em << np.uint32(21)) + np.uint32(112 << 23)
    bits = np.uint32(0x7F800000) if em == np.uint32(0x7C) else bits
    bits = _F32_QNAN if em > np.uint32(0x7C) else bits
    return _f32(bits | sign)


@njit(inline="always")
def _row_scales(s, e, bi, bc, cols):
    """The block scales of block row ``bi`` spread over the columns: float32 [cols]."""
    srow = np.empty(cols, np.float32)
    for c in range(cols):
        srow[c] = s[e, bi, c // bc]
    return srow


@njit(nogil=True, cache=True)
def fp8_e4m3_block_decode(w, s, out, br, bc, e, r0, r1):
    cols = w.shape[2]
    srow = _row_scales(s, e, r0 // br, bc, cols)
    for r in range(r0, r1):
        src = w[e, r]
        dst = out[e, r]
        for c in range(cols):
            dst[c] = _bf16_bits(_e4m3_f32(src[c]) * srow[c])


@njit(nogil=True, cache=True)
def fp8_e5m2_block_decode(w, s, out, br, bc, e, r0, r1):
    cols = w.shape[2]
    srow = _row_scales(s, e, r0 // br, bc, cols)
    for r in range(r0, r1):
        src = w[e, r]
        dst = out[e, r]
        for c in range(cols):
            dst[c] = _bf16_bits(_e5m2_f32(src[c]) * srow[c])


@njit(nogil=True, cache=True)
def fp8_block_row_absmax(w, s, out, values, br, bc, e, r0, r1):
    cols = w.shape[2]
    nbc = s.shape[2]
    bi = r0 // br
    lut = np.empty((nbc, 128), np.uint16)  # |decoded value| bits of each magnitude code, per block of the row
    for j in range(nbc):
        sc = s[e, bi, j]
        for b in range(128):
            lut[j, b] = _bf16_bits(values[b] * sc) & np.uint16(0x7FFF)
    for r in range(r0, r1):
        src = w[e, r]
        m = np.uint16(0)
        for j in range(nbc):
            blk = src[j * bc:min(cols, (j + 1) * bc)]
            hi = np.uint8(0)
            lo = np.uint8(127)
            for c in range(blk.shape[0]):  # (over a slice, 8-bit selects: LLVM vectorizes it, 0.1 ns/element)
                v = blk[c] & np.uint8(0x7F)
                hi = v if v > hi else hi
                lo = v if v < lo else lo
            a = max(lut[j, hi], lut[j, lo])
            if a > m:
                m = a
        out[e, r] = m


# --- MXFP4 decode ----------------------------------------------------------------------------------------------------
@njit(nogil=True, cache=True)
def mxfp4_decode(blocks, scales, values, out, e, r0, r1):
    groups = blocks.shape[2]
    for g in range(groups):
        k0 = g * 32
        for r in range(r0, r1):
            t = values[scales[e, r, g]]
            src = blocks[e, r, g]
            for j in range(16):
                b = src[j]
                out[e, k0 + 2 * j, r] = t[b & np.uint8(15)]
                out[e, k0 + 2 * j + 1, r] = t[b >> np.uint8(4)]



_NIB7, _NIB4 = np.uint64(0x7777777777777777), np.uint64(0x4444444444444444)  # per nibble: magnitude, its bit 2
_NIB2, _NIB1 = np.uint64(0x2222222222222222), np.uint64(0x1111111111111111)


@njit(inline="always")
def _keep_top(a, b, bit, shift):
    """One step of the descent in ``mxfp4_row_absmax``: whether a nibble of ``a`` or ``b`` (magnitude codes, 16 a
    word) has ``bit`` set, and if so the two words with only those nibbles kept."""
    ha = a & bit
    hb = b & bit
    hit = (ha | hb) != np.uint64(0)
    a1 = a & ((ha >> shift) * np.uint64(7))  # 7 in each nibble that has the bit, 0 elsewhere (no carry)
    b1 = b & ((hb >> shift) * np.uint64(7))
    return (a1 if hit else a), (b1 if hit else b), hit


@njit(nogil=True, cache=True)
def mxfp4_row_absmax(words, scales, mags, out, e, r0, r1):
    groups = words.shape[2]
    for r in range(r0, r1):
        w = words[e, r]
        s = scales[e, r]
        m = np.uint16(0)
        for g in range(groups):  # a block: two words of 16 nibbles; its largest magnitude code, bit by bit
            a = w[g, 0] & _NIB7
            b = w[g, 1] & _NIB7
            a, b, c2 = _keep_top(a, b, _NIB4, np.uint64(2))
            a, b, c1 = _keep_top(a, b, _NIB2, np.uint64(1))
            c0 = ((a | b) & _NIB1) != np.uint64(0)
            v = mags[s[g], (np.int64(c2) << 2) | (np.int64(c1) << 1) | np.int64(c0)]
            m = v if v > m else m
        out[e, r] = m

"""The CPU paths (``EXPQ_CPU_KERNEL``: the fused numba kernels and the torch reference) give the same bits: the scheme
on every bf16 and fp16 value, the FP8 block decode on every byte with scales that reach every rounding case, the
MXFP4 decode on every (scale, byte) pair, the FP8 and MXFP4 row absmax against the absmax of the decoded values,
and the choice of path itself. The scheme's own exactness tests against
the seed (tests/test_scheme.py) run on each path too (the ``cpu_path`` fixture)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import seed_reference

from expq import cpu_kernels, parallel, scheme
from expq.errors import UsageError
from expq.decoders import LogicalTensor
from expq.decoders.fp8_block import Fp8BlockDecoder
from expq.decoders import mxfp4
from expq.decoders.mxfp4 import Mxfp4Decoder, dequantize
from expq.io.safetensors import TensorInfo


def every_value_rows(dtype: torch.dtype, amax: float) -> torch.Tensor:
    """Every finite value of a 16-bit dtype with magnitude <= ``amax`` as the elements of rows whose first element
    is ``amax`` (so the row's scale is ``amax``'s and every quotient up to 127 is taken), 255 values a row."""
    vals = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    vals = vals[torch.isfinite(vals) & (vals.abs() <= amax)]
    pad = -len(vals) % 255
    vals = torch.cat([vals, torch.zeros(pad, dtype=dtype)]).view(-1, 255)
    return torch.cat([torch.full((vals.shape[0], 1), amax, dtype=dtype), vals], dim=1).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amax", [1.0, 3.0e-3, 6.0e-5, 7.0e-6, 6.0e4])
def test_scheme_on_every_half_value(dtype, amax, cpu_path):
    """Each path on every value of the dtype (normal, subnormal, signed zeros) against the seed, bit for bit; fp16
    rows with amax 6e-5 and 7e-6 get subnormal scales, 6e4 quotients near fp16's top."""
    if dtype == torch.bfloat16 and amax == 6.0e4:
        amax = 3.0e38
    w = every_value_rows(dtype, amax)
    codes, scales, rep = scheme.quantize_matrix(w)
    ref_codes, ref_scales = seed_reference(w)
    assert torch.equal(scales, ref_scales)
    ok = ref_scales != 0
    assert torch.equal(codes[ok], ref_codes[ok])
    assert not ok.any() or rep.zero_rows == []


def test_paths_agree_on_special_rows_bit_for_bit():
    """The two paths give identical codes, scales (canonical NaN included) and reports on zero, -0.0, NaN, -NaN,
    +-inf and subnormal-scale rows, in every compute dtype (a negative control for the fixture: the paths differ
    in how they compute, not in what)."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(40, 300, generator=g) * torch.logspace(-9, 2, 40).unsqueeze(1)).to(dtype)
        w[3], w[5] = 0, -0.0
        w[7, 3], w[9, 1], w[11], w[13, 2] = float("nan"), float("inf"), float("-inf"), -float("nan")
        got = {}
        for path in ("torch", "numba"):
            with pytest.MonkeyPatch.context() as m:
                m.setenv(cpu_kernels.ENV, path)
                if path == "numba":
                    pytest.importorskip("numba")
                got[path] = scheme.quantize_matrix(w)
        (c0, s0, r0), (c1, s1, r1) = got["torch"], got["numba"]
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(c0, c1) and torch.equal(s0.view(bits), s1.view(bits)), dtype
        assert (r0.zero_rows, r0.underflow_rows, r0.nonfinite_rows) == (r1.zero_rows, r1.underflow_rows,
                                                                           r1.nonfinite_rows)


def _info(name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    n = 1
    for d in shape:
        n *= d
    size = {"F8_E4M3": 1, "F8_E5M2": 1, "F32": 4, "U8": 1}[dtype] * n
    return TensorInfo(name=name, file="f.safetensors", dtype=dtype, shape=shape, start=0, end=size)


def fp8_case(fp8: torch.dtype, block: tuple[int, int] | None, shape: tuple[int, ...], seed: int = 0):
    """Every FP8 byte (NaN codes included) spread over a weight of ``shape``, with block scales from 1e-40
    (products underflow to bf16 subnormals) to 1e38 (they overflow), negative, zero, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    codes = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    codes = codes[torch.randperm(n, generator=g)].view(fp8).view(shape)
    if block is None:
        s = torch.tensor([0.37], dtype=torch.float32)
    else:
        *lead, rows, cols = shape
        sshape = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        m = 1
        for d in sshape:
            m *= d
        s = torch.logspace(-40, 38, m, dtype=torch.float64).to(torch.float32)[torch.randperm(m, generator=g)]
        s[:4] = torch.tensor([-0.5, 0.0, float("nan"), float("inf")])
        s = s.view(sshape)
    return codes, s


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("block,shape", [((128, 128), (300, 520)), ((16, 8), (3, 70, 50)), (None, (33, 65)),
                                         ((4, 4), (64, 64))])
@pytest.mark.parametrize("pooled", [False, True])
def test_fp8_decode_paths_agree_bit_for_bit(fp8, block, shape, pooled, monkeypatch):
    """The fused FP8 decode equals the torch reference (``float32(code) * scale`` rounded once to bf16) on every byte
    and every kind of scale, with partial edge blocks, stacked experts and per-tensor scales; NaN products are the
    canonical quiet NaN on both paths. Bands over a thread pool give the same bits."""
    pytest.importorskip("numba")
    codes, s = fp8_case(fp8, block, shape)
    dec = Fp8BlockDecoder(block)
    wi = _info("m.weight", {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[fp8], tuple(codes.shape))
    si = _info("m.weight_scale_inv", "F32", tuple(s.shape))
    lt = LogicalTensor("m.weight", "BF16", tuple(codes.shape), (wi, si), decoded=True)
    parts = {wi: codes, si: s}
    out = {}
    with ThreadPoolExecutor(2) as pool, parallel.using(pool if pooled else None):
        for path in ("torch", "numba"):
            monkeypatch.setenv(cpu_kernels.ENV, path)
            out[path] = dec.decode(lt, parts.__getitem__)
    ref = codes.to(torch.float32) * (s.view(1, 1).expand(codes.shape) if block is None else
                                     s.repeat_interleave(block[0], -2)[..., : shape[-2], :]
                                     .repeat_interleave(block[1], -1)[..., : shape[-1]])
    ref = ref.to(torch.bfloat16)
    for path, got in out.items():
        assert got.dtype == torch.bfloat16 and got.shape == codes.shape
        nan = torch.isnan(got)
        assert torch.equal(nan, torch.isnan(ref)), path
        assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16)), path
        assert (got[nan].view(torch.int16) == 0x7FC0).all(), path
    assert torch.equal(out["torch"].view(torch.int16), out["numba"].view(torch.int16))


def narrow_blocks_case(fp8: torch.dtype, block: tuple[int, int] | None, shape: tuple[int, ...], seed: int = 0):
    """FP8 codes whose magnitudes span a random range per (row, block) (a single code, ranges from code 0, ranges
    up to the NaN and inf codes, and everything between; random signs), with scales that are mostly special:
    0, -0, +-inf, NaN, negative, 1e-40 and 1e38, so that every (largest code, smallest code, scale) case of the
    row absmax comes up."""
    g = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    br, bc = block if block is not None else (rows, cols)
    nbc = -(-cols // bc)
    lo = torch.randint(0, 128, (*lead, rows, nbc), generator=g)
    lo[torch.rand(lo.shape, generator=g) < 0.3] = 0
    width = (torch.rand(lo.shape, generator=g) * (128 - lo)).floor().long()
    width[torch.rand(lo.shape, generator=g) < 0.2] = 0
    hi_top = torch.rand(lo.shape, generator=g) < 0.2  # up to the top codes (inf, NaN)
    width[hi_top] = 127 - lo[hi_top]
    lo_e = lo.repeat_interleave(bc, -1)[..., :cols]
    w_e = width.repeat_interleave(bc, -1)[..., :cols]
    mag = lo_e + (torch.rand(lo_e.shape, generator=g) * (w_e + 1)).floor().long().clamp(max=w_e)
    sign = (torch.rand(mag.shape, generator=g) < 0.5).long() << 7
    codes = (mag | sign).to(torch.uint8).view(fp8)
    sshape = (1,) if block is None else (*lead, -(-rows // br), nbc)
    s = torch.logspace(-3, 3, math.prod(sshape), dtype=torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -0.5, 1e-40, 1e38])
    pick = torch.randint(0, len(special), s.shape, generator=g)
    s = torch.where(torch.rand(s.shape, generator=g) < 0.3, special[pick], s).view(sshape)
    return codes, s


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("block,shape", [((128, 128), (300, 520)), ((16, 8), (3, 70, 50)), (None, (33, 65)),
                                         ((4, 4), (64, 64)), ((2, 3), (5, 40, 31)), ((2, 64), (3, 2000, 50))])
@pytest.mark.parametrize("case", ["every byte", "narrow blocks"])
@pytest.mark.parametrize("pooled", [False, True])
def test_fp8_row_absmax_is_the_decoded_rows_absmax(fp8, block, shape, case, pooled, monkeypatch):
    """``Fp8BlockDecoder.row_absmax`` (the experts-int8 front pass's scales of an FP8 source: the largest and the
    smallest magnitude code of each block looked up, no decoded tensor) equals the largest magnitude of each
    decoded row, bit for bit (NaN canonical, -0 as +0), on every byte and every kind of scale; None on the torch
    path, where the caller decodes."""
    pytest.importorskip("numba")
    codes, s = (fp8_case if case == "every byte" else narrow_blocks_case)(fp8, block, shape)
    dec = Fp8BlockDecoder(block)
    wi = _info("m.weight", {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[fp8], tuple(codes.shape))
    si = _info("m.weight_scale_inv", "F32", tuple(s.shape))
    lt = LogicalTensor("m.weight", "BF16", tuple(codes.shape), (wi, si), decoded=True)
    parts = {wi: codes, si: s}
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert dec.row_absmax(lt, parts.__getitem__) is None
    decoded = dec.decode(lt, parts.__getitem__)  # the torch reference decode
    ref = (decoded.view(torch.int16) & 0x7FFF).amax(dim=-1, keepdim=True)
    monkeypatch.setenv(cpu_kernels.ENV, "numba")
    with ThreadPoolExecutor(2) as pool, parallel.using(pool if pooled else None):
        got = dec.row_absmax(lt, parts.__getitem__)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 1)
    assert torch.equal(got.view(torch.int16), ref)
    kinds = {"nan": bool(torch.isnan(got).any()), "inf": bool(torch.isinf(got).any()),
             "zero": bool((got == 0).any()), "finite": bool((torch.isfinite(got) & (got > 0)).any())}
    if block is not None and block[1] >= shape[-1]:  # one block a row: each row is one (codes, scale) case
        assert all(kinds.values()), kinds  # the data reach every kind of row


def test_mxfp4_decode_paths_agree_on_every_scale_and_byte(monkeypatch):
    """Every (scale byte, block byte) pair through both MXFP4 paths, in a shape with several experts and a row count
    that is not a multiple of the kernel's tile: the same bits (zeros, subnormals, infinities from scales >= 252)."""
    pytest.importorskip("numba")
    E, R, G = 2, 300, 4
    g = torch.Generator().manual_seed(0)
    pairs = torch.arange(E * R * G * 16, dtype=torch.int64)
    blocks = pairs.remainder(256).to(torch.uint8)[torch.randperm(pairs.numel(), generator=g)].view(E, R, G, 16)
    scales = torch.arange(E * R * G, dtype=torch.int64).remainder(256).to(torch.uint8).view(E, R, G)
    out = {}
    for path in ("torch", "numba"):
        monkeypatch.setenv(cpu_kernels.ENV, path)
        out[path] = dequantize(blocks, scales)
    assert torch.equal(out["torch"].view(torch.int16), out["numba"].view(torch.int16))
    assert out["numba"].shape == (E, G * 32, R)


def mxfp4_narrow_case(E: int, R: int, G: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks and scales whose absmax tells every (scale, largest magnitude code) pair apart: block ``i`` has
    scale ``i % 256`` and largest magnitude code ``(i // 256) % 8`` at one random nibble (either half of any byte),
    its other nibbles random codes up to it, signs random (so -0.0 codes too); every seventh row is all (signed)
    zeros at a random scale. Both blocks and scales shuffled over the rows."""
    g = torch.Generator().manual_seed(seed)
    n = E * R * G
    i = torch.randperm(n, generator=g)
    s, top = (i % 256).to(torch.uint8), (i // 256) % 8
    mags = (torch.rand(n, 32, generator=g) * (top.unsqueeze(1) + 1)).floor().long().clamp(max=top.unsqueeze(1))
    mags[torch.arange(n), torch.randint(0, 32, (n,), generator=g)] = top
    mags.view(E, R, G, 32)[:, ::7] = 0
    nib = mags | (torch.randint(0, 2, mags.shape, generator=g) << 3)
    blocks = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).view(E, R, G, 16)
    return blocks.contiguous(), s.view(E, R, G).contiguous()


def mxfp4_every_byte_case(E: int, R: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (scale, block byte) pair (as ``test_mxfp4_decode_paths_agree_on_every_scale_and_byte``)."""
    g = torch.Generator().manual_seed(0)
    pairs = torch.arange(E * R * G * 16, dtype=torch.int64)
    blocks = pairs.remainder(256).to(torch.uint8)[torch.randperm(pairs.numel(), generator=g)].view(E, R, G, 16)
    return blocks, torch.arange(E * R * G, dtype=torch.int64).remainder(256).to(torch.uint8).view(E, R, G)


@pytest.mark.parametrize("case,shape", [("narrow blocks", (2, 300, 4)), ("narrow blocks", (3, 50, 90)),
                                        ("narrow blocks", (1, 2048, 1)), ("every byte", (2, 300, 4))])
@pytest.mark.parametrize("pooled", [False, True])
def test_mxfp4_row_absmax_is_the_decoded_absmax(case, shape, pooled, monkeypatch):
    """``Mxfp4Decoder.row_absmax`` over dimension -2 (the experts-int8 front pass's scales of an MXFP4 source: each
    block's largest magnitude code looked up for its scale, from one read of the packed bytes) equals the largest
    magnitude of the decoded ``[E, in, out]`` values over their input dimension, bit for bit (-0.0 as +0.0), at
    every scale byte 0..255 (subnormal and infinite values) with every largest code, in tiles over the pool; None
    over dimension -1 and on the torch path, where the caller decodes."""
    pytest.importorskip("numba")
    E, R, G = shape
    blocks, scales = (mxfp4_narrow_case if case == "narrow blocks" else mxfp4_every_byte_case)(E, R, G)
    bi, si = _info("m_blocks", "U8", tuple(blocks.shape)), _info("m_scales", "U8", tuple(scales.shape))
    lt = LogicalTensor("m", "BF16", (E, G * 32, R), (bi, si), decoded=True)
    parts, dec = {bi: blocks, si: scales}, Mxfp4Decoder({"quant_method": "mxfp4"})
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert dec.row_absmax(lt, parts.__getitem__, -2) is None
    decoded = dec.decode(lt, parts.__getitem__)  # the torch reference decode
    ref = (decoded.view(torch.int16) & 0x7FFF).amax(dim=-2, keepdim=True)
    monkeypatch.setenv(cpu_kernels.ENV, "numba")
    assert dec.row_absmax(lt, parts.__getitem__) is None  # over dimension -1: not offered
    monkeypatch.setattr(mxfp4, "CHUNK_BYTES", 7 * G * 16)  # tiles of 7 rows
    with ThreadPoolExecutor(2) as pool, parallel.using(pool if pooled else None):
        got = dec.row_absmax(lt, parts.__getitem__, -2)
    assert got.dtype == torch.bfloat16 and got.shape == (E, 1, R)
    assert torch.equal(got.view(torch.int16), ref)
    if G == 1:  # one block a row: each (scale, largest code) pair is one row; the data reach every kind of row
        assert torch.isinf(got).any() and (got == 0).any() and ((got > 0) & (got < 2.0 ** -126)).any()
        assert len({(int(s), int(a)) for s, a in zip(scales.view(-1), got.view(torch.int16).view(-1))}) > 256 * 7


def test_kernel_choice(monkeypatch):
    """``EXPQ_CPU_KERNEL``: auto picks numba where it imports; torch forces the reference; anything else is refused
    with the allowed values."""
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    assert cpu_kernels.active() == "torch"
    monkeypatch.setenv(cpu_kernels.ENV, "auto")
    try:
        import numba  # noqa: F401
        assert cpu_kernels.active() == "numba"
    except ImportError:
        assert cpu_kernels.active() == "torch"
    monkeypatch.setenv(cpu_kernels.ENV, "fast")
    with pytest.raises(UsageError, match="auto, numba, torch"):
        cpu_kernels.active()

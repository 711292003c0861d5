"""The experts_int8 arithmetic against a literal reference of vLLM's function: bit for bit, random and adversarial."""

from __future__ import annotations

import pytest
import torch
from helpers import seed_reference

from expq import scheme

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def adversarial_rows(dtype: torch.dtype, cols: int = 96) -> torch.Tensor:
    """Rows built to hit the arithmetic's edges: exact ties at k + 0.5 steps, a single outlier, all-equal values,
    a negative absmax, values straddling half steps, huge and tiny magnitudes, zeros."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for s in (2.0**-7, 2.0**-3, 0.37, 3.0):
        steps = torch.arange(-127, 128, dtype=torch.float64)[: cols - 1] + 0.5  # ties everywhere
        rows.append(torch.cat([torch.tensor([127.0]), steps]) * s)
        rows.append(torch.cat([torch.tensor([-127.0]), -steps]) * s)  # negative absmax
    r = torch.randn(cols, generator=g, dtype=torch.float64) * 0.01
    r[7] = 5.0  # one outlier: everything else rounds to 0 or +-1
    rows.append(r)
    rows.append(torch.full((cols,), 0.123, dtype=torch.float64))  # all equal: every code 127
    edge = torch.linspace(-1, 1, cols, dtype=torch.float64)
    rows.append(edge)
    rows.append(edge * 1e4 if dtype != torch.float16 else edge * 6e4)  # large
    rows.append(edge * 1e-3)
    rows.append(torch.randn(cols, generator=g, dtype=torch.float64) * 0.02)
    w = torch.stack(rows).to(dtype)
    # values exactly halfway between two representable quotients after the first rounding
    return w


def random_rows(dtype, rows=512, cols=384, seed=0, low=-3):
    """Gaussian rows with magnitudes from 10**low to 10 (fp16 rows below ~1e-2 get subnormal scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(low, 1, rows).unsqueeze(1)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_golden_half_types(dtype, kind, cpu_path):
    w = random_rows(dtype) if kind == "random" else adversarial_rows(dtype)
    ref_codes, ref_scales = seed_reference(w)
    for codes, scales in (scheme.quantize_rows(w), scheme.quantize_matrix(w)[:2]):
        assert codes.dtype == torch.int8 and scales.dtype == dtype
        assert torch.equal(codes, ref_codes), f"{(codes != ref_codes).sum()} codes differ"
        assert torch.equal(scales, ref_scales)
    assert torch.equal(scheme.matrix_scales(w), ref_scales)


@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_golden_float32_follows_cuda(kind, cpu_path):
    """fp32: CUDA computes `x / 127` as `x * fp32(1/127)`; the CPU divides. expq follows CUDA on every device."""
    w = random_rows(torch.float32, rows=4096) if kind == "random" else adversarial_rows(torch.float32)
    ref_codes, ref_scales = seed_reference(w, cuda_scalar_rule=True)
    for codes, scales in (scheme.quantize_rows(w), scheme.quantize_matrix(w)[:2]):
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scales, ref_scales)


def test_float32_cpu_division_differs():
    """Negative control: the literal seed on a CPU (true division) gives other fp32 scales for some rows, which is
    why the CUDA rule above matters."""
    w = random_rows(torch.float32, rows=4096)
    _, cpu_scales = seed_reference(w)
    _, scales = scheme.quantize_rows(w)
    assert (cpu_scales != scales).sum() > 0


def test_double_rounding_is_kept():
    """Negative control: dividing in fp32 and rounding once (not the seed's arithmetic) changes a few percent of
    bf16 codes, so the golden test above can tell the two apart."""
    w = random_rows(torch.bfloat16, rows=1024)
    codes, scales = scheme.quantize_rows(w)
    once = (w.float() / scales.float().unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
    frac = (once != codes).float().mean().item()
    assert frac > 0.005, frac


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(dtype, cpu_path):
    w = random_rows(dtype, rows=8, cols=32, low=-1)
    w[3] = 0
    codes, scales, rep = scheme.quantize_matrix(w)
    assert rep.zero_rows == [3] and rep.nonfinite_rows == [] and rep.underflow_rows == []
    assert scales[3].item() == scheme.ZERO_ROW_SCALE == 0.0 and torch.isfinite(scales).all()
    assert torch.equal(codes[3], torch.zeros(32, dtype=torch.int8))
    deq = scheme.dequantize_rows(codes, scales)
    assert torch.equal(deq[3], torch.zeros(32))  # exactly 0, not -0 or NaN
    assert not torch.signbit(deq[3]).any()
    ref_codes, ref_scales = seed_reference(w, cuda_scalar_rule=dtype == torch.float32)
    assert torch.equal(scales, ref_scales)
    # the seed's NaN (0/0) codes become 0 through vLLM's cast; everything else equal
    assert torch.equal(codes[torch.arange(8) != 3], ref_codes[torch.arange(8) != 3])


def test_fp16_underflow_reported_and_exact(cpu_path):
    w = random_rows(torch.float16, rows=6, cols=64, low=-1)
    w[1] = (torch.randn(64) * 1e-6).to(torch.float16)  # amax ~ 3e-6: scale underflows to 0 / subnormal
    w[4, :] = 0
    w[4, 5] = 7e-6
    codes, scales, rep = scheme.quantize_matrix(w)
    assert rep.underflow_rows == [1, 4]
    ref_codes, ref_scales = seed_reference(w)
    assert torch.equal(scales, ref_scales)
    keep = torch.tensor([i not in (1, 4) or True for i in range(6)])
    # rows whose scale is exactly 0 give 0/0 NaN for zero elements -> code 0 via the cast; compare the rest
    nan_free = ~torch.isnan((w.float() / ref_scales.float().unsqueeze(1)))
    assert torch.equal(codes[nan_free & keep.unsqueeze(1)], ref_codes[nan_free & keep.unsqueeze(1)])


def test_nonfinite_rows_found(cpu_path):
    w = random_rows(torch.bfloat16, rows=5, cols=16)
    w[2, 3] = float("nan")
    w[4, 0] = float("inf")
    _, _, rep = scheme.quantize_matrix(w)
    assert rep.nonfinite_rows == [2, 4]


def test_codes_range_and_error_bound():
    w = random_rows(torch.bfloat16)
    codes, scales = scheme.quantize_rows(w)
    assert codes.min() >= -127 and codes.max() <= 127
    # each row's absmax maps to 127, or 126 where the scale rounded up in bf16 (amax / scale = 126.6)
    assert ((codes.abs().amax(dim=1) == 127) | (codes.abs().amax(dim=1) == 126)).all()
    err = (scheme.dequantize_rows(codes, scales) - w.float()).abs()
    # within half a step of the scale, plus the bf16 rounding of w / scale (relative 2^-8 of up to 127 steps)
    bound = scales.float().unsqueeze(1) * (0.5 + 127 * 2.0**-8)
    assert (err <= bound).all()


@pytest.mark.parametrize("config_dtype,requested,expected", [
    ("bfloat16", "auto", torch.bfloat16), ("float16", "auto", torch.float16), ("float32", "auto", torch.bfloat16),
    (None, "auto", torch.bfloat16), ("bfloat16", "float32", torch.float32), ("float32", "fp16", torch.float16),
])
def test_compute_dtype_rule(config_dtype, requested, expected):
    assert scheme.resolve_compute_dtype(config_dtype, requested)[0] == expected


def test_compute_dtype_rejects():
    with pytest.raises(ValueError, match="unknown --dtype"):
        scheme.resolve_compute_dtype("bfloat16", "int8")
    with pytest.raises(ValueError, match="pass --dtype"):
        scheme.resolve_compute_dtype("float8_e4m3fn", "auto")


@pytest.mark.parametrize("cols", [1001, 1024, 3, 4])
def test_packing_equals_the_library_word_for_word(cols):
    """expq writes the words as byte views of the codes (``pack_codes``); they equal compressed-tensors'
    ``pack_to_int32`` exactly, with and without a padded last word, and the format returns complete tensors per
    matrix (a batch of two matrices here; weight_shape is a plan-time value), which the library unpacks back."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from expq.experts import Matrix
    from expq.formats.compressed_tensors import CompressedTensorsFormat, pack_codes

    fmt = CompressedTensorsFormat(None, torch.bfloat16)  # encode/decode need no expert map
    codes = torch.randint(-127, 128, (1100, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    codes[0, :] = -127
    codes[1, :] = 127
    whole = pack_to_int32(codes, 8)
    assert torch.equal(pack_codes(codes.clone()), whole)
    scales = torch.rand(1100, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    mats = [Matrix(0, 0, "gate", "m.a", 700, cols), Matrix(0, 0, "up", "m.b", 400, cols)]
    specs = fmt.tensor_specs(mats[0])
    assert [(s.name, s.value) for s in specs] == [("m.a.weight_packed", None), ("m.a.weight_scale", None),
                                                   ("m.a.weight_shape", torch.tensor([700, cols]).numpy().tobytes())]
    (a, b) = fmt.encode(codes.clone(), scales, mats)
    tensors = {spec.name: t for spec, t in a + b}
    assert [spec.name for spec, _ in a] == ["m.a.weight_packed", "m.a.weight_scale"]
    assert torch.equal(tensors["m.a.weight_packed"], whole[:700]) and torch.equal(tensors["m.b.weight_packed"], whole[700:])
    assert tensors["m.a.weight_scale"].shape == (700, 1)
    for (spec, t) in a + b:
        assert (t.dtype, tuple(t.shape)) == ({"I32": torch.int32, "BF16": torch.bfloat16}[spec.dtype], spec.shape)
    tensors["m.a.weight_shape"] = torch.frombuffer(bytearray(specs[2].value), dtype=torch.int64)
    back, s = fmt.decode("m.a", tensors.__getitem__)
    assert torch.equal(back, codes[:700]) and torch.equal(s, scales[:700])
    assert torch.equal(back, unpack_from_int32(whole[:700], 8, torch.Size([700, cols])))


def with_special_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` with row 3 all zero, row 5 all -0.0, a NaN in rows 7 and 13 (-NaN), +inf in row 9, row 11 all -inf."""
    w[3] = 0
    w[5] = -0.0
    w[7, 3] = float("nan")
    w[9, 1] = float("inf")
    w[11, :] = float("-inf")
    w[13, 2] = -float("nan")
    return w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 1, 7 * 96, 10**9])
def test_quantize_matrix_in_row_blocks_is_bit_identical(dtype, block, cpu_path):
    """``quantize_matrix`` (row blocks on a CPU) equals the reference on the whole matrix, bit for bit, whatever the
    block size, including zero, -0.0, NaN, +-inf and underflowing rows (NaN scales stored canonical)."""
    w = with_special_rows(torch.cat([adversarial_rows(dtype), random_rows(dtype, rows=300, cols=96, low=-8)]))
    codes, scales, rep = scheme.quantize_matrix(w, block)
    ref_c, ref_s = seed_reference(w, cuda_scalar_rule=True)
    ok = torch.isfinite(w).all(dim=1) & (w.abs().amax(dim=1) > 0)  # the seed's cast of NaN (0/0) is undefined
    assert torch.equal(codes[ok], ref_c[ok]) and torch.equal(scales[ok], ref_s[ok])
    assert torch.equal(codes[3], torch.zeros_like(codes[3])) and torch.equal(codes[5], codes[3])
    assert torch.equal(codes[~ok], torch.zeros_like(codes[~ok]))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan_bits = scales[torch.isnan(scales)].view(bits).unique().tolist()
    assert nan_bits == [{torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}[dtype]]
    assert rep.nonfinite_rows == [7, 9, 11, 13] and {3, 5} <= set(rep.zero_rows)
    assert scales[5].view(bits).item() == 0  # +0.0, as amax(|w|) gives


def test_quantization_config_is_what_compressed_tensors_dumps(tmp_path_factory):
    """The format writes its quantization_config literally (the library's import costs seconds); it must equal what
    compressed-tensors' own classes dump for the same scheme, targets and ignore list, key for key."""
    import json

    import compressed_tensors
    from compressed_tensors.base import (COMPRESSION_VERSION_NAME, QUANTIZATION_METHOD, QUANTIZATION_METHOD_NAME,
                                         SPARSITY_CONFIG_NAME, TRANSFORM_CONFIG_NAME)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from helpers import example

    from expq.plan import make_plan
    from expq.source import open_source

    plan = make_plan(open_source(example(tmp_path_factory, "mixtral")))
    fmt = plan.format
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=-1,
                               dynamic=False)
    scheme_ = QuantizationScheme(targets=fmt.targets(), weights=weights, format="pack-quantized")
    qc = QuantizationConfig(config_groups={"group_0": scheme_}, format="pack-quantized",
                            quantization_status="compressed", ignore=fmt.ignore(plan.source.logical))
    library = {COMPRESSION_VERSION_NAME: compressed_tensors.__version__, QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
               SPARSITY_CONFIG_NAME: {}, TRANSFORM_CONFIG_NAME: {},
               **qc.model_dump(mode="json", exclude={"quant_method"})}
    ours = plan.quantization_config()
    assert json.dumps(ours, sort_keys=True) == json.dumps(library, sort_keys=True)

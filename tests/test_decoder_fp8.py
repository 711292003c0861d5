"""The FP8 block-scale source decoder against a literal reference of DeepSeek's own conversion (``vendor_dequant``
in ``fp8_fixture.py``: one block at a time, fp32 product of code and block scale, stored to bf16)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import expq
from expq.decoders import PlainDecoder, detect
from expq.decoders.fp8_block import Fp8BlockDecoder
from expq.errors import SourceError
from expq.io.safetensors import read_header, read_tensor
from expq.source import open_source

from fp8_fixture import make_fp8_deepseek, vendor_dequant
from helpers import example

# quantization_config blocks as published in each repo's config.json. DeepSeek-V3's is the one its README_WEIGHTS.md
# documents; MiniMax-M2's and DeepSeek-V3.1/V3.2's (scale_fmt) as quoted verbatim by public code that reads them;
# Kimi-K2-Instruct and Qwen3-30B-A3B-FP8 ship DeepSeek's block; Qwen3.5/3.6 FP8 add modules_to_not_convert.
PUBLISHED = {
    "deepseek-ai/DeepSeek-V3, DeepSeek-R1, moonshotai/Kimi-K2-Instruct, Qwen/Qwen3-30B-A3B-FP8":
        {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    "deepseek-ai/DeepSeek-V3.1, DeepSeek-V3.2":
        {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]},
    "MiniMaxAI/MiniMax-M2":
        {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
         "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
    "Qwen3.5/3.6-*-FP8 style (modules_to_not_convert)":
        {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["lm_head", "model.embed_tokens"]},
    "SGLang/vLLM style (ignored_layers)":
        {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
         "ignored_layers": ["lm_head"]},
}


def _fp8_values(shape: tuple[int, ...], seed: int, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Random FP8 codes spread over many binades (so that products need all of fp32's and bf16's bits)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-6, 6, shape, generator=g)).to(dtype)


def _scales(shape: tuple[int, ...], seed: int, dtype=torch.float32) -> torch.Tensor:
    """Distinct, positive, full-mantissa fp32 scales, one per block."""
    g = torch.Generator().manual_seed(seed + 1000)
    s = (torch.rand(shape, generator=g) + 0.5) * 2.0 ** torch.randint(-12, -4, shape, generator=g)
    assert s.unique().numel() == s.numel()
    return s.to(dtype)


def _write_checkpoint(root: Path, shards: dict[str, dict[str, torch.Tensor]], qc: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f, ts in shards.items():
        save_file(ts, str(root / f))
        weight_map.update(dict.fromkeys(ts, f))
    if len(shards) > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = {"model_type": "deepseek_v3"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def _decode_all(root: Path):
    src = open_source(root)
    dec = detect(src.config, src.tensors)
    logical = dec.logical_tensors(src.tensors)
    return dec, logical, {n: dec.decode(lt, lambda ti: read_tensor(root, ti)) for n, lt in logical.items()
                          if lt.decoded}


# --- bit-exact against the vendor arithmetic --------------------------------------------------------------------
@pytest.mark.parametrize("shape,block,fp8", [
    ((300, 200), (128, 128), torch.float8_e4m3fn),  # edge blocks 44 rows, 72 columns
    ((300, 200), (64, 32), torch.float8_e4m3fn),    # non-square block, edge blocks 44 x 8
    ((97, 130), (128, 128), torch.float8_e4m3fn),   # smaller than one block in rows
    ((300, 200), (128, 128), torch.float8_e5m2),
    ((129, 65), (32, 64), torch.float8_e5m2),
])
def test_decode_matches_vendor_bit_for_bit(tmp_path, shape, block, fp8):
    br, bc = block
    w = _fp8_values(shape, seed=shape[0] + br, dtype=fp8)
    s = _scales((math.ceil(shape[0] / br), math.ceil(shape[1] / bc)), seed=shape[1] + bc)
    root = _write_checkpoint(tmp_path / "ck", {"model.safetensors": {
        "x.weight": w, "x.weight_scale_inv": s, "x.bias": torch.randn(shape[0]).to(torch.bfloat16)}},
        {"quant_method": "fp8", "weight_block_size": list(block)})
    dec, logical, got = _decode_all(root)
    assert isinstance(dec, Fp8BlockDecoder) and dec.block == block
    lt = logical["x.weight"]
    assert (lt.dtype, lt.shape, lt.decoded) == ("BF16", shape, True)
    assert [p.name for p in lt.parts] == ["x.weight", "x.weight_scale_inv"]
    assert lt.how == f"fp8 {'e4m3' if fp8 == torch.float8_e4m3fn else 'e5m2'} x {br}x{bc} block scale_inv -> bf16"
    assert set(logical) == {"x.weight", "x.bias"} and not logical["x.bias"].decoded
    out = got["x.weight"]
    ref = vendor_dequant(w, s, br, bc)
    assert out.dtype == torch.bfloat16 and out.shape == shape
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))  # bit for bit (NaN-safe)
    # element by element, by hand, at the corners of the edge blocks
    corners = [(0, 0), (br - 1, bc - 1), (br, bc), (shape[0] - 1, shape[1] - 1), (shape[0] - 1, 0)]
    for r, c in [(min(r, shape[0] - 1), min(c, shape[1] - 1)) for r, c in corners]:
        want = (w[r, c].to(torch.float32) * s[r // br, c // bc]).to(torch.bfloat16)
        assert out[r, c].view(torch.int16) == want.view(torch.int16), (r, c)


def test_the_data_tells_the_wrong_arithmetics_apart():
    """Negative control for the test above: on the same data, dividing by the scale, rounding the scale to bf16
    first, multiplying in bf16, or taking the scale of the transposed block each give different bits."""
    shape, br, bc = (300, 200), 64, 32
    w = _fp8_values(shape, seed=shape[0] + br)
    s = _scales((math.ceil(shape[0] / br), math.ceil(shape[1] / bc)), seed=shape[1] + bc)
    ref = vendor_dequant(w, s, br, bc)
    full = s.repeat_interleave(br, 0)[:shape[0]].repeat_interleave(bc, 1)[:, :shape[1]]
    wrong = {
        "divide": (w.float() / full).to(torch.bfloat16),
        "scale rounded to bf16 first": (w.float() * full.to(torch.bfloat16).float()).to(torch.bfloat16),
        "product in bf16": w.to(torch.bfloat16) * full.to(torch.bfloat16),
        "product rounded to fp16, then bf16": (w.float() * full).to(torch.float16).to(torch.bfloat16),
        "floor-sized blocks": (w.float() * torch.nn.functional.interpolate(
            s[None, None], size=shape, mode="nearest")[0, 0]).to(torch.bfloat16),
    }
    for what, t in wrong.items():
        assert not torch.equal(t, ref), what


def test_per_tensor_scale(tmp_path):
    w1, w2 = _fp8_values((40, 24), 3), _fp8_values((8, 16), 4, torch.float8_e5m2)
    s1, s2 = torch.tensor(0.0123456789), torch.tensor([3.3e-3])
    root = _write_checkpoint(tmp_path / "ck", {"model.safetensors": {
        "a.weight": w1, "a.weight_scale_inv": s1, "b.weight": w2, "b.weight_scale": s2}},
        {"quant_method": "fp8", "activation_scheme": "dynamic"})
    dec, logical, got = _decode_all(root)
    assert dec.block is None and set(logical) == {"a.weight", "b.weight"}
    assert logical["a.weight"].how == "fp8 e4m3 x per-tensor scale -> bf16"
    assert torch.equal(got["a.weight"], vendor_dequant(w1, s1.reshape(1, 1), 40, 24))
    assert torch.equal(got["b.weight"], vendor_dequant(w2, s2.reshape(1, 1), 8, 16))


def test_scales_in_another_shard_and_3d(tmp_path):
    """Scales stored in a different file from their weight (as DeepSeek's shards do), found through the index; a
    fused 3-D expert tensor [E, rows, cols] with scales [E, ceil(rows/br), ceil(cols/bc)]."""
    br, bc = 16, 32
    a, b = _fp8_values((40, 70), 10), _fp8_values((3, 33, 64), 11)
    sa, sb = _scales((3, 3), 10), _scales((3, 3, 2), 11, torch.bfloat16)
    root = _write_checkpoint(tmp_path / "ck", {
        "model-00001-of-00002.safetensors": {"a.weight": a, "b.weight_scale_inv": sb, "norm.weight": torch.ones(4)},
        "model-00002-of-00002.safetensors": {"b.weight": b, "a.weight_scale_inv": sa}},
        {"quant_method": "fp8", "weight_block_size": [br, bc]})
    dec, logical, got = _decode_all(root)
    assert logical["a.weight"].parts[0].file != logical["a.weight"].parts[1].file
    stored = list(open_source(root).tensors)  # shard by shard, in byte order
    assert list(logical) == [n for n in stored if n in ("a.weight", "norm.weight", "b.weight")]
    assert torch.equal(got["a.weight"], vendor_dequant(a, sa, br, bc))
    for e in range(3):
        assert torch.equal(got["b.weight"][e], vendor_dequant(b[e], sb[e], br, bc)), e


def test_decode_in_bands_equals_one_pass(tmp_path, monkeypatch):
    """The bounded-memory path (many bands of block rows) gives the same bits as one band."""
    import expq.decoders.fp8_block as mod
    w, s = _fp8_values((300, 200), 5), _scales((10, 7), 5)
    root = _write_checkpoint(tmp_path / "ck", {"model.safetensors": {"x.weight": w, "x.weight_scale_inv": s}},
                             {"quant_method": "fp8", "weight_block_size": [32, 32]})
    monkeypatch.setattr(mod, "BAND_BYTES", 1)  # one block row (32 rows) per band
    _, _, got = _decode_all(root)
    assert torch.equal(got["x.weight"], vendor_dequant(w, s, 32, 32))


# --- errors: one line, naming file and tensor -------------------------------------------------------------------
QC = {"quant_method": "fp8", "weight_block_size": [32, 32]}


def _tensors(tmp_path: Path, shards: dict[str, dict[str, torch.Tensor]]):
    out = {}
    for f, ts in shards.items():
        save_file(ts, str(tmp_path / f))
        out.update({ti.name: ti for ti in read_header(tmp_path / f, f).tensors})
    return out


def _raises(fn, file: str, tensor: str, words: str) -> SourceError:
    with pytest.raises(SourceError) as ei:
        fn()
    e = ei.value
    assert (e.file, e.tensor) == (file, tensor), str(e)
    assert words in str(e) and "\n" not in str(e) and file in str(e) and tensor in str(e)
    return e


def test_missing_scale(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "a.safetensors", "x.weight", "without its scale")


def test_orphan_scale(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale_inv": _scales((2, 2), 1)},
                            "b.safetensors": {"y.weight_scale_inv": _scales((2, 2), 2)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "b.safetensors", "y.weight_scale_inv",
            "has no weight")


@pytest.mark.parametrize("scale_shape", [(2, 1), (1, 2), (3, 3), (4,), (2, 2, 1)])
def test_scale_of_the_wrong_shape(tmp_path, scale_shape):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 33), 1)},  # needs [2, 2]
                            "b.safetensors": {"x.weight_scale_inv": torch.ones(scale_shape)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "b.safetensors", "x.weight_scale_inv",
            "expected [2, 2]")


def test_scale_not_a_float(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "a.safetensors", "x.weight_scale_inv", "I32")


def test_leftover_fp8_tensor_is_refused(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale_inv": _scales((2, 2), 1),
                                              "x.bias": _fp8_values((64,), 2)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "a.safetensors", "x.bias", "refusing to copy")
    t = _tensors(tmp_path, {"c.safetensors": {"e8": torch.ones(4).to(torch.float8_e8m0fnu)}})
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "c.safetensors", "e8", "refusing to copy")


def test_bf16_weight_with_a_scale(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": torch.ones(64, 64, dtype=torch.bfloat16),
                                              "y.weight": _fp8_values((64, 64), 1),
                                              "y.weight_scale_inv": _scales((2, 2), 1)},
                            "b.safetensors": {"x.weight_scale_inv": _scales((2, 2), 2)}})
    _raises(lambda: Fp8BlockDecoder.detect({"quantization_config": QC}, t), "a.safetensors", "x.weight", "BF16")
    _raises(lambda: Fp8BlockDecoder((32, 32)).logical_tensors(t), "b.safetensors", "x.weight_scale_inv",
            "stored BF16")


def test_static_input_scales_are_refused(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale": torch.tensor(0.5), "x.input_scale": torch.tensor(1.)}})
    _raises(lambda: Fp8BlockDecoder(None).logical_tensors(t), "a.safetensors", "x.input_scale", "input_scale")


def test_per_tensor_scale_of_the_wrong_shape(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale_inv": torch.ones(2, 2)}})
    _raises(lambda: Fp8BlockDecoder(None).logical_tensors(t), "a.safetensors", "x.weight_scale_inv", "[] or [1]")


# --- detection --------------------------------------------------------------------------------------------------
@pytest.fixture
def fp8_tensors(tmp_path):
    return _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((256, 128), 1),
                                                 "x.weight_scale_inv": _scales((2, 1), 1),
                                                 "n.weight": torch.ones(8, dtype=torch.bfloat16)}})


@pytest.mark.parametrize("who", list(PUBLISHED))
def test_published_configs_detect(fp8_tensors, who):
    qc = PUBLISHED[who]
    for config in ({"quantization_config": qc}, {"model_type": "x", "text_config": {"quantization_config": qc}}):
        dec = detect(config, fp8_tensors)
        assert isinstance(dec, Fp8BlockDecoder) and dec.block == (128, 128), who
        assert dec.name == "fp8-block"
        assert dec.logical_tensors(fp8_tensors)["x.weight"].decoded


def test_bf16_and_other_configs_do_not_detect(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": torch.ones(4, 4, dtype=torch.bfloat16)}})
    assert Fp8BlockDecoder.detect({"torch_dtype": "bfloat16"}, t) is None
    assert isinstance(detect({"torch_dtype": "bfloat16"}, t), PlainDecoder)
    assert Fp8BlockDecoder.detect({"quantization_config": {"quant_method": "compressed-tensors"}}, t) is None
    assert Fp8BlockDecoder.detect({"quantization_config": {"quant_method": "mxfp4"}}, t) is None


@pytest.mark.parametrize("bad", [[128], [128, 0], [128, -128], "128", [128.0, 128], [True, 128], [128, 128, 1],
                                 {"rows": 128}])
def test_malformed_block_size(fp8_tensors, bad):
    e = _raises_cfg(lambda: detect({"quantization_config": {"quant_method": "fp8", "weight_block_size": bad}},
                                   fp8_tensors))
    assert "weight_block_size" in str(e) and repr(bad) in str(e)


def _raises_cfg(fn) -> SourceError:
    with pytest.raises(SourceError) as ei:
        fn()
    assert ei.value.file == "config.json" and "\n" not in str(ei.value)
    return ei.value


def test_fp8_config_without_fp8_tensors(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": torch.ones(4, 4, dtype=torch.bfloat16)}})
    e = _raises_cfg(lambda: detect({"quantization_config": PUBLISHED[next(iter(PUBLISHED))]}, t))
    assert "no tensor is stored in F8_E4M3/F8_E5M2" in str(e)


def test_per_tensor_weight_with_two_scales(tmp_path):
    t = _tensors(tmp_path, {"a.safetensors": {"x.weight": _fp8_values((64, 64), 1),
                                              "x.weight_scale_inv": torch.tensor(0.5),
                                              "x.weight_scale": torch.tensor(2.0)}})
    _raises(lambda: Fp8BlockDecoder(None).logical_tensors(t), "a.safetensors", "x.weight_scale",
            "second scale for x.weight")


def test_e8m0_and_f16_scales(tmp_path):
    """Power-of-two scales stored as F8_E8M0 (2^(s-127)) and F16 scales multiply as their float32 values."""
    w1, w2 = _fp8_values((70, 50), 21), _fp8_values((70, 50), 22)
    g = torch.Generator().manual_seed(5)
    s1 = torch.randint(110, 135, (3, 2), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    s2 = _scales((3, 2), 22, torch.float16)
    root = _write_checkpoint(tmp_path / "ck", {"model.safetensors": {
        "a.weight": w1, "a.weight_scale_inv": s1, "b.weight": w2, "b.weight_scale_inv": s2}},
        {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"})
    _, _, got = _decode_all(root)
    assert torch.equal(s1.float(), 2.0 ** (s1.view(torch.uint8).float() - 127))
    assert torch.equal(got["a.weight"], vendor_dequant(w1, s1, 32, 32))
    assert torch.equal(got["b.weight"], vendor_dequant(w2, s2, 32, 32))


def test_fp8_tensors_without_a_quantization_config(tmp_path, tmp_path_factory):
    fp8, _ = make_fp8_deepseek(example(tmp_path_factory, "deepseek_v3"), tmp_path / "made", block=(32, 32))
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="stored as F8_E4M3 but config.json has no quantization_config"):
        expq.inspect(fp8)
    cfg["quantization_config"] = "fp8"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="quantization_config must be a JSON object, got str"):
        expq.inspect(fp8)

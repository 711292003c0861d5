"""End to end: an FP8 block-scale DeepSeek-V3 source (``fp8_fixture.make_fp8_deepseek``) converts to exactly what
the vendor-dequantized bf16 checkpoint converts to."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import expq
from expq import cpu_kernels
from expq.cli import app
from expq.decoders import detect
from expq.decoders.fp8_block import Fp8BlockDecoder
from expq.errors import NonFiniteError
from expq.hub import model_card
from expq.io.safetensors import read_tensor
from expq.source import open_source

from fp8_fixture import make_fp8_deepseek
from helpers import count_row_absmax, edit_shard_tensors, example, raw_bytes, read_tensors

EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
BLOCKS = [(32, 32), (128, 128)]  # hidden 64, moe 48, dense 80, MLA 16/24: edge blocks everywhere with 32


@pytest.fixture(scope="module", params=BLOCKS, ids=lambda b: f"block{b[0]}x{b[1]}")
def fp8_pair(request, tmp_path_factory):
    bf16 = example(tmp_path_factory, "deepseek_v3")
    fp8_dir, vendor_dir = make_fp8_deepseek(bf16, tmp_path_factory.mktemp("fp8"), block=request.param)
    return request.param, bf16, fp8_dir, vendor_dir


def _headers(root):
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h = json.loads(fh.read(n))
        h.pop("__metadata__", None)
        out.update({k: (f.name, v["dtype"]) for k, v in h.items()})
    return out


def test_fixture_is_shipped_like_deepseek(fp8_pair):
    block, bf16, fp8_dir, vendor_dir = fp8_pair
    h = _headers(fp8_dir)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == list(block)
    assert "quantization_config" not in json.loads((vendor_dir / "config.json").read_text())
    quantized = {n for n, (_, dt) in h.items() if dt == "F8_E4M3"}
    assert all(h[n + "_scale_inv"][1] == "F32" for n in quantized)
    assert sum(h[n][0] != h[n + "_scale_inv"][0] for n in quantized) >= len(quantized) // 3  # scales elsewhere
    for must in ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.2.mlp.experts.0.gate_proj.weight",
                 "model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.3.down_proj.weight"]:
        assert must in quantized, must
    for kept in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.3.shared_head.head.weight",
                 "model.layers.3.enorm.weight", "model.norm.weight"]:
        assert h[kept][1] == "BF16", kept
    # the vendor's bf16 is the original up to FP8 rounding (|err| <= 2^-4 of the block's amax, plus bf16's)
    orig, vendor = read_tensors(bf16), read_tensors(vendor_dir)
    for n in quantized & set(orig):
        assert (vendor[n].float() - orig[n].float()).abs().max() <= orig[n].float().abs().max() * 0.07, n


def test_decoder_reproduces_the_vendor_checkpoint(fp8_pair):
    """Every logical tensor the decoder makes from the FP8 source equals the vendor's bf16 tensor, bit for bit."""
    _, _, fp8_dir, vendor_dir = fp8_pair
    src = open_source(fp8_dir)
    dec = detect(src.config, src.tensors)
    assert isinstance(dec, Fp8BlockDecoder)
    logical = dec.logical_tensors(src.tensors)
    vendor = read_tensors(vendor_dir)
    assert set(logical) == set(vendor)
    for name, lt in logical.items():
        got = dec.decode(lt, lambda ti: read_tensor(fp8_dir, ti)) if lt.decoded else read_tensor(fp8_dir, lt.stored)
        assert got.dtype == vendor[name].dtype and raw_bytes(got) == raw_bytes(vendor[name]), name


def test_convert_fp8_equals_convert_of_vendor_bf16(fp8_pair, tmp_path):
    _, _, fp8_dir, vendor_dir = fp8_pair
    out1, out2 = tmp_path / "from-fp8", tmp_path / "from-vendor-bf16"
    expq.convert(fp8_dir, out1, device="cpu", fsync=False)
    expq.convert(vendor_dir, out2, device="cpu", fsync=False)
    t1, t2, vendor = read_tensors(out1), read_tensors(out2), read_tensors(vendor_dir)
    assert set(t1) == set(t2)
    experts = {n for n in t1 if EXPERT.search(n)}
    assert any(n.endswith("weight_packed") for n in experts) and any(".layers.3." in n for n in experts)
    for n in experts:  # routed experts: identical codes and scales
        assert raw_bytes(t1[n]) == raw_bytes(t2[n]), n
    for n in set(t1) - experts:  # everything else: the vendor's bf16 tensor itself
        if n in vendor:
            assert t1[n].dtype == vendor[n].dtype and raw_bytes(t1[n]) == raw_bytes(vendor[n]), n
    assert not [n for n in t1 if "scale_inv" in n]
    assert not [n for n in t1 if t1[n].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    cfg = json.loads((out1 / "config.json").read_text())
    text = json.dumps(cfg)
    assert "weight_block_size" not in text and '"fp8"' not in text
    other = json.loads((out2 / "config.json").read_text())
    # the same config but for the hash of each one's expq.json (which records each source's decoding)
    assert cfg.pop("expq_manifest_sha256") != other.pop("expq_manifest_sha256") and cfg == other
    for f in sorted(out1.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            assert not any(k.endswith("_scale_inv") for k in s.keys())


@pytest.mark.parametrize("dtype", ["auto", "float16", "float32"])
def test_experts_int8_from_fp8_equals_from_vendor_bf16(fp8_pair, tmp_path, dtype, monkeypatch):
    """experts-int8, whose front pass takes the scales of an FP8 source from the decoder's row absmax (one read of
    the FP8 bytes, no decoded tensor; ``Fp8BlockDecoder.row_absmax``), writes the codes and scales the vendor's
    bf16 converts to, byte for byte, in every compute dtype (the absmax converted to fp16 / fp32 first)."""
    _, _, fp8_dir, vendor_dir = fp8_pair
    used = count_row_absmax(monkeypatch, Fp8BlockDecoder)
    out1, out2 = tmp_path / "from-fp8", tmp_path / "from-vendor-bf16"
    expq.convert(fp8_dir, out1, format="experts-int8", dtype=dtype, device="cpu", fsync=False)
    expq.convert(vendor_dir, out2, format="experts-int8", dtype=dtype, device="cpu", fsync=False)
    t1, t2 = read_tensors(out1), read_tensors(out2)
    assert set(t1) == set(t2)
    experts = {n for n in t1 if EXPERT.search(n)}
    assert any(n.endswith("weight_scale") for n in experts) and any(n.endswith("weight_int8") for n in experts)
    for n in experts:
        assert raw_bytes(t1[n]) == raw_bytes(t2[n]), n
    if cpu_kernels.active() == "numba":
        assert any(used)  # the front pass took scales from the row absmax (where it claimed the job first)


def test_decoded_tensors_are_not_called_byte_identical(fp8_pair, tmp_path):
    """The non-expert weights stored as FP8 are decoded, not copied: convert's table and --json, inspect and the
    model card count them apart from the tensors copied byte for byte."""
    block, _, fp8_dir, _ = fp8_pair
    if block != BLOCKS[0]:
        pytest.skip("one block size shows it")
    h = _headers(fp8_dir)
    layers = json.loads((fp8_dir / "config.json").read_text())["num_hidden_layers"]  # past it: MTP, not quantized
    routed = {n for n in h if EXPERT.search(n) and int(n.split(".")[2]) < layers}
    stored = {n for n in h if not n.endswith("_scale_inv")} - routed
    n_dec = sum(1 for n in stored if h[n][1] == "F8_E4M3")
    n_copy = len(stored) - n_dec
    assert n_dec > 0 and n_copy > 0

    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["convert", str(fp8_dir), str(out), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert f"tensors copied byte for byte\t{n_copy}\n" in res.output
    assert f"tensors decoded, not quantized\t{n_dec}\n" in res.output
    res = CliRunner().invoke(app, ["convert", str(fp8_dir), str(out), "--device", "cpu", "--json"])  # up to date
    rep = json.loads(res.stdout)
    assert (rep["tensors_byte_identical"], rep["tensors_decoded_not_quantized"], rep["tensors_copied"]) == (
        n_copy, n_dec, n_copy + n_dec)

    res = CliRunner().invoke(app, ["inspect", str(fp8_dir)])
    assert f"not quantized\t{n_copy} tensors copied byte for byte and {n_dec} decoded (" in res.output
    s = expq.inspect(fp8_dir).summary()
    assert (s["source_tensors_byte_identical"], s["source_tensors_decoded_not_quantized"]) == (n_copy, n_dec)

    card = model_card(out, "me/x")
    assert f"| of which kept as they were (byte-identical) | {n_copy} tensors |" in card
    assert f"| of which decoded from fp8-block to bfloat16 | {n_dec} tensors |" in card
    assert "| kept as they were (byte-identical) |" not in card


def test_nan_in_a_decoded_non_expert_tensor_is_refused(tmp_path, tmp_path_factory):
    fp8, _ = make_fp8_deepseek(example(tmp_path_factory, "deepseek_v3"), tmp_path / "made", block=(32, 32))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    edit_shard_tensors(fp8, name, lambda t: t[name].view(-1)[:1].fill_(float("nan")))
    with pytest.raises(NonFiniteError, match=r"decodes to \d+ NaN/infinite values \(from .*o_proj.weight_scale_inv") \
            as ei:
        expq.convert(fp8, tmp_path / "out", device="cpu")
    assert ei.value.tensor == "model.layers.1.self_attn.o_proj.weight" and not (tmp_path / "out").exists()

"""End to end: a compressed-tensors INT4 source converts exactly as its library-decompressed bf16 twin does."""

from __future__ import annotations

import json

import torch

import expq
from ct_fixture import make_ct_int4_source
from helpers import example, read_tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_int4_source_converts_like_its_decompressed_twin(tmp_path, tmp_path_factory):
    ct_dir, twin_dir = make_ct_int4_source(example(tmp_path_factory, "qwen3_moe"), tmp_path / "fixtures")
    out_ct, out_twin = tmp_path / "from-ct", tmp_path / "from-twin"
    expq.convert(ct_dir, out_ct, device="cpu")
    expq.convert(twin_dir, out_twin, device="cpu")

    a, b = read_tensors(out_ct), read_tensors(out_twin)
    assert a.keys() == b.keys()
    routed = [n for n in a if ".mlp.experts." in n]
    assert len(routed) == 2 * 4 * 3 * 3  # layers x experts x projections x (weight_packed, weight_scale, shape)
    for name in a:  # routed experts (int8 codes, scales) and every other tensor: identical
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name

    qc_ct = json.loads((out_ct / "config.json").read_text())["quantization_config"]
    qc_twin = json.loads((out_twin / "config.json").read_text())["quantization_config"]
    assert qc_ct == qc_twin  # expq's own int8 channel config; nothing of the source's INT4 config survives
    (group,) = qc_ct["config_groups"].values()
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert "group_size\": 16" not in (out_ct / "config.json").read_text()
    for name, t in a.items():  # every packed weight is int8 packing: 4 codes a word, [out, ceil(in/4)]
        if name.endswith(".weight_packed"):
            rows, cols = a[name.removesuffix("_packed") + "_shape"].tolist()
            assert t.shape == (rows, -(-cols // 4)), name


def test_fp8_dynamic_source_converts_like_its_decompressed_twin(tmp_path, tmp_path_factory):
    """An FP8-dynamic release (every Linear but routers and lm_head FP8 per channel, dynamic activations): the routed
    experts are quantized from their decoded weights, attention is written decoded; both as from the bf16 twin."""
    from ct_fixture import compress_checkpoint, quantization_config, scheme

    sch = scheme(dict(num_bits=8, type="float", symmetric=True, strategy="channel"), ["Linear"], "float-quantized",
                 dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True))
    qc = quantization_config({"group_0": sch}, "float-quantized", ["lm_head", r"re:.*mlp\.gate$"])

    def linear(name: str) -> str | None:
        ok = name.endswith("_proj.weight") and (".mlp.experts." in name or ".self_attn." in name)
        return name.removesuffix(".weight") if ok else None

    ct_dir, twin_dir = compress_checkpoint(example(tmp_path_factory, "qwen3_moe"), tmp_path / "fp8",
                                           tmp_path / "fp8-decompressed", linear, sch, qc)
    out_ct, out_twin = tmp_path / "from-ct", tmp_path / "from-twin"
    expq.convert(ct_dir, out_ct, device="cpu")
    expq.convert(twin_dir, out_twin, device="cpu")
    a, b = read_tensors(out_ct), read_tensors(out_twin)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(_bits(a[name]), _bits(b[name])), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert a[q].dtype == torch.bfloat16 and read_tensors(ct_dir)[q].dtype == torch.float8_e4m3fn
    assert json.loads((out_ct / "config.json").read_text())["quantization_config"] == \
        json.loads((out_twin / "config.json").read_text())["quantization_config"]

"""End to end from an MXFP4 GPT-OSS source: converting the MXFP4 checkpoint gives the same output as converting the
bf16 checkpoint that transformers' own dequantizer makes of it (both formats; experts-int8 with its scales from the
decoder's row absmax and without); and transformers itself loads the MXFP4 fixture into
its bf16 GptOssExperts with exactly the tensors the decoder produces."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import count_row_absmax, example, raw_bytes, read_tensors, tree_digest
from mxfp4_fixture import FIXTURE_OVERRIDES, make_mxfp4_gpt_oss

import expq
from expq import cpu_kernels
from expq.decoders import detect
from expq.decoders.mxfp4 import Mxfp4Decoder
from expq.io.safetensors import read_tensor
from expq.source import open_source


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    bf16 = example(tmp_path_factory, "gpt_oss", **FIXTURE_OVERRIDES)
    return make_mxfp4_gpt_oss(bf16, tmp_path_factory.mktemp("mxfp4-gpt-oss"))


def test_fixture_is_stored_as_published(sources):
    mx, deq = sources
    src = open_source(mx)
    p = "model.layers.0.mlp.experts."
    heads = {n: (t.dtype, t.shape) for n, t in src.tensors.items() if n.startswith(p)}
    assert heads == {p + "gate_up_proj_blocks": ("U8", (4, 192, 2, 16)), p + "gate_up_proj_scales": ("U8", (4, 192, 2)),
                     p + "gate_up_proj_bias": ("BF16", (4, 192)),
                     p + "down_proj_blocks": ("U8", (4, 64, 3, 16)), p + "down_proj_scales": ("U8", (4, 64, 3)),
                     p + "down_proj_bias": ("BF16", (4, 64))}
    assert src.config["quantization_config"]["quant_method"] == "mxfp4"
    assert "quantization_config" not in open_source(deq).config


def test_transformers_loads_the_mxfp4_fixture_as_the_decoder_decodes_it(sources):
    """transformers (CPU, no kernels: it dequantizes) puts the experts in GptOssExperts [E, in, out]; the decoder's
    logical tensors have the same names, shapes and bits."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    mx, _ = sources
    model = AutoModelForCausalLM.from_pretrained(mx, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    assert isinstance(model.model.layers[0].mlp.experts, GptOssExperts)
    held = model.state_dict()
    src = open_source(mx)
    dec = detect(src.config, src.tensors)
    assert isinstance(dec, Mxfp4Decoder)
    decoded = [lt for lt in dec.logical_tensors(src.tensors).values() if lt.decoded]
    assert len(decoded) == 4  # 2 layers x (gate_up_proj, down_proj)
    for lt in decoded:
        got = dec.decode(lt, functools.partial(read_tensor, src.root))
        assert held[lt.name].dtype == torch.bfloat16 and tuple(held[lt.name].shape) == lt.shape == tuple(got.shape)
        assert torch.equal(held[lt.name].view(torch.int16), got.view(torch.int16)), lt.name


def test_convert_mxfp4_equals_convert_of_its_dequantized_bf16(sources, tmp_path):
    mx, deq = sources
    out1, out2 = tmp_path / "from-mxfp4", tmp_path / "from-bf16"
    kw = dict(device="cpu", format="compressed-tensors", allow_random_experts_in_transformers=True)  # gpt_oss
    expq.convert(mx, out1, **kw)
    expq.convert(deq, out2, **kw)
    t1, t2 = read_tensors(out1), read_tensors(out2)
    assert not [n for n in t1 if n.endswith(("_blocks", "_scales"))]
    assert sorted(t1) == sorted(t2)
    experts = [n for n in t1 if ".mlp.experts." in n and n.endswith(("weight_packed", "weight_scale"))]
    assert len(experts) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (codes, scales)
    for n in t1:
        assert t1[n].dtype == t2[n].dtype and t1[n].shape == t2[n].shape, n
        assert raw_bytes(t1[n]) == raw_bytes(t2[n]), n
    c1, c2 = (json.loads((o / "config.json").read_text()) for o in (out1, out2))
    assert c1["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "mxfp4" not in json.dumps(c1) and "modules_to_not_convert" not in json.dumps(c1["quantization_config"])
    # the same config but for the hash of each one's expq.json (which records each source's decoding)
    assert c1.pop("expq_manifest_sha256") != c2.pop("expq_manifest_sha256") and c1 == c2
    plan = expq.inspect(mx).summary()
    assert (plan["source_format"], plan["source_tensors_decoded"], plan["source_tensors_quantized"]) == ("mxfp4", 4, 4)
    assert expq.inspect(deq).summary()["source_format"] == "none"
    side = lambda o: sorted(p.name for p in o.iterdir() if not p.name.endswith(".safetensors"))  # noqa: E731
    assert side(out1) == side(out2)


@pytest.mark.parametrize("dtype", ["auto", "float16", "float32"])
def test_experts_int8_from_mxfp4_equals_from_its_dequantized_bf16(sources, tmp_path, dtype, monkeypatch):
    """experts-int8, whose front pass takes the scales of an MXFP4 source from the decoder's row absmax over the
    input dimension (one read of the packed bytes, no decoded tensor; ``Mxfp4Decoder.row_absmax``), writes the
    codes and scales that the dequantized bf16 converts to, byte for byte, in every compute dtype; and the whole
    output is byte-identical to the one the torch path writes (``EXPQ_CPU_KERNEL=torch``: the front pass decodes)."""
    mx, deq = sources
    used = count_row_absmax(monkeypatch, Mxfp4Decoder)
    kw = dict(format="experts-int8", dtype=dtype, device="cpu", fsync=False)
    fused, out2, ref = tmp_path / "from-mxfp4", tmp_path / "from-mxfp4-torch", tmp_path / "from-bf16"
    expq.convert(mx, fused, **kw)
    if cpu_kernels.active() == "numba":
        assert any(used)  # the front pass took scales from the row absmax (where it claimed the job first)
    expq.convert(deq, ref, **kw)
    t1, t2 = read_tensors(fused), read_tensors(ref)
    experts = {n for n in t1 if ".mlp.experts." in n}
    assert experts == {n for n in t2 if ".mlp.experts." in n}
    assert any(n.endswith("weight_scale") for n in experts) and any(n.endswith("weight_int8") for n in experts)
    for n in experts:
        assert raw_bytes(t1[n]) == raw_bytes(t2[n]), n
    used.clear()
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    expq.convert(mx, out2, **kw)
    assert not any(used)
    assert tree_digest(fused) == tree_digest(out2)

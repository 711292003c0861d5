"""The MXFP4 source decoder (GPT-OSS): values against a literal E2M1 table and against transformers' own
dequantization, bit for bit; the logical tensors' names, shapes and orientation against transformers' GPT-OSS module;
detection on the published configs; errors that name file and tensor."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from expq.decoders import DECODERS, PlainDecoder, detect
from expq.decoders.mxfp4 import Mxfp4Decoder, dequantize
from expq.errors import SourceError
from expq.io.safetensors import TensorInfo, read_tensor
from expq.source import open_source

# E2M1 (OCP Microscaling Formats v1.0, table of FP4 E2M1 values): nibble -> value.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

# One 16-byte block whose byte j holds nibble j low and nibble 15 - j high: every nibble in both positions.
BLOCK = [j | ((15 - j) << 4) for j in range(16)]
# Its 32 values at scale 2**0 (s = 127), low nibble first: E2M1[0], E2M1[15], E2M1[1], E2M1[14], ...
AT_SCALE_127 = [0.0, -6.0, 0.5, -4.0, 1.0, -3.0, 1.5, -2.0, 2.0, -1.5, 3.0, -1.0, 4.0, -0.5, 6.0, -0.0,
                -0.0, 6.0, -0.5, 4.0, -1.0, 3.0, -1.5, 2.0, -2.0, 1.5, -3.0, 1.0, -4.0, 0.5, -6.0, 0.0]
# s = 120 is 2**-7 = 0.0078125 and s = 130 is 2**3 = 8 times those.
AT_SCALE_120 = [0.0, -0.046875, 0.00390625, -0.03125, 0.0078125, -0.0234375, 0.01171875, -0.015625,
                0.015625, -0.01171875, 0.0234375, -0.0078125, 0.03125, -0.00390625, 0.046875, -0.0,
                -0.0, 0.046875, -0.00390625, 0.03125, -0.0078125, 0.0234375, -0.01171875, 0.015625,
                -0.015625, 0.01171875, -0.0234375, 0.0078125, -0.03125, 0.00390625, -0.046875, 0.0]
AT_SCALE_130 = [0.0, -48.0, 4.0, -32.0, 8.0, -24.0, 12.0, -16.0, 16.0, -12.0, 24.0, -8.0, 32.0, -4.0, 48.0, -0.0,
                -0.0, 48.0, -4.0, 32.0, -8.0, 24.0, -12.0, 16.0, -16.0, 12.0, -24.0, 8.0, -32.0, 4.0, -48.0, 0.0]
INF = float("inf")
# The ends of the scale range, as transformers 5.24 / torch 2.13 decode them (module doc of expq/decoders/mxfp4.py):
# s = 0 gives bf16 subnormals, s = 255 (NaN in the OCP spec) overflows all but 0 and +-0.5 to infinity.
AT_SCALE_0 = [v * 2.0 ** -127 for v in AT_SCALE_127]  # exact in Python floats: 0.5 * 2**-127 = 2**-128
AT_SCALE_255 = [0.0, -INF, 2.0 ** 127, -INF, INF, -INF, INF, -INF, INF, -INF, INF, -INF, INF, -2.0 ** 127, INF, -0.0,
                -0.0, INF, -2.0 ** 127, INF, -INF, INF, -INF, INF, -INF, INF, -INF, INF, -INF, 2.0 ** 127, -INF, 0.0]

PUBLISHED_20B = {  # https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
PUBLISHED_120B = dict(PUBLISHED_20B, layer_types=["sliding_attention", "full_attention"] * 18, num_hidden_layers=36,
                      num_local_experts=128)  # https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json
BF16_CONFIG = {k: v for k, v in PUBLISHED_20B.items() if k != "quantization_config"} | {"torch_dtype": "bfloat16"}


def bits(values) -> torch.Tensor:
    """bf16 bit patterns (int16) of Python floats: compares -0.0 and 0.0 as different, inf and NaN by pattern."""
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)


def one_block(scale_bytes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """E=1, one row per scale, one block a row: blocks [1, S, 1, 16], scales [1, S, 1]."""
    blocks = torch.tensor([BLOCK] * len(scale_bytes), dtype=torch.uint8).view(1, len(scale_bytes), 1, 16)
    return blocks, torch.tensor(scale_bytes, dtype=torch.uint8).view(1, -1, 1)


def header(name: str, dtype: str, shape: tuple[int, ...], file: str = "model-00001-of-00002.safetensors"):
    return TensorInfo(name, file, dtype, shape, 0, 0)


# --- values --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s, want", [(127, AT_SCALE_127), (120, AT_SCALE_120), (130, AT_SCALE_130), (0, AT_SCALE_0),
                                     (255, AT_SCALE_255)])
def test_one_block_against_the_e2m1_table(s, want):
    blocks, scales = one_block([s])
    got = dequantize(blocks, scales)  # [1, 32, 1]: the block's 32 values down the input dimension
    assert got.shape == (1, 32, 1) and got.dtype == torch.bfloat16
    assert got[0, :, 0].view(torch.int16).tolist() == bits(want).tolist()


def test_literal_table_rows_are_what_they_claim():
    """The literal rows above are E2M1 [j] / E2M1[15 - j] interleaved, times 2**(s - 127): the test's own check."""
    for s, row in ((127, AT_SCALE_127), (120, AT_SCALE_120), (130, AT_SCALE_130)):
        for j in range(16):
            assert row[2 * j] == E2M1[j] * 2.0 ** (s - 127) and row[2 * j + 1] == E2M1[15 - j] * 2.0 ** (s - 127)
    assert str(AT_SCALE_127[15]) == "-0.0" and str(AT_SCALE_127[31]) == "0.0"


def test_negative_controls_a_swapped_nibble_order_or_bias_off_by_one_would_fail():
    """What a decoder reading the high nibble first, or using bias 126 / 128, would output differs from the table."""
    blocks, scales = one_block([127])
    swapped = ((blocks & 0x0F) << 4) | (blocks >> 4)  # the same bytes read high nibble first
    want = bits(AT_SCALE_127).tolist()
    assert dequantize(swapped, scales)[0, :, 0].view(torch.int16).tolist() != want
    for off in (-1, 1):
        assert dequantize(blocks, scales + off)[0, :, 0].view(torch.int16).tolist() != want


def test_every_byte_at_every_scale_equals_transformers_bit_for_bit():
    """All 256 bytes x all 256 scales, plus several experts, rows and blocks so that the orientation counts."""
    b = torch.arange(256, dtype=torch.uint8).view(16, 16)
    blocks = b.view(1, 1, 16, 16).repeat(3, 256, 1, 1)  # [E=3, R=256, G=16, 16]
    blocks[1] = blocks[1].roll(5, dims=1)  # expert 1 differs from expert 0 along the blocks
    blocks[2] = 255 - blocks[2]
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).repeat(3, 1, 16)
    scales[:, :, 1::2] = scales[:, :, 1::2].flip(1)  # other scales in odd blocks
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    got = dequantize(blocks, scales)
    assert got.shape == want.shape == (3, 16 * 32, 256) and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_random_blocks_equal_transformers_and_chunking_changes_nothing(monkeypatch):
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 40, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (4, 40, 3), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16).view(torch.int16)
    assert torch.equal(dequantize(blocks, scales).view(torch.int16), want)
    import expq.decoders.mxfp4 as m
    monkeypatch.setattr(m, "CHUNK_BYTES", 3 * 16 * 7)  # 7 rows a chunk: 40 rows end in a partial chunk
    assert torch.equal(dequantize(blocks, scales).view(torch.int16), want)


def test_element_mapping_orientation():
    """Stored [e, r, g, byte j] decodes to out[e, g*32 + 2j (+1 for the high nibble), r]: one byte set at a time."""
    E, R, G = 2, 3, 2
    for e, r, g, j in [(0, 0, 0, 0), (1, 2, 1, 15), (0, 1, 1, 7), (1, 0, 0, 3)]:
        blocks = torch.zeros(E, R, G, 16, dtype=torch.uint8)
        blocks[e, r, g, j] = 0x2D  # low nibble 0xD = -3.0, high nibble 0x2 = 1.0
        scales = torch.full((E, R, G), 127, dtype=torch.uint8)
        scales[e, r, g] = 128  # x 2
        out = dequantize(blocks, scales).float()
        assert out.shape == (E, G * 32, R)
        assert out[e, g * 32 + 2 * j, r].item() == -6.0 and out[e, g * 32 + 2 * j + 1, r].item() == 2.0
        assert out.count_nonzero().item() == 2


# --- logical tensors and the Decoder protocol ---------------------------------------------------------------------
def test_logical_shapes_match_transformers_gpt_oss_modules():
    """Blocks stored as the published checkpoint stores them ([E, out, in/32, 16]) give the [E, in, out] parameters
    of transformers' bf16 GptOssExperts, at H != I."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, H, I = 4, 64, 96
    with torch.device("meta"):
        mod = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    p = "model.layers.0.mlp.experts."
    tensors = {t.name: t for t in [
        header(p + "gate_up_proj_blocks", "U8", (E, 2 * I, H // 32, 16)),
        header(p + "gate_up_proj_scales", "U8", (E, 2 * I, H // 32)),
        header(p + "gate_up_proj_bias", "BF16", (E, 2 * I)),
        header(p + "down_proj_blocks", "U8", (E, H, I // 32, 16)),
        header(p + "down_proj_scales", "U8", (E, H, I // 32)),
        header(p + "down_proj_bias", "BF16", (E, H))]}
    lts = Mxfp4Decoder(PUBLISHED_20B["quantization_config"]).logical_tensors(tensors)
    assert list(lts) == [p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias"]
    assert lts[p + "gate_up_proj"].shape == tuple(mod.gate_up_proj.shape) == (E, H, 2 * I)
    assert lts[p + "down_proj"].shape == tuple(mod.down_proj.shape) == (E, I, H)
    gu = lts[p + "gate_up_proj"]
    assert (gu.dtype, gu.decoded, gu.how) == ("BF16", True, "mxfp4 e2m1 x e8m0 (32-element blocks) -> bf16")
    assert [t.name for t in gu.parts] == [p + "gate_up_proj_blocks", p + "gate_up_proj_scales"]
    assert lts[p + "gate_up_proj_bias"].parts == (tensors[p + "gate_up_proj_bias"],)
    assert not lts[p + "gate_up_proj_bias"].decoded


def test_published_layer_headers_give_the_bf16_checkpoint_shapes():
    """openai/gpt-oss-20b layer headers: gate_up blocks U8 [32, 5760, 90, 16], down blocks U8 [32, 2880, 90, 16]."""
    p = "model.layers.0.mlp.experts."
    tensors = {t.name: t for t in [header(p + "gate_up_proj_blocks", "U8", (32, 5760, 90, 16)),
                                   header(p + "gate_up_proj_scales", "U8", (32, 5760, 90)),
                                   header(p + "down_proj_blocks", "U8", (32, 2880, 90, 16)),
                                   header(p + "down_proj_scales", "U8", (32, 2880, 90))]}
    dec = detect(PUBLISHED_20B, tensors)
    assert isinstance(dec, Mxfp4Decoder) and dec.name == "mxfp4"
    lts = dec.logical_tensors(tensors)
    assert {n: lt.shape for n, lt in lts.items()} == {p + "gate_up_proj": (32, 2880, 5760),
                                                      p + "down_proj": (32, 2880, 2880)}


def test_decode_through_files_with_scales_in_another_shard(tmp_path):
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 6, 2), generator=g, dtype=torch.uint8)
    p = "model.layers.0.mlp.experts.down_proj"
    save_file({p + "_blocks": blocks, "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)},
              tmp_path / "model-00001-of-00002.safetensors")
    save_file({p + "_scales": scales}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"%s_blocks": "model-00001-of-00002.safetensors", "model.norm.weight": '
        '"model-00001-of-00002.safetensors", "%s_scales": "model-00002-of-00002.safetensors"}}' % (p, p))
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}')
    src = open_source(tmp_path)
    dec = detect(src.config, src.tensors)
    lts = dec.logical_tensors(src.tensors)
    lt = lts[p]
    assert [t.file for t in lt.parts] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert lt.nbytes_stored == blocks.numel() + scales.numel()
    got = dec.decode(lt, functools.partial(read_tensor, src.root))
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert got.shape == lt.shape == (2, 64, 6) and torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(SourceError) as e:
        dec.decode(lts["model.norm.weight"], functools.partial(read_tensor, src.root))
    assert e.value.tensor == "model.norm.weight"


# --- detection -------------------------------------------------------------------------------------------------------
PUBLISHED_LAYER = {t.name: t for t in [
    header("model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", (32, 5760, 90, 16)),
    header("model.layers.0.mlp.experts.gate_up_proj_scales", "U8", (32, 5760, 90)),
    header("model.layers.0.mlp.experts.gate_up_proj_bias", "BF16", (32, 5760)),
    header("model.layers.0.mlp.router.weight", "BF16", (32, 2880))]}


@pytest.mark.parametrize("config", [PUBLISHED_20B, PUBLISHED_120B, {"text_config": PUBLISHED_20B}],
                         ids=["gpt-oss-20b", "gpt-oss-120b", "nested"])
def test_detects_the_published_configs(config):
    assert Mxfp4Decoder in DECODERS
    dec = detect(config, PUBLISHED_LAYER)
    assert isinstance(dec, Mxfp4Decoder)
    assert dec.modules_to_not_convert == ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"]


def test_a_bf16_config_is_not_mxfp4():
    bf16 = {"model.layers.0.mlp.experts.gate_up_proj": header("model.layers.0.mlp.experts.gate_up_proj", "BF16",
                                                              (32, 2880, 5760))}
    assert Mxfp4Decoder.detect(BF16_CONFIG, bf16) is None
    assert isinstance(detect(BF16_CONFIG, bf16), PlainDecoder)
    assert Mxfp4Decoder.detect(BF16_CONFIG, PUBLISHED_LAYER) is None  # the config decides, not the names
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert Mxfp4Decoder.detect(fp8, PUBLISHED_LAYER) is None


def test_mxfp4_config_without_mxfp4_tensors_is_refused():
    bf16 = {n: header(n, "BF16", (4, 64, 192)) for n in ["model.layers.0.mlp.experts.gate_up_proj"]}
    with pytest.raises(SourceError, match="no tensor is stored as MXFP4") as e:
        detect(PUBLISHED_20B, bf16)
    assert e.value.file == "config.json"


@pytest.mark.parametrize("which, dtype", [("blocks", "I8"), ("scales", "F8_E8M0"), ("blocks", "F8_E4M3")])
def test_mxfp4_parts_must_be_u8_by_dtype_string(which, dtype):
    """One-byte dtypes other than U8 are refused: the decision is the dtype string, not the element size."""
    tensors = dict(PUBLISHED_LAYER)
    name = f"model.layers.0.mlp.experts.gate_up_proj_{which}"
    tensors[name] = header(name, dtype, tensors[name].shape)
    for call in (lambda: detect(PUBLISHED_20B, tensors),
                 lambda: Mxfp4Decoder(PUBLISHED_20B["quantization_config"]).logical_tensors(tensors)):
        with pytest.raises(SourceError, match="U8") as e:
            call()
        assert (e.value.file, e.value.tensor) == ("model-00001-of-00002.safetensors", name)
        assert "\n" not in str(e.value) and name in str(e.value)


# --- errors -----------------------------------------------------------------------------------------------------------
P = "model.layers.3.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("case, bad, message", [
    ("no scales", P + "_blocks", "blocks without their scales"),
    ("no blocks", P + "_scales", "scales without their blocks"),
    ("scales shape", P + "_scales", r"scales \[4, 192, 3\] do not fit blocks \[4, 192, 2, 16\]"),
    ("block bytes", P + "_blocks", r"must be \[experts, rows, blocks, 16\], not \[4, 192, 2, 32\]"),
    ("blocks rank", P + "_blocks", r"must be \[experts, rows, blocks, 16\], not \[192, 2, 16\]"),
    ("both stored", P, "stored both unquantized and as MXFP4"),
])
def test_errors_name_file_and_tensor(case, bad, message):
    tensors = {P + "_blocks": header(P + "_blocks", "U8", (4, 192, 2, 16), "model-00001-of-00002.safetensors"),
               P + "_scales": header(P + "_scales", "U8", (4, 192, 2), "model-00002-of-00002.safetensors")}
    if case == "no scales":
        del tensors[P + "_scales"]
    elif case == "no blocks":
        del tensors[P + "_blocks"]
    elif case == "scales shape":
        tensors[P + "_scales"] = header(P + "_scales", "U8", (4, 192, 3), "model-00002-of-00002.safetensors")
    elif case == "block bytes":
        tensors[P + "_blocks"] = header(P + "_blocks", "U8", (4, 192, 2, 32), "model-00001-of-00002.safetensors")
    elif case == "blocks rank":
        tensors[P + "_blocks"] = header(P + "_blocks", "U8", (192, 2, 16), "model-00001-of-00002.safetensors")
        tensors[P + "_scales"] = header(P + "_scales", "U8", (192, 2), "model-00002-of-00002.safetensors")
    elif case == "both stored":
        tensors = {P: header(P, "BF16", (4, 64, 192), "model-00003-of-00003.safetensors"), **tensors}
    with pytest.raises(SourceError, match=message) as e:
        Mxfp4Decoder(PUBLISHED_20B["quantization_config"]).logical_tensors(tensors)
    err = e.value
    assert err.tensor == bad and err.file == tensors[bad].file
    assert str(err).startswith(f"file {tensors[bad].file}, tensor {bad}: ") and "\n" not in str(err)


def test_decode_refuses_what_does_not_match_the_header():
    blocks, scales = one_block([127])
    binfo = header(P + "_blocks", "U8", (1, 1, 1, 16))
    sinfo = header(P + "_scales", "U8", (1, 1, 1))
    lt = Mxfp4Decoder({}).logical_tensors({binfo.name: binfo, sinfo.name: sinfo})[P]
    wrong = {binfo.name: blocks, sinfo.name: scales.view(1, 1).to(torch.int16)}
    with pytest.raises(SourceError, match="expected uint8") as e:
        Mxfp4Decoder({}).decode(lt, lambda ti: wrong[ti.name])
    assert (e.value.file, e.value.tensor) == (sinfo.file, sinfo.name)

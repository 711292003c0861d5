"""A tiny GPT-OSS checkpoint with its routed experts stored as MXFP4, the way openai/gpt-oss-20b stores them, and the
bf16 checkpoint that transformers' own dequantizer makes of it.

Published layout (openai/gpt-oss-20b ``model.safetensors.index.json`` and shard headers): for each layer,
``mlp.experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16], ``..._scales`` U8 [E, 2I, H/32],
``mlp.experts.down_proj_blocks`` U8 [E, H, I/32, 16], ``..._scales`` U8 [E, H, I/32], next to the bf16 expert biases;
the config carries ``quantization_config = {"modules_to_not_convert": [...], "quant_method": "mxfp4"}``.

The MXFP4 encoder here is the test suite's own (OCP MX v1.0: a block's shared exponent is ``floor(log2(amax)) - 2``,
elements rounded to the nearest E2M1 value, saturating at 6); it only has to produce valid blocks. The reference bf16
checkpoint is decoded by ``transformers.integrations.mxfp4.convert_moe_packed_tensors``, never by expq.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# openai/gpt-oss-20b and gpt-oss-120b config.json (both the same)
PUBLISHED_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
# A fixture override: the tiny example's I = 48 is not a multiple of 32 (down_proj's input dim must be). 96 keeps
# H (64) != I and H != 2I, so orientation mistakes still show up as shape errors.
FIXTURE_OVERRIDES = dict(intermediate_size=96)
EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def encode_mxfp4(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, out, in]`` float (``in`` a multiple of 32) -> (blocks uint8 [E, out, in/32, 16], scales uint8
    [E, out, in/32]), low nibble first."""
    E, R, K = w_out_in.shape
    x = w_out_in.float().reshape(E, R, K // 32, 32)
    amax = x.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = torch.where(amax > 0, e - 1 - 2, torch.zeros_like(e))
    s = (shared + 127).clamp(0, 254)
    y = x / torch.pow(2.0, (s - 127).float()).unsqueeze(-1)
    mags = torch.tensor(E2M1_MAGNITUDES)
    code = (y.abs().clamp(max=6.0).unsqueeze(-1) - mags).abs().argmin(dim=-1)  # nearest magnitude
    nib = (code | (torch.signbit(y).long() << 3)).to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return blocks.contiguous(), s.to(torch.uint8).contiguous()


def _read_shards(root: Path) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    idx = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(set(idx.values())):
        with safe_open(root / f, "pt") as s:
            shards[f] = {k: s.get_tensor(k) for k in s.keys()}
    return idx, shards


def _write(root: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict, side_from: Path) -> None:
    root.mkdir(parents=True)
    weight_map, total = {}, 0
    for f, tensors in shards.items():
        save_file(tensors, root / f, metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = f
            total += t.numel() * t.element_size()
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for p in sorted(side_from.iterdir()):
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy(p, root / p.name)


def make_mxfp4_gpt_oss(bf16_dir: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """From a bf16 GPT-OSS fixture (``build_example("gpt_oss", path, **FIXTURE_OVERRIDES)``), write
    ``out_dir/mxfp4`` (routed experts as ``*_blocks`` + ``*_scales``, published-style ``quantization_config``) and
    ``out_dir/bf16-dequantized`` (the same checkpoint with those experts dequantized by transformers' own
    ``convert_moe_packed_tensors``, config without ``quantization_config``). Returns (mxfp4_dir, dequantized_dir).

    Expert ``e``'s weights are scaled by ``2**(2e - 3)`` before encoding, so the blocks use a spread of scales. The
    blocks and scales of each projection sit in its shard, except that the last layer's scales go to the last shard
    (a logical tensor whose parts are in two files).

    Raises:
        ValueError: an expert input dimension that is not a multiple of 32.
    """
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    config = json.loads((bf16_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    last_layer = config["num_hidden_layers"] - 1
    _, shards = _read_shards(bf16_dir)
    last_file = sorted(shards)[-1]
    mx: dict[str, dict[str, torch.Tensor]] = {f: {} for f in shards}
    deq: dict[str, dict[str, torch.Tensor]] = {f: {} for f in shards}
    for f, tensors in shards.items():
        for name, t in tensors.items():
            if not name.endswith(EXPERT_SUFFIXES):
                mx[f][name] = deq[f][name] = t
                continue
            if t.shape[1] % 32:
                raise ValueError(f"{name}: input dim {t.shape[1]} is not a multiple of 32 (pass {FIXTURE_OVERRIDES})")
            spread = torch.pow(2.0, 2.0 * torch.arange(t.shape[0]) - 3).view(-1, 1, 1)
            blocks, scales = encode_mxfp4((t.float() * spread).transpose(1, 2))  # [E, in, out] -> [E, out, in]
            mx[f][name + "_blocks"] = blocks
            scales_file = last_file if name.startswith(f"model.layers.{last_layer}.") else f
            mx[scales_file][name + "_scales"] = scales
            deq[f][name] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    mx_config = dict(config, quantization_config=dict(PUBLISHED_QUANTIZATION_CONFIG))
    mx_dir, deq_dir = out_dir / "mxfp4", out_dir / "bf16-dequantized"
    _write(mx_dir, mx, mx_config, bf16_dir)
    _write(deq_dir, deq, config, bf16_dir)
    return mx_dir, deq_dir

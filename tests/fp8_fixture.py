"""FP8 block-scale test checkpoints made the way DeepSeek ships them, and the vendor's own dequantization, written
out literally (independent of expq's decoder).

- ``vendor_quant``: DeepSeek-V3 ``inference/kernel.py`` ``weight_quant``: per ``br x bc`` block, in fp32,
  ``s = amax(|x|) / 448``, ``q = fp8(x / s)``; ``s`` stored as F32 ``weight_scale_inv``.
- ``vendor_dequant``: ``weight_dequant`` as ``inference/fp8_cast_bf16.py`` calls it: per block, in fp32,
  ``y = float32(q) * float32(s)``, stored to bf16 (one rounding); edge blocks are cut at the matrix edge.
- ``make_fp8_deepseek``: from a tiny bf16 deepseek_v3 checkpoint (``expq.examples.build_example``), an FP8 source
  (every 2-D ``*_proj.weight`` quantized, including attention, dense MLP, shared and routed experts and the MTP
  layer's ``eh_proj``; embeddings, norms, the router ``mlp.gate.weight``, its ``e_score_correction_bias``,
  ``lm_head`` and ``shared_head.head`` left as they are; some scales in a different shard from their weight) and the
  checkpoint the vendor's script would make from it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")


def vendor_quant(w: torch.Tensor, br: int, bc: int,
                 dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``w`` [rows, cols]: returns (codes in ``dtype`` [rows, cols], F32 scales [ceil(rows/br),
    ceil(cols/bc)]), one block at a time."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=dtype)
    s = torch.empty(math.ceil(rows / br), math.ceil(cols / bc), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            x = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].to(torch.float32)
            amax = x.abs().max()
            s[i, j] = amax / FP8_MAX if amax > 0 else 1.0  # (the vendor divides by 0 here; our fixtures never do)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (x / s[i, j]).to(dtype)
    return q, s


def vendor_dequant(q: torch.Tensor, s: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Dequantize FP8 codes ``q`` [rows, cols] with block scales ``s``: one block at a time, the fp32 product of
    the codes and the block's scale stored to bf16."""
    rows, cols = q.shape
    y = torch.empty(rows, cols, dtype=torch.bfloat16)
    for i in range(math.ceil(rows / br)):
        for j in range(math.ceil(cols / bc)):
            blk = q[i * br:(i + 1) * br, j * bc:(j + 1) * bc].to(torch.float32) * s[i, j].to(torch.float32)
            y[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = blk.to(torch.bfloat16)
    return y


def fp8_quantization_config(block: tuple[int, int]) -> dict:
    """``quantization_config`` as DeepSeek-V3 ships it (README_WEIGHTS.md), with the given block size."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def _mtp_layer(tensors: dict[str, torch.Tensor], config: dict, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek's MTP layer ``model.layers.{num_hidden_layers}``: a full MoE decoder layer (shaped like the last
    one) plus ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and ``shared_head.head`` [V, H],
    with fresh N(0, 0.05) values (norms at 1)."""
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {n.replace(f"model.layers.{last}.", f"model.layers.{mtp}.", 1): t.shape
              for n, t in tensors.items() if n.startswith(f"model.layers.{last}.")}
    shapes.update({f"model.layers.{mtp}.enorm.weight": (hidden,), f"model.layers.{mtp}.hnorm.weight": (hidden,),
                   f"model.layers.{mtp}.eh_proj.weight": (hidden, 2 * hidden),
                   f"model.layers.{mtp}.shared_head.norm.weight": (hidden,),
                   f"model.layers.{mtp}.shared_head.head.weight": (vocab, hidden)})
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1 and "norm" in name:
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn(tuple(shape), generator=gen) * 0.05).to(torch.bfloat16)
    return out


def _read_shards(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    shards: dict[str, dict[str, torch.Tensor]] = {f: {} for f in sorted(set(index.values()))}
    for f in shards:
        with safe_open(root / f, "pt") as s:
            for k in s.keys():
                shards[f][k] = s.get_tensor(k)
    return shards


def _write(root: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict, side_from: Path) -> None:
    root.mkdir(parents=True)
    weight_map = {}
    for f, tensors in shards.items():
        save_file(tensors, str(root / f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f))
    total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for p in sorted(side_from.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(p, root / p.name)


def make_fp8_deepseek(bf16_dir: str | Path, out_dir: str | Path, block: tuple[int, int] = (128, 128), *,
                      mtp: bool = True, seed: int = 1) -> tuple[Path, Path]:
    """Make an FP8 DeepSeek-V3-style checkpoint and its vendor-dequantized bf16 twin from a tiny bf16 one.

    Args:
        bf16_dir: a bf16 deepseek_v3 checkpoint with an index (``build_example("deepseek_v3", ...)``); not modified.
        out_dir: a new directory; gets ``fp8/`` and ``vendor-bf16/``.
        block: ``weight_block_size`` (rows, cols).
        mtp: add an MTP layer ``model.layers.{num_hidden_layers}`` (``num_nextn_predict_layers`` set to 1).

    Returns:
        (fp8_dir, vendor_bf16_dir). In fp8_dir every second quantized weight has its ``weight_scale_inv`` in the
        next shard (the last one's in the first); vendor_bf16_dir has the same shards without the scales, each
        quantized weight replaced by ``vendor_dequant`` of its codes, and a config without ``quantization_config``.
    """
    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    br, bc = block
    config = json.loads((bf16_dir / "config.json").read_text())
    assert "quantization_config" not in config, "start from an unquantized checkpoint"
    src = _read_shards(bf16_dir)
    if mtp:
        config["num_nextn_predict_layers"] = 1
        src["model-mtp.safetensors"] = _mtp_layer({k: v for ts in src.values() for k, v in ts.items()}, config, seed)
    files = list(src)
    fp8: dict[str, dict[str, torch.Tensor]] = {f: {} for f in files}
    vendor: dict[str, dict[str, torch.Tensor]] = {f: {} for f in files}
    n_quantized = 0
    for fi, f in enumerate(files):
        for name, t in src[f].items():
            if t.dim() == 2 and QUANTIZED.search(name):
                q, s = vendor_quant(t, br, bc)
                fp8[f][name] = q
                other = files[(fi + 1) % len(files)] if n_quantized % 2 else f
                fp8[other][name + "_scale_inv"] = s
                vendor[f][name] = vendor_dequant(q, s, br, bc)
                n_quantized += 1
            else:
                fp8[f][name] = t
                vendor[f][name] = t
    fp8_dir, vendor_dir = out_dir / "fp8", out_dir / "vendor-bf16"
    _write(fp8_dir, fp8, {**config, "quantization_config": fp8_quantization_config(block)}, bf16_dir)
    _write(vendor_dir, vendor, config, bf16_dir)
    return fp8_dir, vendor_dir


def make_fp8_stacked(bf16_dir: str | Path, out_dir: str | Path, suffixes: tuple[str, ...],
                     block: tuple[int, int] = (16, 16)) -> Path:
    """An FP8 block-scale source of a family with stacked experts: every 3-D tensor ``[E, rows, cols]`` whose name
    ends with one of ``suffixes`` (e.g. granitemoe's ``.input_linear.weight``) quantized expert by expert with
    ``vendor_quant``, its ``weight_scale_inv`` F32 ``[E, ceil(rows/br), ceil(cols/bc)]`` in the same shard; every
    other tensor as it is. Returns the new checkpoint's directory (``out_dir/fp8``)."""
    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    config = json.loads((bf16_dir / "config.json").read_text())
    assert "quantization_config" not in config, "start from an unquantized checkpoint"
    shards = _read_shards(bf16_dir)
    fp8: dict[str, dict[str, torch.Tensor]] = {f: {} for f in shards}
    for f, tensors in shards.items():
        for name, t in tensors.items():
            if t.dim() == 3 and name.endswith(suffixes):
                q, s = zip(*(vendor_quant(t[e], *block) for e in range(t.shape[0])))
                fp8[f][name], fp8[f][name + "_scale_inv"] = torch.stack(q), torch.stack(s)
            else:
                fp8[f][name] = t
    _write(out_dir / "fp8", fp8, {**config, "quantization_config": fp8_quantization_config(block)}, bf16_dir)
    return out_dir / "fp8"

"""compressed-tensors checkpoints made by the compressed-tensors library itself, from expq's tiny bf16 fixtures.

No tests here. The library does every step that defines the format: ``calculate_qparams`` turns each strategy's
min/max into scales (and zero points), the format's compressor (``BaseCompressor.get_value_from_registry(format)``)
``compress``es each module and ``decompress``es it back, and ``ModelCompressor.update_config`` writes the
``quantization_config``. This file only decides which tensors to compress and writes the shards.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
ROUTED_EXPERT = re.compile(r"^(?P<module>.*\.mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
# Kimi-K2-Thinking's ignore list (every Linear but these), plus the router: Qwen3-MoE's mlp.gate is an nn.Linear
KIMI_STYLE_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                     r"re:.*mlp\.gate$"]


def scheme(weights: dict, targets: list[str], fmt: str, input_activations: dict | None = None):
    """A compressed-tensors QuantizationScheme (the library's class) from plain dicts."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    acts = QuantizationArgs(**input_activations) if input_activations else None
    return QuantizationScheme(targets=targets, weights=QuantizationArgs(**weights), input_activations=acts,
                              format=fmt)


def quantization_config(schemes: dict, fmt: str, ignore: list[str]):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups=schemes, format=fmt, quantization_status="compressed", ignore=ignore)


def compress_weight(w: torch.Tensor, sch, *, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One [out, in] weight compressed by the library: scales/zero points from ``calculate_qparams`` over the
    strategy's min/max (computed in ``scale_dtype``, default the weight's), then the format's ``compress``.

    Returns the compressed per-module state dict (local names: weight_packed / weight, weight_scale, ...).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = sch.weights
    x = w.to(scale_dtype) if scale_dtype is not None else w
    out, cols = x.shape
    if args.strategy == "tensor":
        lo, hi = x.amin().reshape(1), x.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    elif args.strategy == "group":
        g = x.reshape(out, cols // args.group_size, args.group_size)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    elif args.strategy == "block":
        b0, b1 = args.block_structure
        blk = x.reshape(out // b0, b0, cols // b1, b1)
        lo, hi = blk.amin(dim=(1, 3)), blk.amax(dim=(1, 3))
    else:
        raise ValueError(args.strategy)
    scale, zp = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    return dict(BaseCompressor.get_value_from_registry(sch.format).compress(state, sch))


def decompress_weight(compressed: dict[str, torch.Tensor], sch) -> torch.Tensor:
    """The library's own decompression of one module (the format's ``decompress``)."""
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(sch.format).decompress(dict(compressed), sch)["weight"]


def write_config(src_dir: Path, out_dir: Path, qc=None) -> None:
    """Copy config.json; with ``qc``, add its quantization_config through ``ModelCompressor.update_config``."""
    shutil.copy(src_dir / "config.json", out_dir / "config.json")
    if qc is not None:
        from compressed_tensors.compressors import ModelCompressor

        ModelCompressor(quantization_config=qc).update_config(str(out_dir))


def _shard_names(src_dir: Path) -> dict[str, list[str]]:
    idx = src_dir / INDEX
    if idx.is_file():
        files: dict[str, list[str]] = {}
        for name, f in json.loads(idx.read_text())["weight_map"].items():
            files.setdefault(f, []).append(name)
        return files
    return {"model.safetensors": list(load_file(src_dir / "model.safetensors"))}


def compress_checkpoint(src_dir: Path, ct_dir: Path, dec_dir: Path, pick: Callable[[str], str | None], sch, qc,
                        **kw) -> tuple[Path, Path]:
    """Write ``ct_dir`` (``src_dir`` with every weight ``pick`` maps to a module compressed by ``sch``) and
    ``dec_dir`` (the same weights decompressed by the library, in the source dtype; no quantization_config).
    Shards, tensor names and side files follow ``src_dir``. ``kw`` goes to ``compress_weight``."""
    for d in (ct_dir, dec_dir):
        d.mkdir(parents=True, exist_ok=True)
    ct_map, dec_map, ct_total, dec_total = {}, {}, 0, 0
    for fname, names in sorted(_shard_names(src_dir).items()):
        tensors = load_file(src_dir / fname)
        ct, dec = {}, {}
        for name in names:
            t = tensors[name]
            module = pick(name)
            if module is None:
                ct[name] = dec[name] = t
                continue
            comp = compress_weight(t, sch, **kw)
            for local, v in comp.items():
                ct[f"{module}.{local}"] = v.contiguous()
            dec[name] = decompress_weight(comp, sch).to(t.dtype).contiguous()
        save_file(ct, ct_dir / fname, metadata={"format": "pt"})
        save_file(dec, dec_dir / fname, metadata={"format": "pt"})
        ct_map.update({n: fname for n in ct})
        dec_map.update({n: fname for n in dec})
        ct_total += sum(v.numel() * v.element_size() for v in ct.values())
        dec_total += sum(v.numel() * v.element_size() for v in dec.values())
    for d, m, total in ((ct_dir, ct_map, ct_total), (dec_dir, dec_map, dec_total)):
        (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": m}, indent=2))
    for p in src_dir.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (INDEX, "config.json"):
            shutil.copy(p, ct_dir / p.name)
            shutil.copy(p, dec_dir / p.name)
    write_config(src_dir, ct_dir, qc)
    write_config(src_dir, dec_dir)
    return ct_dir, dec_dir


def routed_expert_module(name: str) -> str | None:
    m = ROUTED_EXPERT.match(name)
    return m.group("module") if m else None


def make_ct_int4_source(bf16_dir: str | Path, out_dir: str | Path, group_size: int = 16) -> tuple[Path, Path]:
    """Kimi-K2-style INT4 release of a tiny bf16 fixture (``expq.examples.build_example("qwen3_moe", ...)``: H=64,
    I=48): only the routed experts are INT4 pack-quantized, symmetric, group ``group_size``; attention, routers,
    norms, embeddings and lm_head stay bf16. The config is Kimi-K2-Thinking's (targets ``Linear`` and an ignore
    list).

    Returns:
        (ct_dir, decompressed_bf16_dir): the compressed-tensors checkpoint, and the bf16 checkpoint obtained by
        decompressing it with the library (config without quantization_config).
    """
    bf16_dir, out_dir = Path(bf16_dir), Path(out_dir)
    sch = scheme(dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                      dynamic=False), ["Linear"], "pack-quantized")
    qc = quantization_config({"group_0": sch}, "pack-quantized", KIMI_STYLE_IGNORE)
    return compress_checkpoint(bf16_dir, out_dir / "ct-int4", out_dir / "ct-int4-decompressed",
                               routed_expert_module, sch, qc)


def max_abs_error_bound(w: torch.Tensor, sch, compressed: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per element, the largest |w - decompress(compress(w))| the scheme allows (fp32): half a step of the element's
    scale (plus the clamp of the top code against a rounded scale) for int; the e4m3 relative half-ulp (2^-4) plus
    the subnormal step for fp8; plus one rounding of the product to the weight's dtype."""
    args = sch.weights
    s = compressed["weight_scale"].float()
    out, cols = w.shape
    if args.strategy == "group":
        s = s.repeat_interleave(args.group_size, dim=1)
    elif args.strategy == "block":
        b0, b1 = args.block_structure
        s = s.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    s = s.expand(out, cols)
    a = w.float().abs()
    rnd = a * torch.finfo(w.dtype).eps  # one rounding to the dtype, with room for the scale product
    if args.type == "int":
        return s * (0.5 + 2.0 ** -5) + rnd
    return a * 2.0 ** -4 + s * 2.0 ** -10 + rnd





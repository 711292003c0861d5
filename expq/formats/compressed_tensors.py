"""The compressed-tensors ``pack-quantized`` W8A16 channel format, as stock vLLM and transformers load it.

Per routed-expert projection module ``M`` (e.g. ``model.layers.3.mlp.experts.7.gate_proj``):

* ``M.weight_packed`` int32 ``[out, ceil(in/4)]``: the int8 codes packed by compressed-tensors' own
  ``pack_to_int32(codes, 8)`` (each code stored as ``code + 128``, four per word, lowest column in the lowest byte);
* ``M.weight_scale`` ``[out, 1]`` in the compute dtype (2-D: vLLM copies it into ``w13_weight_scale`` as such). The
  experts_int8 scales are values of the compute dtype, so this is lossless;
* ``M.weight_shape`` int64 ``[2]``: ``(out, in)``, as compressed-tensors writes it.

The ``quantization_config`` is built with compressed-tensors' config classes and serialised by its
``ModelCompressor`` (the library's own writer), never re-quantized through its quantizer (its scheme differs:
absmax/127.5, range [-128, 127]). Its weights are ``{num_bits: 8, type: int, symmetric: true, strategy: channel,
group_size: -1, dynamic: false}``: vLLM 0.24-0.28 assert ``group_size == -1`` for 8-bit channel-wise.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

NAME = "compressed-tensors"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
PACK_BLOCK = 1 << 19  # elements per packing call on a CPU (measured best: 256K-1M, see docs/benchmarks.md)


def tensor_specs(module: str, rows: int, cols: int, compute_dtype: torch.dtype) -> list[tuple[str, torch.dtype,
                                                                                               tuple[int, ...]]]:
    """Names, dtypes and shapes of the tensors one quantized projection becomes (in write order)."""
    return [
        (f"{module}.weight_packed", torch.int32, (rows, math.ceil(cols / 4))),
        (f"{module}.weight_scale", compute_dtype, (rows, 1)),
        (f"{module}.weight_shape", torch.int64, (2,)),
    ]


@cache
def packing_functions():
    """compressed-tensors' own ``(pack_to_int32, unpack_from_int32)``.

    The library's package import pulls in transformers (about 2 s); its packing helpers need only torch. Where the
    package is not imported yet, the helpers module is loaded from the installed library by its file path, so a
    conversion does not pay for transformers on its hot path; it is the library's code either way.
    """
    if "compressed_tensors" not in sys.modules:
        spec = importlib.util.find_spec("compressed_tensors")
        if spec is not None and spec.submodule_search_locations:
            path = Path(spec.submodule_search_locations[0]) / "compressors" / "pack_quantized" / "helpers.py"
            if path.is_file():
                mspec = importlib.util.spec_from_file_location("_expq_compressed_tensors_pack_helpers", path)
                mod = importlib.util.module_from_spec(mspec)
                mspec.loader.exec_module(mod)
                return mod.pack_to_int32, mod.unpack_from_int32
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    except ImportError:  # compressed-tensors < 0.19 kept them here
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (  # type: ignore
            pack_to_int32, unpack_from_int32)
    return pack_to_int32, unpack_from_int32


def _by_row_blocks(x: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, fn, cols: int | None = None):
    """``fn(x)``, computed on blocks of about PACK_BLOCK elements of rows when on a CPU (per-row functions only)."""
    cols = x.shape[1] if cols is None else cols
    if x.device.type != "cpu" or shape[0] * cols <= PACK_BLOCK:
        return fn(x)
    out = torch.empty(shape, dtype=dtype)
    step = max(1, PACK_BLOCK // cols)
    for i in range(0, shape[0], step):
        out[i:i + step] = fn(x[i:i + step])
    return out


def encode(codes: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
    """Turn int8 codes [rows, in] and scales [rows] (compute dtype) into the format's tensors, in
    ``tensor_specs`` order, for a batch of matrices stacked by rows (packing is per row, so a batch packs as one).

    Returns:
        [weight_packed int32 [rows, ceil(in/4)], weight_scale [rows, 1], weight_shape int64 [2]] (on codes' device;
        ``weight_shape`` is (rows, in) of the whole batch: callers slice per matrix and rebuild it).
    """
    pack_to_int32, _ = packing_functions()
    rows, cols = codes.shape
    # packing is per row: blocks of rows give the same words, about 4x faster on a CPU (they stay in cache)
    packed = _by_row_blocks(codes, (rows, math.ceil(cols / 4)), torch.int32, lambda blk: pack_to_int32(blk, 8))
    return [packed, scales.unsqueeze(1), torch.tensor([rows, cols], dtype=torch.int64)]


def decode(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``encode`` for one module: (codes int8 [out, in], scales [out] in the stored dtype).

    Raises:
        ValueError: the tensors do not fit together (shape, dtype).
    """
    _, unpack_from_int32 = packing_functions()
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be int32 2-D, got {packed.dtype} {list(packed.shape)}")
    if shape.numel() != 2:
        raise ValueError(f"weight_shape must hold 2 values, got {shape.tolist()}")
    out, cols = (int(x) for x in shape.tolist())
    if packed.shape[0] != out or packed.shape[1] != math.ceil(cols / 4):
        raise ValueError(f"weight_packed {list(packed.shape)} does not fit weight_shape {[out, cols]}")
    if scale.shape not in ((out, 1), (out,)):
        raise ValueError(f"weight_scale {list(scale.shape)} does not fit {out} rows")
    codes = _by_row_blocks(packed, (out, cols), torch.int8,  # bounded int32 temporaries
                           lambda blk: unpack_from_int32(blk, 8, torch.Size([blk.shape[0], cols])), cols)
    return codes, scale.reshape(out)


def targets_regex(names: list[str], container: str = "experts") -> str:
    """The ``targets`` entry matching routed-expert projection modules: ``re:.*experts\\.\\d+\\.(names)$``.

    vLLM 0.24 asks for ``<moe layer>.0.gate_proj`` / ``.up_proj`` / ``.down_proj`` whatever the model calls its
    experts (and its layer name ends in ``experts.routed_experts``), newer vLLM and transformers use the model's
    own names: the pattern carries both. Shared experts (``shared_expert(s).gate_proj``: no index) never match.
    ``container`` is the module path right before the expert index (a layout's ``output.targets_container``).
    """
    alts = sorted(set(names) | {"gate_proj", "up_proj", "down_proj"})
    return "re:.*" + re.escape(container) + r"\.\d+\.(" + "|".join(re.escape(a) for a in alts) + r")$"


def quantization_config(targets: list[str], ignore: list[str]) -> dict:
    """The ``quantization_config`` dict for config.json, built with compressed-tensors' classes and serialised
    by its ``ModelCompressor.update_config`` (so the fields are exactly those the installed library writes)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", group_size=-1,
                               dynamic=False)
    scheme = QuantizationScheme(targets=targets, weights=weights, format="pack-quantized")
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=ignore)
    with tempfile.TemporaryDirectory() as d:
        ModelCompressor(quantization_config=qc).update_config(d)
        return json.loads((Path(d) / "config.json").read_text())["quantization_config"]


def module_matches(name: str, targets: list[str], ignore: list[str], is_linear: bool = True) -> bool:
    """Whether a module is quantized by this config: it matches a target (a ``re:`` pattern, its exact name, or the
    class name ``Linear`` for a linear module) and no ``ignore`` entry (same forms). Used by ``verify`` to check that
    the targets cover exactly the quantized modules."""
    def hit(pats: list[str]) -> bool:
        for p in pats:
            if p.startswith("re:"):
                if re.match(p[3:], name):
                    return True
            elif p == name or (p == "Linear" and is_linear):
                return True
        return False

    return hit(targets) and not hit(ignore)

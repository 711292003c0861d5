"""The compressed-tensors ``pack-quantized`` W8A16 channel format, as stock vLLM and transformers load it.

Per routed-expert projection module ``M`` (e.g. ``model.layers.3.mlp.experts.7.gate_proj``):

* ``M.weight_packed`` int32 ``[out, ceil(in/4)]``: the int8 codes packed as compressed-tensors'
  ``pack_to_int32(codes, 8)`` packs them (each code stored as the byte ``code + 128``, four per word, lowest column
  in the lowest byte, a row's last word padded with zero bytes). On a little-endian machine those words are the
  codes' own bytes with the top bit flipped (``b ^ 0x80 == (code + 128) mod 256``), so ``pack_codes`` writes them
  as such, in one pass on any device (``tests/test_scheme.py`` checks it against the library, word for word);
* ``M.weight_scale`` ``[out, 1]`` in the compute dtype (2-D: vLLM copies it into ``w13_weight_scale`` as such). The
  experts_int8 scales are values of the compute dtype, so this is lossless;
* ``M.weight_shape`` int64 ``[2]``: ``(out, in)``, as compressed-tensors writes it (known at plan time: a constant
  ``TensorSpec.value``, written when the shard is opened).

The ``quantization_config`` is built with compressed-tensors' config classes and dumped as its ``ModelCompressor``
writes it, never re-quantized through its quantizer (its scheme differs: absmax/127.5, range [-128, 127]). Its
weights are ``{num_bits: 8, type: int, symmetric: true, strategy: channel, group_size: -1, dynamic: false}``: vLLM
0.24-0.28 assert ``group_size == -1`` for 8-bit channel-wise. Name matching (targets / ignore) is the library's own.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
import sys
from typing import ClassVar, Mapping, Sequence

import torch

from ..engines.clients import Client, stock_w8a16_clients
from ..experts import ExpertMap, Matrix, TensorLike
from ..io.safetensors import dtype_name
from ..layouts import Layout
from .base import ReadByName, TensorRole, TensorSpec

PACK_BLOCK = 1 << 19  # elements per packing call on a CPU (measured best: 256K-1M, see docs/benchmarks.md)
# vLLM 0.24 looks a MoE layer's experts up as `<layer>.0.gate_proj / up_proj / down_proj` whatever the model calls
# them (docs/research-vllm-names.md): the targets pattern carries these names too.
VLLM_024_NAMES = ("gate_proj", "up_proj", "down_proj")
_LINEAR = torch.nn.Linear(1, 1, device="meta")  # the class compressed-tensors matches the "Linear" target against


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [rows, cols] -> int32 words [rows, ceil(cols/4)], exactly ``pack_to_int32(codes, 8)`` of
    compressed-tensors, on the codes' device, in one pass over the bytes (the library's own function on a
    big-endian machine).

    ``codes`` (contiguous) is consumed: when ``cols`` is a multiple of 4 its buffer becomes the words.
    """
    rows, cols = codes.shape
    if sys.byteorder != "little":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        return pack_to_int32(codes.cpu(), 8).to(codes.device)
    if cols % 4 == 0:
        return codes.view(torch.uint8).bitwise_xor_(0x80).view(torch.int32)
    out = torch.zeros((rows, math.ceil(cols / 4) * 4), dtype=torch.uint8, device=codes.device)
    torch.bitwise_xor(codes.view(torch.uint8), 0x80, out=out[:, :cols])
    return out.view(torch.int32)


def _by_row_blocks(x: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, fn, cols: int | None = None):
    """``fn(x)``, computed on blocks of about PACK_BLOCK elements of rows when on a CPU (per-row functions only:
    blocks of rows stay in cache, about 4x faster than one call, and give the same words)."""
    cols = x.shape[1] if cols is None else cols
    if x.device.type != "cpu" or shape[0] * cols <= PACK_BLOCK:
        return fn(x)
    out = torch.empty(shape, dtype=dtype)
    step = max(1, PACK_BLOCK // cols)
    for i in range(0, shape[0], step):
        out[i:i + step] = fn(x[i:i + step])
    return out


class CompressedTensorsFormat:
    """compressed-tensors pack-quantized, 8-bit int, symmetric, channel-wise, weight-only (W8A16).

    Args:
        experts: the model's expert map. compute_dtype: the scales' dtype.
    """

    name: ClassVar[str] = "compressed-tensors"
    quant_method: ClassVar[str] = "compressed-tensors"
    expq_loads: ClassVar[bool] = False  # stock clients: transformers' own compressed-tensors quantizer, vLLM, SGLang
    suffixes: ClassVar[Mapping[str, str]] = {"packed": "weight_packed", "scale": "weight_scale",
                                             "shape": "weight_shape"}

    def __init__(self, experts: ExpertMap, compute_dtype: torch.dtype):
        self.experts = experts
        self.compute_dtype = compute_dtype

    # --- writing --------------------------------------------------------------------------------------------------
    def tensor_specs(self, matrix: Matrix) -> list[TensorSpec]:
        """``weight_packed`` I32 [out, ceil(in/4)], ``weight_scale`` [out, 1] in the compute dtype,
        ``weight_shape`` I64 [2]."""
        m = matrix.module
        shape = torch.tensor([matrix.rows, matrix.cols], dtype=torch.int64).numpy().tobytes()
        return [TensorSpec(f"{m}.weight_packed", "I32", (matrix.rows, math.ceil(matrix.cols / 4))),
                TensorSpec(f"{m}.weight_scale", dtype_name(self.compute_dtype), (matrix.rows, 1)),
                TensorSpec(f"{m}.weight_shape", "I64", (2,), value=shape)]

    def encode(self, codes: torch.Tensor, scales: torch.Tensor,
               matrices: Sequence[Matrix]) -> list[list[tuple[TensorSpec, torch.Tensor]]]:
        """Pack the batch once (packing is per row), then cut it per matrix. See ``Format.encode``."""
        packed = pack_codes(codes)
        scale2d = scales.to(self.compute_dtype).unsqueeze(1)
        out, r0 = [], 0
        for m in matrices:
            sl = slice(r0, r0 + m.rows)
            r0 += m.rows
            p_spec, s_spec, _ = self.tensor_specs(m)
            out.append([(p_spec, packed[sl]), (s_spec, scale2d[sl])])
        return out

    def describe(self) -> str:
        """One sentence for the model card: how the codes and scales are stored."""
        dt = str(self.compute_dtype).removeprefix("torch.")
        return ("Stored as compressed-tensors `pack-quantized` (8-bit int, `strategy: channel`, `group_size: -1`): "
                f"per expert projection `weight_packed` int32, `weight_scale` [out, 1] in {dt}, `weight_shape`.")

    # --- reading --------------------------------------------------------------------------------------------------
    def decode(self, module: str, read: ReadByName) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpack one module with compressed-tensors' ``unpack_from_int32``. See ``Format.decode``."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed, scale, shape = (read(f"{module}.{s}") for s in self.suffixes.values())
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
                               lambda b: unpack_from_int32(b, 8, torch.Size([b.shape[0], cols])), cols)
        return codes, scale.reshape(out)

    def classify(self, name: str) -> TensorRole | None:
        """``(layer, expert, proj, "packed" | "scale" | "shape")`` for an expert tensor, else None. See
        ``Format.classify``."""
        module, _, suffix = name.rpartition(".")
        role = next((r for r, s in self.suffixes.items() if s == suffix), None)
        key = self.experts.parse_module(module) if role is not None else None
        return None if key is None else TensorRole(*key, role)

    def quantized_modules(self, names: Sequence[str]) -> dict[tuple[int, int, str], str]:
        return self.experts.modules_with(names, "weight_packed")

    def clients(self, layout: Layout, hidden_size: int | None, *, local: bool = False) -> list[Client]:
        """Stock vLLM and SGLang (their W8A16 MoE on Marlin), stock transformers, ``expq.load_model``. See
        ``Format.clients``."""
        return stock_w8a16_clients(self, layout, hidden_size, local=local)

    # --- quantization_config --------------------------------------------------------------------------------------
    def targets(self) -> list[str]:
        """One regex matching exactly the routed-expert modules: ``re:.*<container>\\.\\d+\\.(names)$``, with the
        layout's output names and vLLM 0.24's; shared experts (no index) never match."""
        alts = sorted(set(self.experts.output_projection_names) | set(VLLM_024_NAMES))
        container = self.experts.layout.targets_container
        return ["re:.*" + re.escape(container) + r"\.\d+\.(" + "|".join(re.escape(a) for a in alts) + r")$"]

    def ignore(self, tensors: Mapping[str, TensorLike]) -> list[str]:
        """Every other linear module (and ``lm_head`` when tied embeddings leave it without a tensor), sorted."""
        ignore = self.experts.linear_modules(tensors)
        if "lm_head" not in ignore and not any(n.startswith("lm_head.") for n in tensors):
            ignore.append("lm_head")
        return sorted(ignore)

    def quantization_config(self, tensors: Mapping[str, TensorLike]) -> dict:
        """What compressed-tensors' ``ModelCompressor.update_config`` writes for this scheme (version, quant_method,
        empty sparsity and transform configs, the ``QuantizationConfig`` fields; keys sorted).

        Written out here rather than built with the library's classes: importing compressed-tensors takes about 3 s
        (it imports transformers), longer than converting a small model. ``tests/test_scheme.py`` checks that this
        equals the library's own dump key for key, and ``verify`` validates it with the library.
        """
        weights = {"dynamic": False, "group_size": -1, "num_bits": 8, "strategy": "channel", "symmetric": True,
                   "type": "int"}
        group = {"format": "pack-quantized", "input_activations": None, "output_activations": None,
                 "targets": self.targets(), "weights": weights}
        return {"config_groups": {"group_0": group}, "format": "pack-quantized", "global_compression_ratio": None,
                "ignore": self.ignore(tensors), "kv_cache_scheme": None, "moe_sparsity_config": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
                "transform_config": {}, "version": importlib.metadata.version("compressed-tensors")}

    def check_model(self, config: dict, *, use_cache: bool = True) -> list[str]:
        """Nothing to check against the model class (see ``Format.check_model``)."""
        return []

    def check_config(self, config: dict, tensors: Mapping[str, TensorLike]) -> list[str]:
        """The config validates with compressed-tensors, is pack-quantized 8-bit int channel-wise weight-only, and
        its targets (matched with the library's own ``is_match``) cover exactly the quantized modules."""
        from compressed_tensors.quantization import QuantizationConfig
        from compressed_tensors.utils import is_match

        try:
            parsed = QuantizationConfig.model_validate(config)
        except Exception as e:  # noqa: BLE001 - any validation failure is the finding
            return [f"quantization_config does not validate with compressed-tensors: {str(e).splitlines()[0]}"]
        bad = []
        if config.get("quant_method") != "compressed-tensors" or config.get("format") != "pack-quantized":
            bad.append(f"quantization_config: quant_method/format {config.get('quant_method')}/"
                       f"{config.get('format')}, expected compressed-tensors/pack-quantized")
        if config.get("quantization_status") != "compressed":
            bad.append("quantization_config: quantization_status must be 'compressed'")
        want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": -1}
        targets: list[str] = []
        for g in parsed.config_groups.values():
            w = g.weights
            got = {"num_bits": w.num_bits, "type": str(getattr(w.type, "value", w.type)), "symmetric": w.symmetric,
                   "strategy": str(getattr(w.strategy, "value", w.strategy)), "group_size": w.group_size}
            if got != want:
                bad.append(f"quantization_config weights {got}, expected {want}")
            if g.input_activations is not None:
                bad.append("quantization_config quantizes activations; experts_int8 is weight-only (W8A16)")
            targets += list(g.targets)
        ignore = list(parsed.ignore or [])
        quantized = set(self.quantized_modules(list(tensors)).values())
        linear = {n.rsplit(".", 1)[0] for n, t in tensors.items()
                  if (n.endswith(".weight") and len(t.shape) == 2) or n.endswith(".weight_packed")}
        matched = {m for m in linear if is_match(m, _LINEAR, targets, ignore)}
        extra, unmatched = sorted(matched - quantized), sorted(quantized - matched)
        if extra:
            bad.append(f"quantization_config targets match {len(extra)} modules that are not quantized, e.g. "
                       f"{extra[0]}")
        if unmatched:
            bad.append(f"quantization_config targets miss {len(unmatched)} quantized modules, e.g. {unmatched[0]}")
        return bad

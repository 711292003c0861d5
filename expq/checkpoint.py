"""Reading a converted checkpoint back: its layout, MoE layers and per-expert modules, and each layer's routed
experts assembled in vLLM's experts_int8 layout (what ``verify`` checks and the runtime loader runs).

experts_int8 layout (vLLM ``ExpertsInt8MoEMethod``): ``w13`` int8 [E, 2I, H] (gate rows, then up rows),
``w2`` int8 [E, H, I], ``w13_scale`` fp32 [E, 2I], ``w2_scale`` fp32 [E, H]; plus, where the family has them,
expert biases ``w13_bias`` [E, 2I] (same row order) and ``w2_bias`` [E, H].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LayoutError, SourceError
from .formats import compressed_tensors as ct
from .layouts import Layout, builtin_layouts, config_lookup, detect_layout, moe_layer_indices, parse_layout
from .source import INDEX_NAME, SINGLE_NAME, Shard, TensorInfo, read_header, read_tensor
from .writer import MANIFEST

PROJ = ("gate", "up", "down")


@dataclass
class LayerExperts:
    """One MoE layer's routed experts in the experts_int8 layout (CPU tensors)."""

    layer: int
    w13: torch.Tensor  # int8 [E, 2I, H]
    w2: torch.Tensor  # int8 [E, H, I]
    w13_scale: torch.Tensor  # fp32 [E, 2I]
    w2_scale: torch.Tensor  # fp32 [E, H]
    w13_bias: torch.Tensor | None = None  # [E, 2I]
    w2_bias: torch.Tensor | None = None  # [E, H]
    scale_dtype: torch.dtype = torch.bfloat16  # dtype the scales are stored in

    def as_dict(self) -> dict:
        d = {"w13_weight": self.w13, "w2_weight": self.w2, "w13_scale": self.w13_scale, "w2_scale": self.w2_scale}
        if self.w13_bias is not None:
            d["w13_bias"] = self.w13_bias
        if self.w2_bias is not None:
            d["w2_bias"] = self.w2_bias
        return d


class ConvertedCheckpoint:
    """A checkpoint written by ``expq convert`` (read-only): headers, index, config, manifest and layout.

    Args:
        path: the output directory.

    Raises:
        SourceError: no config.json, no quantization_config, or unreadable shard headers.
        LayoutError: the architecture has no layout.
    """

    def __init__(self, path: str | Path):
        self.root = Path(path)
        cfg_path = self.root / "config.json"
        if not cfg_path.is_file():
            raise SourceError("no config.json: not a checkpoint directory", file=str(self.root))
        try:
            self.config = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"not valid JSON: {e}", file="config.json") from None
        self.quantization_config = self.config.get("quantization_config")
        if not isinstance(self.quantization_config, dict):
            raise SourceError("config.json has no quantization_config: not a converted checkpoint",
                              file="config.json")
        mpath = self.root / MANIFEST
        self.manifest = json.loads(mpath.read_text()) if mpath.is_file() else {}
        self.layout = self._layout()
        idx = self.root / INDEX_NAME
        if idx.is_file():
            try:
                self.index = json.loads(idx.read_text())
                self.weight_map: dict[str, str] = self.index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SourceError("not a valid safetensors index", file=INDEX_NAME) from None
            files = sorted(set(self.weight_map.values()))
        elif (self.root / SINGLE_NAME).is_file():
            self.index, self.weight_map, files = None, None, [SINGLE_NAME]
        else:
            raise SourceError("no model.safetensors or index", file=str(self.root))
        self.shards: dict[str, Shard] = {}
        self.missing_files: list[str] = []
        for f in files:
            if (self.root / f).is_file():
                self.shards[f] = read_header(self.root / f, f)
            else:
                self.missing_files.append(f)
        self.tensors: dict[str, TensorInfo] = {}
        for sh in self.shards.values():
            for t in sh.tensors:
                self.tensors.setdefault(t.name, t)
        self.num_layers = int(config_lookup(self.config, self.layout.keys["num_layers"])[0])
        self.num_experts = int(config_lookup(self.config, self.layout.keys["num_experts"])[0])
        self.hidden_size = _int(config_lookup(self.config, self.layout.keys["hidden_size"])[0])
        self.intermediate_size = _int(config_lookup(self.config, self.layout.keys["intermediate_size"])[0])
        self.top_k = _int(config_lookup(self.config, self.layout.keys["top_k"])[0])
        self.moe_layers = moe_layer_indices(self.layout, self.config, self.num_layers)
        self.modules = self._find_modules()

    def _layout(self) -> Layout:
        """The layout the checkpoint was made with: carried in expq.json (a user's ``--layout`` file too), else the
        built-in layout of that name, else detected from config.json."""
        text = self.manifest.get("layout_toml")
        if text:
            return parse_layout(text, f"{self.root / MANIFEST} (layout_toml)")
        name = self.manifest.get("options", {}).get("layout")
        if name:
            for lay in builtin_layouts():
                if lay.name == name:
                    return lay
        return detect_layout(self.config)[0]

    def _find_modules(self) -> dict[tuple[int, int, str], str]:
        """(layer, expert, proj) -> output module name, for every quantized module present."""
        lay = self.layout
        mod = re.escape(lay.out_module).replace(re.escape("{expert}"), r"(?P<expert>\d+)")
        names = {v: k for k, v in lay.out_names.items()}
        pat = re.compile(rf"^(?P<prefix>(?:.*\.)?){re.escape(lay.layers)}\.(?P<layer>\d+)\.{mod}\."
                         rf"(?P<proj>{'|'.join(re.escape(n) for n in names)})\.weight_packed$")
        out = {}
        for name in self.tensors:
            m = pat.match(name)
            if m and int(m["layer"]) < self.num_layers:
                out[(int(m["layer"]), int(m["expert"]), names[m["proj"]])] = name[: -len(".weight_packed")]
        return out

    @property
    def prefix(self) -> str:
        for (L, e, p), module in self.modules.items():
            return module[: module.index(f"{self.layout.layers}.{L}.")]
        return ""

    def expected_modules(self) -> dict[tuple[int, int, str], str]:
        """Every (layer, expert, proj) the config says exists, with the module name it must have."""
        return {(L, e, p): self.layout.out_module_name(self.prefix, L, e, p)
                for L in self.moe_layers for e in range(self.num_experts) for p in PROJ}

    @property
    def scale_dtype(self) -> torch.dtype:
        from .scheme import COMPUTE_DTYPES

        name = self.manifest.get("options", {}).get("dtype")
        if name in COMPUTE_DTYPES:
            return COMPUTE_DTYPES[name]
        any_scale = next((t for n, t in self.tensors.items() if n.endswith(".weight_scale")), None)
        from .source import TORCH_DTYPES
        return TORCH_DTYPES.get(any_scale.dtype, torch.bfloat16) if any_scale else torch.bfloat16

    def read(self, name: str) -> torch.Tensor:
        """One tensor by name (one read; raises SourceError if absent)."""
        info = self.tensors.get(name)
        if info is None:
            raise SourceError("tensor not found in any shard", tensor=name)
        return read_tensor(self.root, info)

    def module_codes(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [out, in], scales [out] in the stored dtype) of one quantized module.

        Raises:
            SourceError: a tensor is missing or the three do not fit together.
        """
        try:
            return ct.decode(self.read(module + ".weight_packed"), self.read(module + ".weight_scale"),
                             self.read(module + ".weight_shape"))
        except ValueError as e:
            raise SourceError(str(e), tensor=module) from None

    def layer_experts(self, layer: int) -> LayerExperts:
        """Assemble one MoE layer's experts in the experts_int8 layout.

        Raises:
            SourceError / LayoutError: a module is missing or shapes disagree (names the module).
        """
        E = self.num_experts
        w13 = w2 = w13_scale = w2_scale = None
        scale_dtype = None
        for e in range(E):  # decoded straight into the layer's tensors: no per-expert lists, no stacking copies
            for p in PROJ:
                module = self.modules.get((layer, e, p))
                if module is None:
                    raise LayoutError(f"layer {layer}: {p} projection missing",
                                      expert=e, tensor=self.layout.out_module_name(self.prefix, layer, e, p))
                c, s = self.module_codes(module)
                if w13 is None and p == "gate":
                    I, H = c.shape
                    w13 = torch.empty(E, 2 * I, H, dtype=torch.int8)
                    w2 = torch.empty(E, H, I, dtype=torch.int8)
                    w13_scale = torch.empty(E, 2 * I, dtype=torch.float32)
                    w2_scale = torch.empty(E, H, dtype=torch.float32)
                    scale_dtype = s.dtype
                if w13 is None:
                    raise LayoutError(f"layer {layer}: gate projection must come first", expert=e, tensor=module)
                I = w13.shape[1] // 2
                want = (H, I) if p == "down" else (I, w13.shape[2])
                if tuple(c.shape) != want:
                    raise LayoutError(f"layer {layer}: {p} has shape {list(c.shape)}, expected {list(want)}",
                                      expert=e, tensor=module)
                if p == "down":
                    w2[e].copy_(c)
                    w2_scale[e].copy_(s)
                else:
                    rows = slice(0, I) if p == "gate" else slice(I, 2 * I)
                    w13[e, rows].copy_(c)
                    w13_scale[e, rows].copy_(s)
        res = LayerExperts(layer, w13, w2, w13_scale, w2_scale, scale_dtype=scale_dtype)
        if self.layout.expert_biases:
            res.w13_bias, res.w2_bias = self._biases(layer)
        return res

    def _biases(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """GPT-OSS-style expert biases, re-ordered to the w13 row order (gate rows then up rows)."""
        base = f"{self.prefix}{self.layout.layers}.{layer}.{self.layout.module}."
        gu_name, d_name = (base + b for b in self.layout.expert_biases)
        gu = self.read(gu_name) if gu_name in self.tensors else None
        d = self.read(d_name) if d_name in self.tensors else None
        if gu is not None:
            st = self.layout.stacked.get("gate_up")
            if st is not None and st.order == "interleaved":
                gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
        return gu, d


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None

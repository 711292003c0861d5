"""Reading a converted checkpoint back: its manifest, layout, expert map and format, and each layer's routed experts
assembled in vLLM's experts_int8 layout (what ``verify`` checks and the runtime loader runs).

experts_int8 layout (vLLM ``ExpertsInt8MoEMethod``): ``w13`` int8 [E, 2I, H] (gate rows, then up rows),
``w2`` int8 [E, H, I], ``w13_scale`` fp32 [E, 2I], ``w2_scale`` fp32 [E, H]; plus, where the family has them,
expert biases ``w13_bias`` [E, 2I] (same row order) and ``w2_bias`` [E, H].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LayoutError, SourceError
from .experts import ExpertMap, w13_rows
from .formats import FORMATS, Format, format_for_quant_method, get_format
from .layouts import Layout, builtin_layout, detect_layout, parse_layout
from .manifest import MANIFEST, Manifest, ManifestFile, manifest_intact
from .io.index import INDEX_NAME, SINGLE_NAME, Index, read_index
from .io.safetensors import TORCH_DTYPES, Shard, TensorInfo, read_header, read_tensor
from .scheme import COMPUTE_DTYPES
from .source import read_config, refuse_links_out


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

    def matrix(self, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [out, in], scales fp32 [out]) of one projection: gate rows [0, I) and up rows [I, 2I) of
        w13, or w2."""
        if proj == "down":
            return self.w2[expert], self.w2_scale[expert]
        rows = w13_rows(proj, self.w2.shape[2])
        return self.w13[expert, rows], self.w13_scale[expert, rows]

    def as_dict(self) -> dict:
        d = {"w13_weight": self.w13, "w2_weight": self.w2, "w13_scale": self.w13_scale, "w2_scale": self.w2_scale}
        if self.w13_bias is not None:
            d["w13_bias"] = self.w13_bias
        if self.w2_bias is not None:
            d["w2_bias"] = self.w2_bias
        return d


class ConvertedCheckpoint:
    """A checkpoint written by ``expq convert`` (read-only), read once through the bytes floor: config.json,
    expq.json (and whether it is the one config.json records), the index, every shard's header; then its layout,
    expert map and format. Tensors are read on demand.

    Attributes:
        root, config, quantization_config; manifest (None: no expq.json); manifest_problem (None when expq.json is
        the one config.json records, else why not: ``manifest.manifest_intact``); index (None: a single
        ``model.safetensors``); shards (file -> Shard, every header), missing_files (shards the index names that
        are not there), tensors (name -> TensorInfo); layout, experts (ExpertMap), format, scale_dtype, modules
        ((layer, expert, proj) -> quantized module name).

    Args:
        path: the output directory.

    Raises:
        SourceError: no config.json, no quantization_config, an unreadable index, manifest or shard header.
        LayoutError: the architecture has no layout, or its config numbers are not valid.
    """

    def __init__(self, path: str | Path):
        self.root = Path(path)
        refuse_links_out(self.root)  # nothing is read through a link out of OUT
        self.config = read_config(self.root)
        self.quantization_config = self.config.get("quantization_config")
        if not isinstance(self.quantization_config, dict):
            raise SourceError("config.json has no quantization_config: not a converted checkpoint",
                              file="config.json")
        stored = ManifestFile.read(self.root)
        self.manifest: Manifest | None = stored.record if stored is not None else None
        self.manifest_problem: str | None = manifest_intact(stored, self.config)
        self.layout = self._layout()
        index_path = self.root / INDEX_NAME
        self.index: Index | None = read_index(index_path) if index_path.is_file() else None
        files = self.index.files if self.index is not None else _single_file(self.root)
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
        self.experts = ExpertMap.from_checkpoint(self.layout, self.config, self.tensors)
        format_name = self._format_name()
        self.scale_dtype = self._scale_dtype(format_name)
        self.format: Format = get_format(format_name, self.experts, self.scale_dtype)
        self.modules = self.format.quantized_modules(list(self.tensors))

    def _layout(self) -> Layout:
        """The layout the checkpoint was made with: carried in expq.json (a user's ``--layout`` file too), else the
        built-in layout of that name, else detected from config.json."""
        m = self.manifest
        if m is not None and m.layout_toml:
            return parse_layout(m.layout_toml, f"{self.root / MANIFEST} (layout_toml)")
        if m is not None and (lay := builtin_layout(m.options.layout)) is not None:
            return lay
        return detect_layout(self.config)[0]

    def _format_name(self) -> str:
        """The manifest's format, else the format whose ``quant_method`` config.json names.

        Raises:
            SourceError: neither names a registered format.
        """
        if self.manifest is not None:
            if self.manifest.format not in FORMATS:
                raise SourceError(f"format {self.manifest.format!r} is not an expq output format (known: "
                                  f"{', '.join(FORMATS)})", file=str(self.root / MANIFEST))
            return self.manifest.format
        method = self.quantization_config.get("quant_method")
        name = format_for_quant_method(method)
        if name is None:
            raise SourceError(f"quantization_config quant_method {method!r} is not an expq output format's (known: "
                              f"{', '.join(FORMATS[n].quant_method for n in FORMATS)})", file="config.json")
        return name

    # --- what callers ask -----------------------------------------------------------------------------------------
    @property
    def weight_map(self) -> dict[str, str] | None:
        """The index's tensor name -> shard file (None for a single ``model.safetensors`` without an index)."""
        return self.index.weight_map if self.index is not None else None

    @property
    def num_layers(self) -> int:
        return self.experts.num_layers

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def moe_layers(self) -> list[int]:
        return self.experts.moe_layers

    @property
    def top_k(self) -> int | None:
        return self.experts.top_k

    def _scale_dtype(self, format_name: str) -> torch.dtype:
        """The compute dtype the scales were computed in: the manifest's, else the stored dtype of a tensor with the
        format's scale suffix (bfloat16 if none)."""
        if self.manifest is not None and self.manifest.options.dtype in COMPUTE_DTYPES:
            return COMPUTE_DTYPES[self.manifest.options.dtype]
        suffix = "." + FORMATS[format_name].suffixes["scale"]
        any_scale = next((t for n, t in self.tensors.items() if n.endswith(suffix)), None)
        return TORCH_DTYPES.get(any_scale.dtype, torch.bfloat16) if any_scale else torch.bfloat16

    def read(self, name: str) -> torch.Tensor:
        """One tensor by name (one read).

        Raises:
            SourceError: no shard holds it.
        """
        info = self.tensors.get(name)
        if info is None:
            raise SourceError("tensor not found in any shard", tensor=name)
        return read_tensor(self.root, info)

    def module_codes(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [out, in], scales [out] in the stored dtype) of one quantized module.

        Raises:
            SourceError: a tensor is missing or the module's tensors do not fit together.
        """
        try:
            return self.format.decode(module, self.read)
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
            for p in ("gate", "up", "down"):
                module = self.modules.get((layer, e, p))
                if module is None:
                    raise LayoutError(f"layer {layer}: {p} projection missing", expert=e,
                                      tensor=self.experts.module_name(layer, e, p))
                c, s = self.module_codes(module)
                if w13 is None:
                    if p != "gate":
                        raise LayoutError(f"layer {layer}: gate projection must come first", expert=e, tensor=module)
                    I, H = c.shape
                    w13 = torch.empty(E, 2 * I, H, dtype=torch.int8)
                    w2 = torch.empty(E, H, I, dtype=torch.int8)
                    w13_scale = torch.empty(E, 2 * I, dtype=torch.float32)
                    w2_scale = torch.empty(E, H, dtype=torch.float32)
                    scale_dtype = s.dtype
                I, H = w13.shape[1] // 2, w13.shape[2]
                want = (H, I) if p == "down" else (I, H)
                if tuple(c.shape) != want:
                    raise LayoutError(f"layer {layer}: {p} has shape {list(c.shape)}, expected {list(want)}",
                                      expert=e, tensor=module)
                if p == "down":
                    w2[e].copy_(c)
                    w2_scale[e].copy_(s)
                else:
                    w13[e, w13_rows(p, I)].copy_(c)
                    w13_scale[e, w13_rows(p, I)].copy_(s)
        res = LayerExperts(layer, w13, w2, w13_scale, w2_scale, scale_dtype=scale_dtype)
        names = self.experts.bias_names(layer)
        if names:
            gu_name, d_name = names
            res.w13_bias = self.experts.in_w13_order(self.read(gu_name)) if gu_name in self.tensors else None
            res.w2_bias = self.read(d_name) if d_name in self.tensors else None
        return res


def _single_file(root: Path) -> list[str]:
    """The shard of a converted checkpoint without an index: its ``model.safetensors``.

    Raises:
        SourceError: there is none.
    """
    if (root / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    raise SourceError("no model.safetensors or index", file=str(root))


def open_checkpoint(path: str | Path) -> ConvertedCheckpoint:
    """``ConvertedCheckpoint(path)`` for the commands that read a converted checkpoint (verify, run, push,
    load_model): a directory that is not one is unreadable input (exit status 2), not a conversion error.

    Raises:
        UsageError: as ``ConvertedCheckpoint``. UnreadableInputError: any other reason it cannot be read.
    """
    from .errors import ExpqError, UnreadableInputError, UsageError

    try:
        return ConvertedCheckpoint(path)
    except UsageError:
        raise
    except ExpqError as e:
        raise UnreadableInputError.from_error(e) from None

"""Where each architecture keeps its routed experts: layout files in ``configs/`` and the few rules that read them.

A layout file (TOML) names the model types it covers, the config keys that give the expert count, layer count, sizes
and which layers are MoE layers, and where the experts' tensors are (see ``configs/README.md`` for every key). The
code here holds only the rules the files refer to:

* ``per_expert``: one 2-D ``[out, in]`` tensor per expert and projection, ``<layers>.<L>.<module>.<e>.<proj>.weight``;
* ``stacked``: 3-D tensors ``[E, out, in]`` (orientation ``out_in``) or ``[E, in, out]`` (``in_out``), with gate and up
  fused (gate rows first, ``concat``, or alternating, ``interleaved``) or separate; ``flat = true`` for tensors stored
  as ``[E*rows, cols]`` (DBRX).

Orientation is never inferred from shape: a layout fixes it. Where a layout admits two orientations (two writers
disagree), the config's hidden and intermediate sizes decide, and a shape that fits both is an error.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import LayoutError

CONFIGS_DIR = Path(__file__).parent / "configs"  # a link to the repository's configs/; a real folder in a wheel
PROJECTIONS = ("gate", "up", "down")
ORIENTATIONS = ("out_in", "in_out")

# Config keys that say which decoder layers are MoE layers; a layout lists the ones its family uses.
MOE_LAYER_RULES = (
    "first_k_dense_replace",  # DeepSeek, GLM-4.5, dots1, Kimi: layers < k are dense; with moe_layer_freq, L % f == 0
    "mlp_only_layers",  # Qwen2/3-MoE, Qwen3-Next: listed layers are dense
    "decoder_sparse_step",  # Qwen2/3-MoE: MoE iff (L + 1) % step == 0
    "moe_layers",  # Llama-4: explicit list, else (L + 1) % interleave_moe_layer_step == 0
    "moe_layer_start_index",  # Ernie-4.5: start <= L <= end and (L + 1) % moe_layer_interval == 0
    "expert_layer_period",  # Jamba: L % period == expert_layer_offset
    "mlp_layer_types",  # Bailing hybrid: mlp_layer_types[L] == "sparse"
)


@dataclass(frozen=True)
class StackedTensor:
    """One stacked expert tensor of a ``stacked`` layout (relative to the experts module)."""

    name: str
    orientations: tuple[str, ...]  # admitted: ("out_in",), ("in_out",) or both
    order: str = "concat"  # for a fused gate_up tensor: "concat" (gate rows first) or "interleaved" (even rows gate)
    flat: bool = False  # stored as [E*rows, cols] instead of [E, rows, cols]


@dataclass(frozen=True)
class Layout:
    """A family's layout, as read from its file in ``configs/``. See ``configs/README.md``."""

    name: str
    path: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    rule: str  # "per_expert" | "stacked"
    layers: str  # decoder-layer container name, e.g. "layers" or "blocks"
    module: str  # experts module inside a decoder layer, e.g. "mlp.experts"
    proj_names: dict[str, str]  # per_expert: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    stacked: dict[str, StackedTensor]  # stacked: keys "gate_up" and "down", or "gate", "up" and "down"
    out_module: str  # per-expert output module path inside a decoder layer, with "{expert}"
    out_names: dict[str, str]  # output projection names
    keys: dict[str, tuple[str, ...]]  # config keys: num_experts, num_layers, hidden_size, intermediate_size, top_k
    moe_layer_rules: tuple[str, ...]
    activation: str  # kernel activation: "silu", "gelu", "gelu_tanh", "swigluoai"
    expert_biases: tuple[str, ...]  # expert bias tensors (copied as they are; the runtime uses them)
    targets_container: str = "experts"  # module path right before the expert index, for quantization targets
    router_weight_on_input: bool = False  # Llama-4: the router weight scales the expert input, not its output
    runtime_module: str = ""  # transformers' in-memory experts module inside a decoder layer, e.g. "mlp.experts"
    runtime_forward: str = "topk"  # its calling convention: "topk" or "dense_premultiplied" (see configs/README.md)
    stock_transformers: bool = True  # stock transformers loads this format for the family
    stock_vllm: str = ""  # why stock vLLM cannot serve it ("" when it can)
    vllm_note: str = ""  # a caveat for some model types of the family
    source_text: str = ""  # the layout file's text (carried in expq.json)
    extra: dict[str, Any] = field(default_factory=dict)

    def expert_regex(self) -> re.Pattern[str]:
        """Regex over source tensor names that matches this layout's routed-expert weight tensors.

        Groups: ``prefix`` (everything up to the decoder layer container), ``layer``, and for ``per_expert``
        ``expert`` and ``proj`` (the source projection name); for ``stacked``, ``tensor`` (the stacked tensor name).
        """
        head = rf"^(?P<prefix>(?:.*\.)?){re.escape(self.layers)}\.(?P<layer>\d+)\.{re.escape(self.module)}\."
        if self.rule == "per_expert":
            names = "|".join(re.escape(n) for n in self.proj_names.values())
            return re.compile(head + rf"(?P<expert>\d+)\.(?P<proj>{names})\.weight$")
        names = "|".join(re.escape(t.name) for t in self.stacked.values())
        return re.compile(head + rf"(?P<tensor>{names})$")

    def out_module_name(self, prefix: str, layer: int, expert: int, proj: str) -> str:
        """Output module name of one routed expert projection, e.g. ``model.layers.3.mlp.experts.7.gate_proj``."""
        mod = self.out_module.format(expert=expert)
        return f"{prefix}{self.layers}.{layer}.{mod}.{self.out_names[proj]}"


def _tuple(v: Any) -> tuple:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


# Every key a layout file may have (a typo is an error, not a silent default).
_KEYS = {
    "": {"name", "summary", "model_types", "architectures", "config", "experts", "output", "runtime", "clients"},
    "config": {"num_experts", "num_layers", "hidden_size", "intermediate_size", "top_k", "moe_layer_rules",
               "activation", "router_weight_on_input"},
    "experts": {"rule", "layers", "module", "gate", "up", "down", "gate_up", "biases"},
    "output": {"module", "gate", "up", "down", "targets_container"},
    "runtime": {"module", "forward"},
    "clients": {"transformers", "vllm", "vllm_note"},
    "stacked": {"name", "orientation", "order", "flat"},
}
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")


def load_layout(path: str | Path) -> Layout:
    """Read and validate one layout file (see ``parse_layout``).

    Raises:
        LayoutError: the file is missing or not a file, or any ``parse_layout`` error.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise LayoutError("layout file not found", file=path) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise LayoutError(f"cannot read the layout file: {type(e).__name__}", file=path) from None
    return parse_layout(text, str(path))


def parse_layout(text: str, path: str = "<layout>") -> Layout:
    """Parse and validate a layout (TOML text; ``path`` names it in errors). The text is kept in
    ``Layout.source_text`` so that a converted checkpoint can carry the layout it was made with.

    Raises:
        LayoutError: not TOML, an unknown key, a missing required key, or a value of the wrong type or range
            (the message names the key).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(f"not a valid TOML layout: {e}", file=path) from None

    def check_keys(d: Any, section: str, allowed: set[str]) -> None:
        if not isinstance(d, dict):
            raise LayoutError(f"{section or 'the file'} must be a table", file=path)
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise LayoutError(f"unknown key {(section + '.') if section else ''}{unknown[0]} (known: "
                              f"{', '.join(sorted(allowed))})", file=path)

    def need(d: dict, key: str, where: str) -> Any:
        if key not in d:
            raise LayoutError(f"missing key {where}{key}", file=path)
        return d[key]

    def strings(v: Any, key: str) -> None:
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(x, str) and x for x in vals):
            raise LayoutError(f"{key} must be a non-empty string or list of strings, got {v!r}", file=path)

    check_keys(data, "", _KEYS[""])
    for sec in ("config", "experts", "output", "runtime", "clients"):
        if sec in data:
            check_keys(data[sec], sec, _KEYS[sec])
    for sec, keys in (("config", ("num_experts", "num_layers", "hidden_size", "intermediate_size", "top_k")),
                      ("experts", ("layers", "module")), ("output", ("module", "gate", "up", "down",
                                                                     "targets_container")),
                      ("runtime", ("module", "forward"))):
        for k in keys:
            if k in data.get(sec, {}):
                strings(data[sec][k], f"{sec}.{k}")
    for k in ("name", "model_types", "architectures"):
        if k in data:
            strings(data[k], k)
    act = data.get("config", {}).get("activation", "silu")
    if act not in ACTIVATIONS:
        raise LayoutError(f"config.activation must be one of {', '.join(ACTIVATIONS)}, got {act!r}", file=path)

    ex = need(data, "experts", "")
    cfg = data.get("config", {})
    rule = need(ex, "rule", "experts.")
    if rule not in ("per_expert", "stacked"):
        raise LayoutError(f"experts.rule must be per_expert or stacked, got {rule!r}", file=path)
    need(ex, "module", "experts.")
    proj_names: dict[str, str] = {}
    stacked: dict[str, StackedTensor] = {}
    if rule == "per_expert":
        for p in PROJECTIONS:
            proj_names[p] = need(ex, p, "experts.")
            if not isinstance(proj_names[p], str) or not proj_names[p]:
                raise LayoutError(f"experts.{p} must be a projection name (string), got {proj_names[p]!r}",
                                  file=path)
    else:
        parts = [k for k in ("gate_up", "gate", "up", "down") if k in ex]
        if set(parts) not in ({"gate_up", "down"}, {"gate", "up", "down"}):
            raise LayoutError("a stacked layout needs experts.gate_up and experts.down, or experts.gate, "
                              "experts.up and experts.down", file=path)
        for k in parts:
            t = ex[k]
            check_keys(t, f"experts.{k}", _KEYS["stacked"])
            strings(need(t, "name", f"experts.{k}."), f"experts.{k}.name")
            ors = _tuple(need(t, "orientation", f"experts.{k}."))
            if not ors or any(o not in ORIENTATIONS for o in ors):
                raise LayoutError(f"experts.{k}.orientation must be out_in and/or in_out, got {ors}", file=path)
            order = t.get("order", "concat")
            if order not in ("concat", "interleaved"):
                raise LayoutError(f"experts.{k}.order must be concat or interleaved", file=path)
            stacked[k] = StackedTensor(name=need(t, "name", f"experts.{k}."), orientations=ors, order=order,
                                       flat=bool(t.get("flat", False)))
    out = data.get("output", {})
    out_names = {p: out.get(p, proj_names.get(p, f"{p}_proj")) for p in PROJECTIONS}
    keys = {
        "num_experts": _tuple(need(cfg, "num_experts", "config.")),
        "num_layers": _tuple(cfg.get("num_layers", "num_hidden_layers")),
        "hidden_size": _tuple(cfg.get("hidden_size", "hidden_size")),
        "intermediate_size": _tuple(need(cfg, "intermediate_size", "config.")),
        "top_k": _tuple(cfg.get("top_k", "num_experts_per_tok")),
    }
    rules = _tuple(cfg.get("moe_layer_rules", ()))
    unknown = [r for r in rules if r not in MOE_LAYER_RULES]
    if unknown:
        raise LayoutError(f"unknown config.moe_layer_rules {unknown}; known: {list(MOE_LAYER_RULES)}", file=path)
    return Layout(
        name=need(data, "name", ""),
        path=path,
        model_types=_tuple(data.get("model_types")),
        architectures=_tuple(data.get("architectures")),
        rule=rule,
        layers=ex.get("layers", "layers"),
        module=need(ex, "module", "experts."),
        proj_names=proj_names,
        stacked=stacked,
        out_module=out.get("module", ex["module"] + ".{expert}"),
        out_names=out_names,
        keys=keys,
        moe_layer_rules=rules,
        activation=cfg.get("activation", "silu"),
        expert_biases=_tuple(ex.get("biases")),
        targets_container=out.get("targets_container", "experts"),
        router_weight_on_input=bool(cfg.get("router_weight_on_input", False)),
        runtime_module=data.get("runtime", {}).get("module", ex["module"]),
        runtime_forward=_runtime_forward(data.get("runtime", {}).get("forward", "topk"), path),
        stock_transformers=bool(data.get("clients", {}).get("transformers", True)),
        stock_vllm=str(data.get("clients", {}).get("vllm", "")),
        vllm_note=str(data.get("clients", {}).get("vllm_note", "")),
        source_text=text,
        extra={k: v for k, v in data.items() if k not in ("name", "model_types", "architectures", "experts",
                                                          "config", "output", "runtime", "clients")},
    )


def _runtime_forward(value: str, path: str) -> str:
    if value not in ("topk", "dense_premultiplied"):
        raise LayoutError(f"runtime.forward must be topk or dense_premultiplied, got {value!r}", file=path)
    return value


def builtin_layouts() -> list[Layout]:
    """Every layout shipped in ``configs/``, sorted by name."""
    return [load_layout(p) for p in sorted(CONFIGS_DIR.glob("*.toml"))]


NESTED_CONFIG_SECTIONS = ("text_config", "language_config", "llm_config")


def nested_configs(config: dict) -> list[tuple[str, dict]]:
    """The nested model configs of a multimodal/wrapper ``config.json`` (``text_config``...), as (key, dict)."""
    return [(n, config[n]) for n in NESTED_CONFIG_SECTIONS if isinstance(config.get(n), dict)]


def config_lookup(config: dict, keys: tuple[str, ...]) -> tuple[Any, str | None]:
    """The value of the first of ``keys`` (in priority order; dotted paths allowed) present in ``config``, looking at
    the top level and then in a nested ``text_config`` / ``language_config`` / ``llm_config``.

    Returns:
        (value, "scope.key") or (None, None) when no key is present.
    """
    scopes = [("", config)] + [(f"{n}.", config[n]) for n in ("text_config", "language_config", "llm_config")
                               if isinstance(config.get(n), dict)]
    for key in keys:
        for scope_name, scope in scopes:
            cur: Any = scope
            for part in key.split("."):
                cur = cur.get(part) if isinstance(cur, dict) else None
            if cur is not None:
                return cur, scope_name + key
    return None, None


def detect_layout(config: dict, layouts: list[Layout] | None = None) -> tuple[Layout, str]:
    """The layout for a checkpoint's ``config.json`` and the key that decided it.

    Tried in order: top-level ``model_type``, ``architectures``, then the nested ``text_config.model_type``.

    Raises:
        LayoutError: no layout covers the model (the message lists what was tried and the known model types).
    """
    layouts = builtin_layouts() if layouts is None else layouts
    tried = []
    mt = config.get("model_type")
    tried.append(f"model_type={mt!r}")
    for lay in layouts:
        if mt in lay.model_types:
            return lay, f"model_type={mt!r}"
    for arch in config.get("architectures") or []:
        tried.append(f"architectures={arch!r}")
        for lay in layouts:
            if arch in lay.architectures:
                return lay, f"architectures={arch!r}"
    for n in ("text_config", "language_config", "llm_config"):
        sub = config.get(n)
        if isinstance(sub, dict) and sub.get("model_type"):
            tried.append(f"{n}.model_type={sub['model_type']!r}")
            for lay in layouts:
                if sub["model_type"] in lay.model_types:
                    return lay, f"{n}.model_type={sub['model_type']!r}"
    known = sorted({m for lay in layouts for m in lay.model_types})
    raise LayoutError(f"no layout for this model (tried {', '.join(tried)}); known model types: {', '.join(known)}",
                      file="config.json", hint="pass --layout FILE to describe it")


def moe_layer_indices(layout: Layout, config: dict, num_layers: int) -> list[int]:
    """Decoder layers that are MoE layers according to the config keys the layout names (all rules must agree).

    Raises:
        LayoutError: a key has a value of the wrong type or range (named in the message).
    """

    def get(key: str, kind: str, default: Any = None, minimum: int = 0) -> Any:
        v = config_lookup(config, (key,))[0]
        if v is None:
            return default
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
            raise LayoutError(f"{key} must be an integer >= {minimum}, got {v!r}", file="config.json")
        if kind == "ints" and (not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                  for x in v)):
            raise LayoutError(f"{key} must be a list of layer indices, got {v!r}", file="config.json")
        if kind == "strs" and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            raise LayoutError(f"{key} must be a list of strings, got {v!r}", file="config.json")
        return v

    out = []
    for L in range(num_layers):
        moe = True
        for rule in layout.moe_layer_rules:
            if rule == "first_k_dense_replace":
                k = get("first_k_dense_replace", "int", 0)
                freq = get("moe_layer_freq", "int", 1, minimum=1)
                moe &= L >= k and L % freq == 0
            elif rule == "mlp_only_layers":
                moe &= L not in get("mlp_only_layers", "ints", [])
            elif rule == "decoder_sparse_step":
                moe &= (L + 1) % get("decoder_sparse_step", "int", 1, minimum=1) == 0
            elif rule == "moe_layers":
                listed = get("moe_layers", "ints")
                if listed is not None:
                    moe &= L in listed
                else:
                    step = get("interleave_moe_layer_step", "int", 1)
                    moe &= step > 0 and (L + 1) % step == 0
            elif rule == "moe_layer_start_index":
                start = get("moe_layer_start_index", "int", 0)
                end = config_lookup(config, ("moe_layer_end_index",))[0]
                end = num_layers - 1 if end is None or end < 0 else end
                interval = get("moe_layer_interval", "int", 1, minimum=1)
                moe &= start <= L <= end and (L + 1) % interval == 0
            elif rule == "expert_layer_period":
                period = get("expert_layer_period", "int", 1, minimum=1)
                moe &= L % period == get("expert_layer_offset", "int", 0)
            elif rule == "mlp_layer_types":
                types = get("mlp_layer_types", "strs")
                if types is not None:
                    moe &= L < len(types) and types[L] == "sparse"
        if moe:
            out.append(L)
    return out

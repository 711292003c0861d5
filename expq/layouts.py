"""Where each architecture keeps its routed experts: layout files in ``configs/``, their schema, and the few rules
that read them.

A layout file (TOML) names the model types it covers, the config keys that give the expert count, layer count, sizes
and which layers are MoE layers, and where the experts' tensors are (see ``configs/README.md`` for every key). It is
validated by the frozen pydantic models below (unknown keys and wrong types are errors naming the file and key). The
code holds only the rules the files refer to:

* ``per_expert``: one 2-D ``[out, in]`` tensor per expert and projection, ``<layers>.<L>.<module>.<e>.<proj>.weight``;
* ``stacked``: 3-D tensors ``[E, out, in]`` (orientation ``out_in``) or ``[E, in, out]`` (``in_out``), with gate and up
  fused (gate rows first, ``concat``, or alternating, ``interleaved``) or separate; ``flat = true`` for tensors stored
  as ``[E*rows, cols]`` (DBRX).

Facts shared by every family (nested config sections, MTP layer keys, what kinds of tensors are kept, the clients'
caveats) live in ``configs/_shared.toml`` and are read by ``shared_facts()``.

Orientation is never inferred from shape: a layout fixes it. Where a layout admits two orientations (two writers
disagree), the config's hidden and intermediate sizes decide (``experts.py``), and a shape that fits both is an error.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from .errors import LayoutError
from .formats import DEFAULT as DEFAULT_FORMAT
from .formats import FORMATS

CONFIGS_DIR = Path(__file__).parent / "configs"  # a link to the repository's configs/; a real folder in a wheel
SHARED_FILE = "_shared.toml"
PROJECTIONS = ("gate", "up", "down")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")

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

# --- the layout file schema ------------------------------------------------------------------------------------------
Name = Annotated[str, StringConstraints(min_length=1)]
Names = Union[Name, Annotated[list[Name], Field(min_length=1)]]
NAMES = "a non-empty string or list of strings"


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StackedSpec(_Schema):
    """``experts.<part> = { name, orientation, order, flat }`` of a stacked layout."""

    name: Name = Field(description="a tensor name (non-empty string)")
    orientation: Union[Literal["out_in", "in_out"], Annotated[list[Literal["out_in", "in_out"]], Field(min_length=1)]] \
        = Field(description="out_in and/or in_out")
    order: Literal["concat", "interleaved"] = Field("concat", description="concat or interleaved")
    flat: bool = Field(False, description="true or false")


class ConfigSection(_Schema):
    """``[config]``: which config.json keys hold each number, and the family's MoE rules."""

    num_experts: Names = Field(description=NAMES)
    num_layers: Names = Field("num_hidden_layers", description=NAMES)
    hidden_size: Names = Field("hidden_size", description=NAMES)
    intermediate_size: Names = Field(description=NAMES)
    top_k: Names = Field("num_experts_per_tok", description=NAMES)
    moe_layer_rules: list[Literal[MOE_LAYER_RULES]] = Field([], description=f"a list of {', '.join(MOE_LAYER_RULES)}")
    activation: Literal[ACTIVATIONS] = Field("silu", description=f"one of {', '.join(ACTIVATIONS)}")
    router_weight_on_input: bool = Field(False, description="true or false")


class ExpertsSection(_Schema):
    """``[experts]``: where the routed experts are in the source."""

    rule: Literal["per_expert", "stacked"] = Field(description="per_expert or stacked")
    layers: Name = Field("layers", description="a non-empty string")
    module: Name = Field(description="a non-empty string (the experts module inside a decoder layer)")
    gate: Union[Name, StackedSpec, None] = Field(None, description="a projection name (string) or, for a stacked "
                                                                  "layout, a tensor table")
    up: Union[Name, StackedSpec, None] = Field(None, description="a projection name (string) or, for a stacked "
                                                                "layout, a tensor table")
    down: Union[Name, StackedSpec, None] = Field(None, description="a projection name (string) or, for a stacked "
                                                                  "layout, a tensor table")
    gate_up: StackedSpec | None = Field(None, description="a tensor table")
    biases: Names | None = Field(None, description=NAMES)

    @model_validator(mode="after")
    def _parts_fit_the_rule(self) -> "ExpertsSection":
        if self.rule == "per_expert":
            for p in PROJECTIONS:
                v = getattr(self, p)
                if not isinstance(v, str):
                    raise ValueError(f"experts.{p} must be a projection name (string), got {v!r}")
            if self.gate_up is not None:
                raise ValueError("experts.gate_up is for stacked layouts")
        else:
            parts = {k for k in ("gate_up", "gate", "up", "down") if getattr(self, k) is not None}
            if parts not in ({"gate_up", "down"}, {"gate", "up", "down"}) or any(
                    isinstance(getattr(self, k), str) for k in parts):
                raise ValueError("a stacked layout needs experts.gate_up and experts.down, or experts.gate, "
                                 "experts.up and experts.down, each a tensor table")
        return self


class OutputSection(_Schema):
    """``[output]``: the per-expert module names the output uses (stock clients' names)."""

    module: Name | None = Field(None, description="a non-empty string with {expert}")
    gate: Name | None = Field(None, description="a non-empty string")
    up: Name | None = Field(None, description="a non-empty string")
    down: Name | None = Field(None, description="a non-empty string")
    targets_container: Name = Field("experts", description="a non-empty string")


class RuntimeSection(_Schema):
    """``[runtime]``: transformers' in-memory experts module and its calling convention."""

    module: Name | None = Field(None, description="a non-empty string")
    forward: Literal["topk", "dense_premultiplied"] = Field("topk", description="topk or dense_premultiplied")
    weight: Name = Field("gate_up_proj", description="a non-empty string (the module's fused experts weight)")


class ClientsSection(_Schema):
    """``[clients]``: what stock clients do with this family's output in the format they load, and the output
    format ``expq convert`` writes by default for it (and why)."""

    transformers: bool = Field(True, description="true or false")
    format: str = Field(DEFAULT_FORMAT, description="an output format's name (formats.FORMATS)")
    format_reason: str = Field("", description="a string")
    vllm_plugin: str = Field("", description="a string (why expq's vLLM plugin cannot serve this family; empty "
                                               "when it can)")
    vllm: str = Field("", description="a string (why stock vLLM cannot serve it; empty when it can)")
    vllm_note: str = Field("", description="a string")

    @field_validator("format")
    @classmethod
    def _registered_format(cls, name: str) -> str:
        if name not in FORMATS:
            raise ValueError(f"clients.format must be {' or '.join(FORMATS)}, got {name!r}")
        return name


class LayoutFile(_Schema):
    """A whole layout file."""

    name: Name = Field(description="a non-empty string")
    summary: str = Field("", description="a string")
    model_types: Names | None = Field(None, description=NAMES)
    architectures: Names | None = Field(None, description=NAMES)
    config: ConfigSection = Field(description="a table")
    experts: ExpertsSection = Field(description="a table")
    output: OutputSection = Field(OutputSection(), description="a table")
    runtime: RuntimeSection = Field(RuntimeSection(), description="a table")
    clients: ClientsSection = Field(ClientsSection(), description="a table")


_SECTIONS: dict[str, type[_Schema]] = {"": LayoutFile, "config": ConfigSection, "experts": ExpertsSection,
                                       "output": OutputSection, "runtime": RuntimeSection,
                                       "clients": ClientsSection, "stacked": StackedSpec}


def _schema_error(e: ValidationError, path: str) -> LayoutError:
    """The first schema error as one line naming the key: "unknown key K (known: ...)", "missing key K", or "K must
    be <what the field's description says>, got V"; a validator's own message as it is."""
    err = e.errors()[0]
    fields = {f for m in _SECTIONS.values() for f in m.model_fields}
    raw = [str(x) for x in err["loc"]]
    loc = [x for x in raw if x.isdigit() or x in fields]
    if err["type"] == "extra_forbidden":  # the unknown key itself is last
        loc = [x for x in raw[:-1] if x.isdigit() or x in fields] + raw[-1:]
    key = ".".join(x for x in loc if not x.isdigit())
    if err["type"] == "extra_forbidden":
        parent = ".".join(loc[:-1])
        model = _SECTIONS.get(parent, StackedSpec if parent.startswith("experts.") else LayoutFile)
        return LayoutError(f"unknown key {key} (known: {', '.join(sorted(model.model_fields))})", file=path)
    if err["type"] == "missing":
        return LayoutError(f"missing key {key}", file=path)
    if err["type"] == "value_error":
        return LayoutError(str(err["msg"]).removeprefix("Value error, "), file=path)
    section, _, field = key.rpartition(".")
    model = _SECTIONS.get(section) or (StackedSpec if section.startswith("experts.") else LayoutFile)
    info = model.model_fields.get(field)
    what = info.description if info is not None and info.description else str(err["msg"]).lower()
    return LayoutError(f"{key} must be {what}, got {err.get('input')!r}", file=path)


# --- the layout the rest of expq reads -------------------------------------------------------------------------------
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
    runtime_weight: str = "gate_up_proj"  # that module's fused experts weight (where stock transformers loads them)
    stock_transformers: bool = True  # stock transformers loads this format for the family
    default_format: str = DEFAULT_FORMAT  # what `expq convert` writes when --format is not given
    format_reason: str = ""  # why, for inspect and the card
    vllm_plugin: str = ""  # why expq's vLLM plugin cannot serve this family ("" when it can)
    stock_vllm: str = ""  # why stock vLLM cannot serve it ("" when it can)
    vllm_note: str = ""  # a caveat for some model types of the family
    source_text: str = ""  # the layout file's text (carried in expq.json)


def _tuple(v: Any) -> tuple:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


MAX_LAYOUT_BYTES = 1 << 20  # a layout file is a few KiB; a larger one is refused before it is parsed
MAX_LAYOUT_DEPTH = 8  # tables and arrays inside each other (the schema needs 4: experts.gate_up.orientation[])
DEEP_ARRAY = r"(?:\[\s*){%d,}" % (MAX_LAYOUT_DEPTH + 1)  # where a too deep array starts, for the error line
LONG_INT = r"[0-9_]{4301,}"  # an integer literal longer than Python converts


def load_layout(path: str | Path) -> Layout:
    """Read and validate one layout file (see ``parse_layout``): a regular file (never a named pipe or a device)
    of at most ``MAX_LAYOUT_BYTES``.

    Raises:
        LayoutError: the file is missing, not a regular file, too large, not UTF-8, or any ``parse_layout`` error.
    """
    from .io.regular import read_regular

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise LayoutError("layout file not found", file=str(path))
    data = read_regular(path, "layout file", MAX_LAYOUT_BYTES, LayoutError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LayoutError(f"cannot read the layout file: not UTF-8 (byte {e.start})", file=str(path)) from None
    return parse_layout(text, str(path))


def parse_layout(text: str, path: str = "<layout>") -> Layout:
    """Parse and validate a layout (TOML text; ``path`` names it in errors). The text is kept in
    ``Layout.source_text`` so that a converted checkpoint can carry the layout it was made with.

    Steps: bound the text (size, nesting), read the TOML, validate it against ``LayoutFile``, build the ``Layout``.

    Raises:
        LayoutError: larger than ``MAX_LAYOUT_BYTES``, not TOML, nested deeper than ``MAX_LAYOUT_DEPTH``, an
            integer too long for Python, an unknown key, a missing required key, or a value of the wrong type or
            range (the message names the key).
    """
    if len(text) > MAX_LAYOUT_BYTES:
        raise LayoutError(f"the layout is {len(text)} characters; at most {MAX_LAYOUT_BYTES} are accepted", file=path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(f"not a valid TOML layout: {e}", file=path) from None
    except RecursionError:
        where = _where(text, DEEP_ARRAY)
        raise LayoutError(f"{where}arrays nested more than {MAX_LAYOUT_DEPTH} deep", file=path) from None
    except ValueError:  # Python's own limit on integer digits, raised through tomllib
        where = _where(text, LONG_INT)
        raise LayoutError(f"{where}an integer with more digits than Python reads (4300)", file=path) from None
    _check_depth(data, path)
    try:
        f = LayoutFile.model_validate(data)
    except ValidationError as e:
        raise _schema_error(e, path) from None
    return _layout_from_schema(f, path, text)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1 (escape sequences)


def _check_depth(data: dict, path: str) -> None:
    """Refuse tables and arrays nested deeper than ``MAX_LAYOUT_DEPTH``, and keys or strings holding a control
    character (an escape sequence would reach the terminal where expq prints the layout's name or notes); walked
    without recursion, naming the dotted key."""
    todo: list[tuple[Any, str, int]] = [(data, "", 0)]
    while todo:
        value, key, depth = todo.pop()
        if depth > MAX_LAYOUT_DEPTH:
            raise LayoutError(f"key {_printable(key)}: tables or arrays nested more than {MAX_LAYOUT_DEPTH} deep",
                              file=path)
        if isinstance(value, dict):
            for k, v in value.items():
                sub = f"{key}.{k}" if key else str(k)
                if CONTROL.search(str(k)):
                    raise LayoutError(f"key {_printable(sub)}: the key holds a control character", file=path)
                todo.append((v, sub, depth + 1))
        elif isinstance(value, list):
            todo += [(v, f"{key}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif isinstance(value, str) and (m := CONTROL.search(value)):
            raise LayoutError(f"key {_printable(key)}: the text holds a control character ({ascii(m.group())} at "
                              f"position {m.start()}); layout text must be printable", file=path)


def _where(text: str, pattern: str) -> str:
    """``line N (key K): `` for the first match of ``pattern`` in a layout's text (``""`` when there is none)."""
    m = re.search(pattern, text)
    if m is None:
        return ""
    line_no = text.count("\n", 0, m.start()) + 1
    line = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
    key = line.partition("=")[0].strip() if "=" in line else ""
    return f"line {line_no}" + (f" (key {_printable(key)})" if key else "") + ": "


def _printable(text: str, limit: int = 120) -> str:
    """User text for an error line: as it is when printable, else escaped (no escape sequence reaches the
    terminal); cut at ``limit`` characters."""
    shown = text if text.isprintable() else ascii(text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def _layout_from_schema(f: LayoutFile, path: str, text: str) -> Layout:
    ex, cfg, out = f.experts, f.config, f.output
    proj_names: dict[str, str] = {}
    stacked: dict[str, StackedTensor] = {}
    if ex.rule == "per_expert":
        proj_names = {p: getattr(ex, p) for p in PROJECTIONS}
    else:
        for k in ("gate_up", "gate", "up", "down"):
            t = getattr(ex, k)
            if t is not None:
                stacked[k] = StackedTensor(t.name, _tuple(t.orientation), t.order, t.flat)
    out_names = {p: getattr(out, p) or proj_names.get(p, f"{p}_proj") for p in PROJECTIONS}
    _check_names(path, ex, proj_names, out_names, out.module or ex.module + ".{expert}", stacked)
    keys = {k: _tuple(getattr(cfg, k)) for k in ("num_experts", "num_layers", "hidden_size", "intermediate_size",
                                                 "top_k")}
    return Layout(
        name=f.name, path=path, model_types=_tuple(f.model_types), architectures=_tuple(f.architectures),
        rule=ex.rule, layers=ex.layers, module=ex.module, proj_names=proj_names, stacked=stacked,
        out_module=out.module or ex.module + ".{expert}", out_names=out_names, keys=keys,
        moe_layer_rules=tuple(cfg.moe_layer_rules), activation=cfg.activation, expert_biases=_tuple(ex.biases),
        targets_container=out.targets_container, router_weight_on_input=cfg.router_weight_on_input,
        runtime_module=f.runtime.module or ex.module, runtime_forward=f.runtime.forward,
        runtime_weight=f.runtime.weight, default_format=f.clients.format, format_reason=f.clients.format_reason,
        vllm_plugin=f.clients.vllm_plugin,
        stock_transformers=f.clients.transformers, stock_vllm=f.clients.vllm, vllm_note=f.clients.vllm_note,
        source_text=text)


def _check_names(path: str, ex, proj_names: dict, out_names: dict, out_module: str, stacked: dict) -> None:
    """What the schema cannot see: distinct projection names, one ``{expert}`` and no other placeholder in
    ``output.module``, distinct orientations."""
    import string

    if len(set(proj_names.values())) != len(proj_names):
        raise LayoutError(f"experts.gate/up/down must be three different names, got {list(proj_names.values())}",
                          file=path)
    if len(set(out_names.values())) != len(out_names):
        raise LayoutError(f"output.gate/up/down must be three different names, got {list(out_names.values())}",
                          file=path)
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(out_module) if f is not None]
    except ValueError as e:
        raise LayoutError(f"output.module {_printable(repr(out_module))} is not a valid template: {e}",
                          file=path) from None
    if [f for f, _, _ in fields] != ["expert"]:
        raise LayoutError(f"output.module must hold {{expert}} exactly once and no other placeholder, got "
                          f"{_printable(repr(out_module))}", file=path)
    if fields[0][1] or fields[0][2]:  # "{expert:>200000000}" would pad each name to 200 MB
        raise LayoutError("output.module must hold a plain {expert}, without a format spec or conversion, got "
                          f"{_printable(repr(out_module))}", file=path)
    for part, st in stacked.items():
        if len(set(st.orientations)) != len(st.orientations):
            raise LayoutError(f"experts.{part}.orientation lists {st.orientations[0]} twice", file=path)
    if ex.rule == "per_expert" and ex.biases:
        raise LayoutError("experts.biases is for stacked layouts (per-expert biases are copied as they are)",
                          file=path)


@cache
def builtin_layouts() -> tuple[Layout, ...]:
    """Every layout shipped in ``configs/``, sorted by file name (``_shared.toml`` is not a layout)."""
    return tuple(load_layout(p) for p in sorted(CONFIGS_DIR.glob("*.toml")) if not p.name.startswith("_"))


def builtin_layout(name: str) -> Layout | None:
    """The shipped layout called ``name``, or None."""
    return next((lay for lay in builtin_layouts() if lay.name == name), None)


# --- facts shared by every family: configs/_shared.toml ---------------------------------------------------------------
class KeptKind(_Schema):
    label: Name
    contains: list[Name]


class VllmAdvice(_Schema):
    marlin_hidden_multiple: int
    marlin_intermediate_multiple: int
    rocm_note: str
    tp_scales_note: str


class SharedFacts(_Schema):
    """``configs/_shared.toml``: facts that hold for every family."""

    nested_config_sections: list[Name]
    mtp_layer_keys: list[Name]
    kept_kinds: list[KeptKind]
    vllm: VllmAdvice


@cache
def shared_facts() -> SharedFacts:
    """The shared facts file, validated.

    Raises:
        LayoutError: the file is missing or does not validate (names the key).
    """
    path = CONFIGS_DIR / SHARED_FILE
    try:
        return SharedFacts.model_validate(tomllib.loads(path.read_text()))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LayoutError(f"cannot read the shared facts file: {e}", file=str(path)) from None
    except ValidationError as e:
        err = e.errors()[0]
        raise LayoutError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", file=str(path)) from None


def nested_configs(config: dict) -> list[tuple[str, dict]]:
    """The nested model configs of a multimodal/wrapper ``config.json`` (``text_config``...), as (key, dict), in
    the order ``configs/_shared.toml`` lists them."""
    return [(n, config[n]) for n in shared_facts().nested_config_sections if isinstance(config.get(n), dict)]


def config_lookup(config: dict, keys: tuple[str, ...]) -> tuple[Any, str | None]:
    """The value of the first of ``keys`` (in priority order; dotted paths allowed) present in ``config``, looking at
    the top level and then in the nested configs (``nested_configs``).

    Returns:
        (value, "scope.key") or (None, None) when no key is present.
    """
    scopes = [("", config)] + [(f"{n}.", c) for n, c in nested_configs(config)]
    for key in keys:
        for scope_name, scope in scopes:
            cur: Any = scope
            for part in key.split("."):
                cur = cur.get(part) if isinstance(cur, dict) else None
            if cur is not None:
                return cur, scope_name + key
    return None, None


def detect_layout(config: dict, layouts: tuple[Layout, ...] | None = None) -> tuple[Layout, str]:
    """The layout for a checkpoint's ``config.json`` and the key that decided it.

    Tried in order: top-level ``model_type``, ``architectures``, then each nested config's ``model_type``.

    Raises:
        LayoutError: no layout covers the model (the message lists what was tried and the known model types).
    """
    layouts = builtin_layouts() if layouts is None else layouts
    mt = config.get("model_type")
    candidates = [(f"model_type={mt!r}", lambda lay, v=mt: v in lay.model_types)]
    archs = config.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        candidates.append((f"architectures={arch!r}", lambda lay, v=arch: v in lay.architectures))
    for n, sub in nested_configs(config):
        if sub.get("model_type"):
            candidates.append((f"{n}.model_type={sub['model_type']!r}",
                               lambda lay, v=sub["model_type"]: v in lay.model_types))
    for what, fits in candidates:
        for lay in layouts:
            if fits(lay):
                return lay, what
    known = sorted({m for lay in layouts for m in lay.model_types})
    raise LayoutError(f"no layout for this model (tried {', '.join(w for w, _ in candidates)}); known model types: "
                      f"{', '.join(known)}", file="config.json", hint="pass --layout FILE to describe it")


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
                if end is not None and (isinstance(end, bool) or not isinstance(end, int)):
                    raise LayoutError(f"moe_layer_end_index must be an integer, got {end!r}", file="config.json")
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

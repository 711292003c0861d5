"""The one model of the routed experts: which tensors they are, how many there are, which layers are MoE, dense or
MTP layers, how a source tensor yields its ``[out, in]`` matrices (orientation, stacking, gate/up row order), and the
output module names, both ways.

``ExpertMap.from_source`` builds it from a layout, a ``config.json`` and the source's (logical) tensors, and checks
everything that can be checked before a byte is written; ``ExpertMap.from_checkpoint`` builds it for a converted
checkpoint from the layout and config it carries. Every other module (plan, pipeline, checkpoint, verify, runtime,
hub) asks this one; none re-derives any of it.

vLLM's experts_int8 layout, whose row order ``w13_rows`` is the one home of: ``w13`` [E, 2I, H] holds each expert's
gate rows, then its up rows (interleaved for some activations); ``w2`` [E, H, I] the down projection (vLLM
``FusedMoE``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Protocol

import torch

from .errors import LayoutError
from .layouts import PROJECTIONS, Layout, config_lookup, moe_layer_indices, shared_facts


def w13_rows(proj: str, intermediate: int, *, interleaved: bool = False) -> slice:
    """The rows of one expert's ``w13`` [2I, ...] (codes, scales or bias) that hold ``proj`` ("gate" or "up"): the
    first ``intermediate`` rows and the next ones, as vLLM fuses them; with ``interleaved`` (what vLLM's layer holds
    for an activation that reads gate and up alternating, ``swigluoai``), the even rows and the odd ones.

    Example:
        >>> w13_rows("up", 4), w13_rows("up", 4, interleaved=True)
        (slice(4, 8, None), slice(1, 8, 2))
    """
    first = proj == "gate"
    if interleaved:
        return slice(0 if first else 1, 2 * intermediate, 2)
    return slice(0, intermediate) if first else slice(intermediate, 2 * intermediate)


def gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """Per-expert w13 rows [E, 2I, ...] (codes, scales or bias) held interleaved (gate 0, up 0, gate 1, ...) as a
    new tensor in the gate-then-up order of ``w13_rows``: row order only, every value kept."""
    inter = interleaved.shape[1] // 2
    return torch.cat([interleaved[:, w13_rows(p, inter, interleaved=True)] for p in ("gate", "up")], dim=1)


class TensorLike(Protocol):
    """What the expert map needs of a tensor: its name, shape and file (a ``LogicalTensor`` or ``TensorInfo``)."""

    name: str
    shape: tuple[int, ...]

    @property
    def file(self) -> str: ...


@dataclass(frozen=True)
class Matrix:
    """One routed-expert projection matrix ``[rows=out, cols=in]`` and the output module it becomes."""

    layer: int
    expert: int
    proj: str  # "gate" | "up" | "down"
    module: str
    rows: int
    cols: int


@dataclass(frozen=True)
class Extract:
    """How a stacked source tensor yields its matrices: viewed as [E, a, b] (flat [E*a, b] alike); ``in_out`` means
    each expert's block is [in, out] and is transposed; ``order`` splits a fused gate_up block's rows into gate and
    up (``concat``: gate rows first; ``interleaved``: even rows gate; ``single``: not fused)."""

    part: str  # "gate_up" | "gate" | "up" | "down"
    orientation: str  # "out_in" | "in_out"
    order: str  # "concat" | "interleaved" | "single"
    experts: int


@dataclass(frozen=True)
class ExpertTensor:
    """A source tensor that holds routed experts, and the matrices it yields, in row order."""

    name: str
    matrices: tuple[Matrix, ...]
    extract: Extract | None = None  # None: the tensor is one per-expert matrix

    @property
    def rows_per_matrix(self) -> int:
        return self.matrices[0].rows

    @property
    def stacked_experts(self) -> int:
        """How many experts the tensor stacks along its leading dimension (0: a per-expert tensor)."""
        return self.extract.experts if self.extract is not None else 0

    def experts_slice(self, first: int, stop: int) -> "ExpertTensor":
        """Experts ``[first, stop)`` of a stacked tensor as an ExpertTensor of their own: their matrices (in row
        order), extracted by ``to_rows`` from the rows ``leading_range(first, stop, shape)`` of the tensor's leading
        dimension. Row ``r`` of the slice's ``to_rows`` is row ``r + first * rows of one expert`` of the whole's."""
        per = len(self.matrices) // self.stacked_experts
        return ExpertTensor(self.name, self.matrices[first * per: stop * per],
                            replace(self.extract, experts=stop - first))

    def leading_range(self, first: int, stop: int, shape: tuple[int, ...]) -> tuple[int, int]:
        """The range of the leading dimension of a stacked tensor of ``shape`` that holds experts ``[first, stop)``:
        ``(first, stop)`` for ``[E, a, b]``, ``(first * a, stop * a)`` for flat ``[E*a, b]``.

        Example:
            >>> et = ExpertTensor("w1", (), Extract("gate", "out_in", "single", 4))
            >>> et.leading_range(1, 3, (4, 8, 2)), et.leading_range(1, 3, (32, 2))
            ((1, 3), (8, 24))
        """
        per = shape[0] // self.stacked_experts
        return first * per, stop * per

    def row_dim(self, shape: tuple[int, ...]) -> int | None:
        """The dimension of this tensor (of ``shape``, as ``to_rows`` takes it) along which each of its matrices'
        rows runs whole, where there is one: a per-row quantity taken over it with keepdim (e.g. a row absmax) goes
        through ``to_rows`` to one value per matrix row, ``[sum of rows, 1]``. -1 where each row is a stored row
        (a per-expert or ``out_in`` tensor); -2 for ``in_out`` experts stacked as ``[E, in, out]`` (a row is a
        column of its expert's block); None for ``in_out`` experts stacked flat (``[E*in, out]``, E > 1)."""
        ex = self.extract
        if ex is None or ex.orientation != "in_out":
            return -1
        return -2 if len(shape) >= 2 and math.prod(shape[:-2]) == ex.experts else None

    def to_rows(self, w: torch.Tensor) -> torch.Tensor:
        """The tensor's matrices stacked by rows, ``[sum of rows, cols]``, in ``matrices`` order.

        Args:
            w: the source tensor as stored (any dtype, any device): [out, in] per expert, or stacked
                [E, a, b] / flat [E*a, b].
        """
        ex = self.extract
        if ex is None:  # per-expert: the tensor is the matrix
            return w
        w = w.reshape(ex.experts, -1, w.shape[-1])
        if ex.orientation == "in_out":
            w = w.transpose(1, 2)
        if ex.order == "interleaved":  # even rows gate, odd rows up -> (e, gate), (e, up)
            return torch.stack((w[:, 0::2], w[:, 1::2]), dim=1).reshape(-1, w.shape[-1])
        return w.reshape(-1, w.shape[-1])  # concat: (e, gate), (e, up) is already row order


@dataclass
class ExpertMap:
    """The routed experts of one model. Layer indices are decoder-layer indices; sizes are element counts.

    Attributes:
        layout: the family layout. num_layers, num_experts: from config.json, validated. hidden_size,
            intermediate_size, top_k: from config.json where it has them (None otherwise).
        moe_layers: layers whose routed experts are quantized; dense_layers: the other decoder layers;
            extra_layers: layers past ``num_layers`` that hold experts (MTP), copied as they are.
        prefix: the module path in front of the decoder-layer container (e.g. ``"model."``).
        config_keys: which config key each number came from (what ``inspect`` shows).
        tensors: source side only: name -> ExpertTensor for every source tensor holding routed experts.
    """

    layout: Layout
    num_layers: int
    num_experts: int
    hidden_size: int | None
    intermediate_size: int | None
    top_k: int | None
    moe_layers: list[int]
    dense_layers: list[int]
    extra_layers: list[int]
    prefix: str
    config_keys: dict[str, str]
    tensors: dict[str, ExpertTensor] = field(default_factory=dict)

    # --- building -------------------------------------------------------------------------------------------------
    @classmethod
    def from_source(cls, layout: Layout, config: dict, tensors: Mapping[str, TensorLike]) -> "ExpertMap":
        """Find and check the routed experts of a source checkpoint.

        Steps: read the config numbers; find the expert tensors by name; pick the decoder prefix; check the MoE
        layers against the config (and MTP layers against their key); check every layer's tensors and shapes.

        Args:
            tensors: name -> tensor (logical tensors: as an unquantized checkpoint holds them).

        Raises:
            LayoutError: config numbers missing or not integers; no expert tensors; experts under two prefixes;
                MoE layers that disagree with the config; missing experts or projections; shapes or orientation
                that do not fit (each names the file and tensor).
        """
        used: dict[str, str] = {}
        nums = _config_numbers(layout, config, used)
        found = _find_expert_tensors(layout, tensors)
        prefix = _decoder_prefix(found, nums["num_layers"])
        moe, dense, extra = _layers(layout, config, found, prefix, nums["num_layers"], tensors)
        em = cls(layout=layout, **nums, moe_layers=moe, dense_layers=dense, extra_layers=extra, prefix=prefix,
                 config_keys=used)
        for L in moe:
            entries = found[(prefix, L)]
            if layout.rule == "per_expert":
                em._add_per_expert_layer(L, entries)
            else:
                em._add_stacked_layer(L, entries)
        n, expected = len(em.matrices), len(moe) * em.num_experts * len(PROJECTIONS)
        if n != expected:
            raise LayoutError(f"{n} routed-expert matrices found, expected {expected} ({len(moe)} MoE layers x "
                              f"{em.num_experts} experts x 3)", file="config.json")
        return em

    @classmethod
    def from_checkpoint(cls, layout: Layout, config: dict, names: Iterable[str]) -> "ExpertMap":
        """The expert map of a converted checkpoint (no source tensors): config numbers and layers, validated, and
        the prefix found from its output module names.

        Args:
            names: the checkpoint's tensor names.

        Raises:
            LayoutError: config numbers missing or not integers, or bad MoE-layer keys.
        """
        used: dict[str, str] = {}
        nums = _config_numbers(layout, config, used)
        moe = moe_layer_indices(layout, config, nums["num_layers"])
        em = cls(layout=layout, **nums, moe_layers=moe, dense_layers=[L for L in range(nums["num_layers"])
                                                                       if L not in moe],
                 extra_layers=[], prefix="", config_keys=used)
        pat = em._module_pattern()
        for n in names:
            m = pat.match(n.rsplit(".", 1)[0]) if "." in n else None
            if m:
                em.prefix = m["prefix"]
                break
        return em

    # --- questions the rest of expq asks --------------------------------------------------------------------------
    def module_name(self, layer: int, expert: int, proj: str) -> str:
        """Output module name of one routed-expert projection, e.g. ``model.layers.3.mlp.experts.7.gate_proj``."""
        mod = self.layout.out_module.format(expert=expert)
        return f"{self.prefix}{self.layout.layers}.{layer}.{mod}.{self.layout.out_names[proj]}"

    def stock_weight_name(self, layer: int) -> str:
        """The tensor name stock transformers loads a MoE layer's fused experts weight from (its in-memory experts
        module and weight, layout ``[runtime]``), e.g. ``model.layers.3.mlp.experts.gate_up_proj``."""
        lay = self.layout
        return f"{self.prefix}{lay.layers}.{layer}.{lay.runtime_module}.{lay.runtime_weight}"

    def parse_module(self, module: str) -> tuple[int, int, str] | None:
        """(layer, expert, proj) of an output module name of a quantized routed expert, else None (also for
        layers past ``num_layers``)."""
        m = self._module_pattern().match(module)
        if not m or int(m["layer"]) >= self.num_layers:
            return None
        return int(m["layer"]), int(m["expert"]), self._proj_of[m["proj"]]

    def modules_with(self, names: Iterable[str], suffix: str) -> dict[tuple[int, int, str], str]:
        """(layer, expert, proj) -> module name for every tensor name ``<module>.<suffix>`` among ``names`` whose
        module is a quantized routed-expert output module (how a format finds its quantized modules)."""
        out = {}
        for n in names:
            module, _, suf = n.rpartition(".")
            if suf == suffix and (key := self.parse_module(module)) is not None:
                out[key] = module
        return out

    def expected_modules(self) -> dict[tuple[int, int, str], str]:
        """Every (layer, expert, proj) the config says is quantized, with its output module name."""
        return {(L, e, p): self.module_name(L, e, p) for L in self.moe_layers for e in range(self.num_experts)
                for p in PROJECTIONS}

    def matrix_shape(self, proj: str) -> tuple[int | None, int | None]:
        """[out, in] of a projection from the config sizes: gate/up [I, H], down [H, I] (None where unknown)."""
        H, I = self.hidden_size, self.intermediate_size
        return (H, I) if proj == "down" else (I, H)

    @property
    def matrices(self) -> list[Matrix]:
        """Every quantized matrix, in source-tensor order."""
        return [m for t in self.tensors.values() for m in t.matrices]

    @property
    def output_projection_names(self) -> list[str]:
        """The output projection module names (e.g. ``["w1", "w2", "w3"]``), sorted."""
        return sorted(set(self.layout.out_names.values()))

    def bias_names(self, layer: int) -> tuple[str, ...]:
        """The expert-bias tensors of a MoE layer (gate_up bias, down bias), where the family has them."""
        base = f"{self.prefix}{self.layout.layers}.{layer}.{self.layout.module}."
        return tuple(base + b for b in self.layout.expert_biases)

    def in_w13_order(self, gate_up: torch.Tensor) -> torch.Tensor:
        """A fused gate_up per-row tensor [E, 2I] of the source's row order (e.g. a bias) in vLLM's w13 row order
        (``w13_rows``: gate rows, then up rows): de-interleaved where the family stores them interleaved."""
        st = self.layout.stacked.get("gate_up")
        return gate_then_up(gate_up) if st is not None and st.order == "interleaved" else gate_up

    def is_runtime_expert_weight(self, numel: int) -> bool:
        """Whether a parameter of ``numel`` elements of transformers' in-memory experts module (layout ``[runtime]
        module``) holds routed-expert weight matrices: at least experts x intermediate x hidden elements (3-D
        stacked, a fused gate_up, or DBRX's 2-D [E*I, H]), where a bias or any other tensor of that module is
        smaller."""
        return numel >= self.num_experts * (self.intermediate_size or 1) * (self.hidden_size or 1)

    def linear_modules(self, tensors: Mapping[str, TensorLike]) -> list[str]:
        """Modules that are linear layers and not routed experts (a 2-D ``.weight``), sorted: what a format's
        ``ignore`` list must name."""
        routed = {m.module for m in self.matrices}
        return sorted({n[: -len(".weight")] for n, t in tensors.items()
                       if n.endswith(".weight") and len(t.shape) == 2 and n not in self.tensors} - routed)

    # --- internals ------------------------------------------------------------------------------------------------
    @property
    def _proj_of(self) -> dict[str, str]:
        return {v: k for k, v in self.layout.out_names.items()}

    def _module_pattern(self) -> re.Pattern[str]:
        lay = self.layout
        mod = re.escape(lay.out_module).replace(re.escape("{expert}"), r"(?P<expert>\d+)")
        names = "|".join(re.escape(n) for n in self._proj_of)
        return re.compile(rf"^(?P<prefix>(?:.*\.)?){re.escape(lay.layers)}\.(?P<layer>\d+)\.{mod}\."
                          rf"(?P<proj>{names})$")

    def _experts_key(self) -> str:
        """The config key the routed-expert count came from (``config_keys``), as the user's config.json spells it."""
        return self.config_keys.get("num_experts", "num_experts")

    def _add_per_expert_layer(self, L: int, entries: list[tuple[TensorLike, dict]]) -> None:
        lay, E = self.layout, self.num_experts
        by_name = {v: k for k, v in lay.proj_names.items()}
        seen: dict[int, dict[str, TensorLike]] = defaultdict(dict)
        for ti, g in entries:
            seen[int(g["expert"])][by_name[g["proj"]]] = ti
        experts = sorted(seen)
        if experts != list(range(E)):
            extra = [e for e in experts if e >= E]
            missing = sorted(set(range(E)) - set(experts))
            detail = f"experts {missing} missing" if missing else f"experts {extra} beyond the configured {E}"
            t = seen[extra[0]] if extra else None
            raise LayoutError(f"layer {L}: {detail} (config.json {self._experts_key()} = {E})",
                              file=(next(iter(t.values())).file if t else "config.json"))
        for e in experts:
            for p in PROJECTIONS:
                ti = seen[e].get(p)
                if ti is None:
                    raise LayoutError(f"layer {L}: {lay.proj_names[p]} missing", expert=e,
                                      tensor=f"{self.prefix}{lay.layers}.{L}.{lay.module}.{e}.{lay.proj_names[p]}"
                                             ".weight")
                _check_shape(ti, tuple(ti.shape), self.matrix_shape(p),
                             "[hidden, intermediate]" if p == "down" else "[intermediate, hidden]")
                rows, cols = ti.shape
                self.tensors[ti.name] = ExpertTensor(ti.name, (Matrix(L, e, p, self.module_name(L, e, p), rows,
                                                                      cols),))
            g, u, d = (tuple(seen[e][p].shape) for p in PROJECTIONS)
            if g != u or d != (g[1], g[0]):
                raise LayoutError(f"layer {L}: gate {list(g)}, up {list(u)} and down {list(d)} do not fit together",
                                  expert=e, tensor=seen[e]["down"].name)

    def _add_stacked_layer(self, L: int, entries: list[tuple[TensorLike, dict]]) -> None:
        lay, E, H, I = self.layout, self.num_experts, self.hidden_size, self.intermediate_size
        by_tensor = {g["tensor"]: ti for ti, g in entries}
        layer_mats: list[Matrix] = []
        for part, st in lay.stacked.items():
            ti = by_tensor.get(st.name)
            if ti is None:
                raise LayoutError(f"layer {L}: stacked expert tensor {st.name} missing",
                                  tensor=f"{self.prefix}{lay.layers}.{L}.{lay.module}.{st.name}")
            block = _stacked_block(ti, st.flat, E)
            fused = part == "gate_up"
            out_dim = (2 * I if I is not None else None) if fused else (H if part == "down" else I)
            in_dim = I if part == "down" else H
            orient = _orientation(st, ti, block, out_dim, in_dim)
            rows, cols = block if orient == "out_in" else (block[1], block[0])
            _check_shape(ti, (rows, cols), (out_dim, in_dim), f"{part} [out, in]")
            if fused and rows % 2:
                raise LayoutError(f"fused gate_up block has an odd number of rows ({rows})", file=ti.file,
                                  tensor=ti.name)
            projs = ("gate", "up") if fused else (part,)
            r = rows // len(projs)
            mats = tuple(Matrix(L, e, p, self.module_name(L, e, p), r, cols) for e in range(E) for p in projs)
            self.tensors[ti.name] = ExpertTensor(ti.name, mats, Extract(part, orient, st.order if fused else "single",
                                                                        E))
            layer_mats += mats
        g = next(m for m in layer_mats if m.proj == "gate")
        d = next(m for m in layer_mats if m.proj == "down")
        if (d.rows, d.cols) != (g.cols, g.rows):
            raise LayoutError(f"layer {L}: gate [{g.rows}, {g.cols}] and down [{d.rows}, {d.cols}] do not fit "
                              "together", tensor=f"{self.prefix}{lay.layers}.{L}.{lay.module}")


# --- steps of from_source ---------------------------------------------------------------------------------------------
MAX_CONFIG_INT = 1 << 20  # layers, experts, sizes read from config.json


def _config_int(config: dict, keys: tuple[str, ...], what: str, used: dict[str, str], required: bool) -> int | None:
    val, where = config_lookup(config, keys)
    if val is None:
        if required:
            raise LayoutError(f"config.json has no {what} (looked for {', '.join(keys)})", file="config.json")
        return None
    used[what] = where
    if isinstance(val, list) and not required:  # e.g. per-layer sizes: not a single number
        return None
    if isinstance(val, bool) or not isinstance(val, int):
        raise LayoutError(f"{where} = {_brief(val)} is not an integer", file="config.json")
    if val < 0:
        raise LayoutError(f"{where} = {val} is negative", file="config.json")
    if val > MAX_CONFIG_INT:  # no model comes near; the loops over layers and experts must stay bounded
        raise LayoutError(f"{where} = {_brief(val)} is too large (at most {MAX_CONFIG_INT})", file="config.json")
    return val


def _brief(v: Any) -> str:
    """A config value for an error line: its repr, cut at 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:60] + "..."


def _config_numbers(layout: Layout, config: dict, used: dict[str, str]) -> dict[str, Any]:
    """num_layers and num_experts (required), hidden_size, intermediate_size and top_k (where present)."""
    k = layout.keys
    nums = {"num_layers": _config_int(config, k["num_layers"], "num_layers", used, True),
            "num_experts": _config_int(config, k["num_experts"], "num_experts", used, True),
            "hidden_size": _config_int(config, k["hidden_size"], "hidden_size", used, False),
            "intermediate_size": _config_int(config, k["intermediate_size"], "intermediate_size", used, False),
            "top_k": _config_int(config, k["top_k"], "top_k", used, False)}
    if nums["top_k"] == 0:  # a router that picks no expert: every MoE layer would output zeros
        raise LayoutError(f"{used['top_k']} = 0: each token must go to at least one routed expert", file="config.json")
    if nums["top_k"] is not None and nums["top_k"] > nums["num_experts"]:  # no engine can route to more experts
        raise LayoutError(f"{used['top_k']} = {nums['top_k']} is more than the {nums['num_experts']} routed experts "
                          f"({used['num_experts']})", file="config.json")
    return nums


def _source_regex(layout: Layout) -> re.Pattern[str]:
    """Source tensor names of routed-expert weights. Groups: ``prefix``, ``layer``; per_expert: ``expert`` and
    ``proj`` (the source projection name); stacked: ``tensor`` (the stacked tensor name)."""
    head = rf"^(?P<prefix>(?:.*\.)?){re.escape(layout.layers)}\.(?P<layer>\d+)\.{re.escape(layout.module)}\."
    if layout.rule == "per_expert":
        names = "|".join(re.escape(n) for n in layout.proj_names.values())
        return re.compile(head + rf"(?P<expert>\d+)\.(?P<proj>{names})\.weight$")
    names = "|".join(re.escape(t.name) for t in layout.stacked.values())
    return re.compile(head + rf"(?P<tensor>{names})$")


def _find_expert_tensors(layout: Layout, tensors: Mapping[str, TensorLike]) -> dict[tuple[str, int], list]:
    regex = _source_regex(layout)
    found: dict[tuple[str, int], list] = defaultdict(list)
    for name, ti in tensors.items():
        m = regex.match(name)
        if m:
            found[(m["prefix"], int(m["layer"]))].append((ti, m.groupdict()))
    if not found:
        first = next(iter(tensors.values()), None)
        raise LayoutError(f"no routed-expert tensors matching the {layout.name} layout ({regex.pattern})",
                          file=first.file if first is not None else None, hint="wrong model_type, or pass --layout FILE")
    return found


def _decoder_prefix(found: dict[tuple[str, int], list], num_layers: int) -> str:
    prefixes = sorted({p for p, L in found if L < num_layers})
    if len(prefixes) > 1:
        raise LayoutError(f"routed experts under more than one prefix ({', '.join(prefixes)}): the layout cannot tell "
                          "which is the decoder", file="config.json")
    return prefixes[0] if prefixes else ""


def _layers(layout: Layout, config: dict, found: dict, prefix: str, num_layers: int,
            tensors: Mapping[str, TensorLike]) -> tuple[list[int], list[int], list[int]]:
    """(MoE, dense, extra) layers: those with experts must be exactly those the config's rules say; layers past
    ``num_layers`` may hold experts only as MTP layers the config declares."""
    expect_moe = moe_layer_indices(layout, config, num_layers)
    got_moe = sorted(L for p, L in found if p == prefix and L < num_layers)
    extra = sorted(L for p, L in found if L >= num_layers)
    if extra:
        keys = tuple(shared_facts().mtp_layer_keys)
        n_mtp, _ = config_lookup(config, keys)
        n_mtp = n_mtp if isinstance(n_mtp, int) and not isinstance(n_mtp, bool) else 0
        beyond = [L for L in extra if L >= num_layers + n_mtp]
        if beyond:
            raise LayoutError(f"layers {beyond} hold routed experts beyond num_hidden_layers={num_layers} and the "
                              f"config declares {n_mtp} MTP layers ({keys[0]})", file="config.json")
    if not got_moe:
        raise LayoutError(f"no routed-expert tensors matching the {layout.name} layout ({_source_regex(layout).pattern})",
                          file=next(iter(tensors.values())).file, hint="wrong model_type, or pass --layout FILE")
    if got_moe != expect_moe:
        missing = sorted(set(expect_moe) - set(got_moe))
        unexpected = sorted(set(got_moe) - set(expect_moe))
        parts = []
        if missing:
            parts.append(f"config says layers {missing} are MoE but they have no routed experts")
        if unexpected:
            rules = ", ".join(layout.moe_layer_rules) or "every layer MoE"
            parts.append(f"layers {unexpected} have routed experts but the config ({rules}) says dense")
        raise LayoutError("; ".join(parts), file="config.json")
    return got_moe, [L for L in range(num_layers) if L not in got_moe], extra


def _check_shape(ti: TensorLike, got: tuple[int, ...], want: tuple[int | None, ...], what: str) -> None:
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = [("?" if w is None else w) for w in want]
        raise LayoutError(f"shape {list(got)} does not match {what} {shown} from config.json", file=ti.file,
                          tensor=ti.name)


def _stacked_block(ti: TensorLike, flat: bool, E: int) -> tuple[int, int]:
    """The per-expert block [a, b] of a stacked tensor [E, a, b] (or flat [E*a, b])."""
    if flat:
        if len(ti.shape) != 2 or ti.shape[0] % E:
            raise LayoutError(f"expected [{E}*rows, cols] (flat stacked experts), got {list(ti.shape)}",
                              file=ti.file, tensor=ti.name)
        return ti.shape[0] // E, ti.shape[1]
    if len(ti.shape) != 3 or ti.shape[0] != E:
        raise LayoutError(f"expected [{E}, rows, cols] (stacked experts, {E} routed experts in config.json), "
                          f"got {list(ti.shape)}", file=ti.file, tensor=ti.name)
    return ti.shape[1], ti.shape[2]


def _orientation(st, ti: TensorLike, block: tuple[int, int], out_dim: int | None, in_dim: int | None) -> str:
    """The orientation of a stacked tensor's per-expert block [a, b]: the layout's, or where it admits two, the one
    the config sizes fit (error when both or neither fit)."""
    if len(st.orientations) == 1:
        return st.orientations[0]
    fits = []
    for o in st.orientations:
        rows, cols = block if o == "out_in" else (block[1], block[0])
        if (out_dim is None or rows == out_dim) and (in_dim is None or cols == in_dim):
            fits.append(o)
    if len(fits) != 1:
        why = "fits both orientations" if fits else "fits neither orientation"
        raise LayoutError(f"per-expert block {list(block)} {why} the layout admits ({', '.join(st.orientations)}) "
                          f"given config sizes out={out_dim}, in={in_dim}: orientation is not decidable",
                          file=ti.file, tensor=ti.name)
    return fits[0]

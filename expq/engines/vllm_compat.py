"""What the expq vLLM plugin needs from vLLM, checked before anything is registered: names, signatures, behaviour.

The plugin is tested against every vLLM release from ``TESTED_RANGE[0]`` to ``TESTED_RANGE[1]`` (their sources read;
0.24, 0.29 and 0.33 driven on a CPU by ``make test-vllm``). What changed there, in what the plugin uses:

* 0.25: ``Int8OnlineMoEMethod._setup_kernel`` converts the weights to the chosen backend's format first
  (``convert_to_int8_moe_kernel_format``; the Triton and CPU backends keep them as they are);
* 0.27: ``_setup_kernel`` also runs the experts kernel's own ``process_weights_after_loading``;
* 0.28: the w2 row maximum is all-reduced across MoE tensor-parallel ranks (full-row scales, as expq stores);
  ``create_weights`` sizes w13 as ``moe.w13_num_shards * I`` (2 for gated activations);
* 0.30: ``Int8OnlineMoEMethod.__init__(*, layer)`` became ``__init__(*, moe: FusedMoEConfig)``;
* 0.32: ``OnlineMoEMethodBase`` refuses requantization sources; 0.33: it gained ``OnlineRequantizationMixin`` and
  ``process_weights_after_loading`` reads the weights through ``get_weights_for_quantization``.

``signature_changes(api)`` checks the signatures the plugin calls; ``behaviour_changes(api)`` runs vLLM's own
``_quantize_weights`` on a small layer: the parameters it leaves (names, dtypes, shapes) must be what the plugin
fills, and their values what expq's scheme computes. A vLLM that differs gets one ``ExpqError`` naming its version
and what changed.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Callable

import torch

TESTED_RANGE = ("0.24", "0.33")
"""The vLLM releases the plugin is tested with (inclusive; ``pyproject.toml``'s ``vllm`` extra says the same)."""

# (module, attribute[, attribute of it]) that the plugin uses.
NEEDED: tuple[tuple[str, ...], ...] = (
    ("vllm.model_executor.layers.quantization", "register_quantization_config"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),
    ("vllm.model_executor.layers.linear", "LinearBase"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    ("vllm.model_executor.layers.fused_moe", "RoutedExperts", "_map_global_expert_id_to_local_expert_id"),
    ("vllm.model_executor.layers.fused_moe.activation", "MoEActivation", "SWIGLUOAI"),
    ("vllm.model_executor.layers.quantization.online.int8", "Int8OnlineMoEMethod", "_setup_kernel"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader", "get_all_weights"),
    ("vllm.model_executor.utils", "set_weight_attrs"),
)

CONSTRUCTORS = {"layer": "vLLM 0.24-0.29", "moe": "vLLM 0.30-0.33"}
"""Int8OnlineMoEMethod's keyword-only constructor argument -> the releases that have it. ``layer``: the
RoutedExperts layer; ``moe``: its ``moe_config``."""

# (what, callable getter, the parameter names the plugin calls it with, after self; "**" = accepts **kwargs)
_SIGNATURES: tuple[tuple[str, Callable, tuple[str, ...]], ...] = (
    ("Int8OnlineMoEMethod.create_weights", lambda a: a.Int8OnlineMoEMethod.create_weights,
     ("layer", "num_experts", "hidden_size", "intermediate_size_per_partition", "params_dtype", "**")),
    ("Int8OnlineMoEMethod._setup_kernel", lambda a: a.Int8OnlineMoEMethod._setup_kernel, ("layer",)),
    ("Int8OnlineMoEMethod.process_weights_after_loading",
     lambda a: a.Int8OnlineMoEMethod.process_weights_after_loading, ("layer",)),
    ("DefaultModelLoader.get_all_weights", lambda a: a.DefaultModelLoader.get_all_weights,
     ("model_config", "model")),
    ("RoutedExperts._map_global_expert_id_to_local_expert_id",
     lambda a: a.RoutedExperts._map_global_expert_id_to_local_expert_id, ("expert_id",)),
)


def constructor_keyword(method_cls: type) -> str | None:
    """The keyword-only argument of ``method_cls.__init__`` that the plugin knows (``CONSTRUCTORS``), or None."""
    params = _params(method_cls.__init__)
    required = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                     and p.kind is not inspect.Parameter.VAR_KEYWORD)
    return required[0] if len(required) == 1 and required[0] in CONSTRUCTORS else None


def _params(fn: Callable) -> list[inspect.Parameter]:
    """``fn``'s parameters after ``self``."""
    return list(inspect.signature(fn).parameters.values())[1:]


def _describe(fn: Callable) -> str:
    """``fn``'s signature after ``self``, without annotations, e.g. ``(*, moe)``."""
    return str(inspect.Signature([p.replace(annotation=p.empty) for p in _params(fn)]))


def _fits(fn: Callable, named: tuple[str, ...], kwargs: bool) -> bool:
    """``fn`` (after self) starts with the parameters ``named``, needs no other argument, and takes ``**kwargs``
    where ``kwargs``."""
    params = _params(fn)
    plain = [p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if tuple(p.name for p in plain[:len(named)]) != named:
        return False
    if any(p.default is p.empty for p in plain[len(named):]):
        return False
    return not kwargs or any(p.kind is p.VAR_KEYWORD for p in params)


def signature_changes(api: SimpleNamespace) -> list[str]:
    """What differs from the signatures the plugin calls (empty when nothing does)."""
    changes = []
    init = api.Int8OnlineMoEMethod.__init__
    if constructor_keyword(api.Int8OnlineMoEMethod) is None:
        known = " or ".join(f"(*, {k}) ({v})" for k, v in CONSTRUCTORS.items())
        changes.append(f"Int8OnlineMoEMethod.__init__ takes {_describe(init)}; the plugin knows {known}")
    for what, get, want in _SIGNATURES:
        named = tuple(w for w in want if w != "**")
        if not _fits(get(api), named, "**" in want):
            changes.append(f"{what} takes {_describe(get(api))}, the plugin calls it with "
                           f"({', '.join(named)}{', **kwargs' if '**' in want else ''})")
    sig = inspect.signature(api.set_weight_attrs)
    if len(sig.parameters) != 2:
        changes.append(f"set_weight_attrs takes {sig}, the plugin calls it with (weight, weight_attrs)")
    return changes


# --- behaviour: vLLM's own online quantization on a small layer ------------------------------------------------------
PROBE_SHAPE = (2, 8, 12)
"""(experts, intermediate, hidden) of the probe layer."""


def probe_weights(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A small w13 [E, 2I, H] and w2 [E, H, I] (``PROBE_SHAPE``) in ``dtype`` whose rows hold ties of w / scale
    (multiples of half a step), an all-zero row and signs both ways: what the arithmetic must agree on."""
    E, I, H = PROBE_SHAPE
    g = torch.Generator().manual_seed(1234)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).to(dtype)
    w13[0, 0] = torch.linspace(-1.0, 1.0, H).to(dtype)
    w13[0, 1, : 5] = torch.tensor([127.0, 0.5, 1.5, -2.5, -126.5]).to(dtype) / 64
    w13[1, 3] = 0
    w2[1, 0, : 3] = torch.tensor([-127.0, 63.5, 0.5]).to(dtype)
    return w13, w2


def online_int8(method_cls: type, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's ``_quantize_weights`` (what ``--quantization experts_int8`` holds before ``_setup_kernel``) on one
    layer of TP size 1, with ``method_cls`` unbound: {parameter name: tensor} as it leaves them.

    Raises:
        Exception: whatever vLLM's function raises (the caller reports it).
    """
    layer = torch.nn.Module()
    layer.register_parameter("w13_weight", torch.nn.Parameter(w13.clone(), requires_grad=False))
    layer.register_parameter("w2_weight", torch.nn.Parameter(w2.clone(), requires_grad=False))
    layer.num_experts = layer.local_num_experts = w13.shape[0]
    this = SimpleNamespace(moe=SimpleNamespace(tp_size=1))
    method_cls._quantize_weights(this, layer)
    return {n: p.data for n, p in layer.named_parameters()}


def behaviour_changes(api: SimpleNamespace) -> tuple[list[str], list[str]]:
    """(changes the plugin cannot serve with, differences it can): the parameters vLLM's online int8 method leaves
    against the ones the plugin fills (``expq.engines.moe_loading.empty_params``), and their values against expq's
    scheme on the same weights."""
    from ..scheme import quantize_rows
    from .moe_loading import empty_params

    w13, w2 = probe_weights()
    try:
        got = online_int8(api.Int8OnlineMoEMethod, w13, w2)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return [f"Int8OnlineMoEMethod._quantize_weights fails on a {list(w13.shape)} layer: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"], []
    E, I, H = PROBE_SHAPE
    want = {k: (v.dtype, tuple(v.shape)) for k, v in empty_params(E, H, I).items()}
    have = {k: (v.dtype, tuple(v.shape)) for k, v in got.items()}
    if have != want:
        show = lambda d: ", ".join(f"{k} {str(t).removeprefix('torch.')} {list(s)}"  # noqa: E731
                                   for k, (t, s) in sorted(d.items()))
        return [f"the online int8 method now holds {show(have)}; the plugin fills {show(want)}"], []
    differ = []
    for name, w in (("w13", w13), ("w2", w2)):
        pairs = [quantize_rows(w[e]) for e in range(E)]
        codes = torch.stack([c for c, _ in pairs])
        scales = torch.stack([s.float() for _, s in pairs])
        if not (torch.equal(got[f"{name}_weight"], codes) and torch.equal(got[f"{name}_scale"], scales)):
            differ.append(name)
    notes = [f"this vLLM's online experts_int8 quantizes {' and '.join(differ)} differently from expq's scheme: "
             "outputs will differ from --quantization experts_int8"] if differ else []
    return [], notes

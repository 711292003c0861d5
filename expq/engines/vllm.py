"""The vLLM plugin: serve a checkpoint in the format ``SERVED`` (``expq convert --format experts-int8``) with vLLM's
own experts_int8 kernel.

Entry point (``pyproject.toml``): ``[project.entry-points."vllm.general_plugins"] expq =
"expq.engines.vllm:register"``; vLLM calls ``register()`` in every process it starts, possibly more than once.

What ``register()`` does (vLLM 0.24-0.33; ``vllm_compat`` checks the vLLM it runs on and says what changed):

1. registers the quantization config ``expq_experts_int8`` (the checkpoint's ``quantization_config.quant_method``)
   with ``vllm.model_executor.layers.quantization.register_quantization_config``. Its ``get_quant_method`` gives
   linear layers ``UnquantizedLinearMethod`` and each ``RoutedExperts`` layer an ``ExpqInt8MoEMethod``: a subclass
   of vLLM's online ``Int8OnlineMoEMethod`` (what ``--quantization experts_int8`` runs) whose ``create_weights``
   makes the final int8 / fp32 tensors on the real device (``w13_weight`` int8 [E_local, 2*I_r, H], ``w2_weight``
   int8 [E_local, H, I_r], ``w13_scale`` fp32 [E_local, 2*I_r], ``w2_scale`` fp32 [E_local, H], plus
   ``w13_bias`` / ``w2_bias`` in the model dtype where the layer has biases, loaded by the model's own loader), and
   whose ``process_weights_after_loading`` quantizes nothing: it checks that every piece arrived and sets up the
   same int8_w8a16 Triton modular kernel as the online method (with ``EXPQ_VLLM_KERNEL=expq``, ``apply`` runs
   expq's fused-MoE kernel instead where it can serve the layer: ``expq.engines.vllm_kernel``);
2. wraps ``DefaultModelLoader.get_all_weights``: for a model served with ``quantization == "expq_experts_int8"``,
   each tensor the checkpoint's format classifies as a routed-expert piece is loaded straight into its layer
   (``expq.engines.moe_loading``: tensor and expert parallelism, interleaved w13 rows for ``swigluoai``), markers
   are dropped, and every other tensor goes to the model's own ``load_weights`` unchanged. When the stream ends,
   every layer must be complete;
3. makes the two classes attributes of this module (``ExpqExpertsInt8Config``, ``ExpqInt8MoEMethod``; a process
   that asks for them first, e.g. by unpickling, gets them built then), so that pickles refer to them by name:
   ``vllm serve`` spawns its engine and sends it the VllmConfig, quantization config included, through cloudpickle.

``import expq.engines.vllm`` never imports vLLM; a vLLM without the internals used here, or whose signatures or
online int8 behaviour differ from what the plugin was tested with (``vllm_compat``), gives one ``ExpqError``
naming the vLLM version and what changed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch

from ..checkpoint import ConvertedCheckpoint
from ..errors import ExpqError, LayoutError, SourceError
from ..formats.experts_int8 import ExpertsInt8Format
from . import vllm_compat as compat
from .moe_loading import LayerLoader, Partition, empty_params, route_weights
from .vllm_kernel import LOGGER as LOGGER, log  # LOGGER: the plugin's logger, named here too

SERVED = ExpertsInt8Format
"""The format the plugin serves: int8 codes and per-row scales, the tensors vLLM's experts_int8 method holds."""
QUANT_METHOD = SERVED.quant_method
"""The ``quant_method`` of the checkpoint's ``quantization_config`` and the name of the registered vLLM config."""

_LOCK = threading.Lock()
# "api", "config_cls", "method_cls" once registered ("refusal": why not, on an unsupported vLLM); "routing": the
# last loader call's quantization.
_STATE: dict[str, Any] = {}


def vllm_version() -> str:
    """The version of the vLLM that ``import vllm`` gives (its ``__version__``, else its distribution's), "not
    installed" when there is none."""
    if not _importable("vllm"):
        return "not installed"
    version = getattr(importlib.import_module("vllm"), "__version__", None)
    try:
        return version or importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def vllm_api() -> SimpleNamespace:
    """The vLLM objects the plugin uses, by attribute name (``api.RoutedExperts``, ...).

    Raises:
        ExpqError: vLLM is not installed, or lacks one of them (the message names the vLLM version and each
            missing object).
    """
    if not _importable("vllm"):
        raise ExpqError("the expq vLLM plugin needs vLLM, which is not installed",
                        hint="pip install 'expq[vllm]'")
    found, missing = {}, []
    for module, attr, *sub in compat.NEEDED:
        try:
            obj = getattr(importlib.import_module(module), attr)
            for s in sub:
                getattr(obj, s)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attr}" + "".join(f".{s}" for s in sub))
            continue
        found[attr] = obj
    tested = "-".join(compat.TESTED_RANGE)
    low, high = compat.TESTED_RANGE
    hint = f"install a vLLM the plugin supports: pip install 'vllm>={low},<{_next(high)}'"
    if missing:
        raise ExpqError(f"vLLM {vllm_version()} lacks what the expq plugin uses (tested with vLLM {tested}): "
                        f"{', '.join(missing)}", hint=hint)
    api = SimpleNamespace(**found)
    _check_contract(api, f"vLLM {vllm_version()} changed what the expq plugin uses (tested with vLLM {tested})", hint)
    api.ctor = compat.constructor_keyword(api.Int8OnlineMoEMethod)
    return api


def _check_contract(api: SimpleNamespace, what: str, hint: str) -> None:
    """The signatures, then the online int8 behaviour (``vllm_compat``); differences that only change the numbers
    of ``--quantization experts_int8`` are logged.

    Raises:
        ExpqError: ``what: <each change>``.
    """
    changed = compat.signature_changes(api)
    if not changed:
        changed, notes = compat.behaviour_changes(api)
        for note in notes:
            log(logging.WARNING, "expq plugin on vLLM %s: %s", vllm_version(), note)
    if changed:
        raise ExpqError(f"{what}: {'; '.join(changed)}", hint=hint)


def _next(version: str) -> str:
    """The release line after ``version`` ("0.33" -> "0.34")."""
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


# --- registration -------------------------------------------------------------------------------------------------
def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``expq_experts_int8`` quantization config and route
    expq's expert tensors in vLLM's default loader. Idempotent (vLLM calls it in every process, maybe twice).

    A vLLM that lacks the internals the plugin uses (``vllm_api``) must still serve other models: then the config
    registered under the same name refuses to load, with ``vllm_api``'s ``ExpqError`` (the vLLM version and what is
    missing), so only an expq checkpoint fails, with that message.

    Raises:
        ExpqError: vLLM is not installed, or lacks even ``register_quantization_config``.
    """
    with _LOCK:
        if "config_cls" in _STATE:
            return
        try:
            api = vllm_api()
        except ExpqError as err:
            _register_refusal(err)
            return
        method_cls = _publish(_method_class(api), "ExpqInt8MoEMethod")
        config_cls = _publish(_config_class(api, method_cls), "ExpqExpertsInt8Config")
        api.register_quantization_config(QUANT_METHOD)(config_cls)
        _patch_loader(api)
        _STATE.update(api=api, config_cls=config_cls, method_cls=method_cls)


_PUBLISHED = ("ExpqInt8MoEMethod", "ExpqExpertsInt8Config", "ExpqUnsupportedVllm")


def _publish(cls: type, name: str) -> type:
    """Make ``cls`` (built on vLLM's classes at registration) importable as ``expq.engines.vllm.<name>``, so that
    pickling refers to it by name. ``vllm serve`` spawns its engine process and sends it the VllmConfig, which
    holds the quantization config instance, through cloudpickle: a class that cannot be found by name is sent by
    value, a copy whose methods see a copy of this module's state and not the routing the engine process does."""
    cls.__module__, cls.__qualname__, cls.__name__ = __name__, name, name
    globals()[name] = cls
    return cls


def __getattr__(name: str):
    # A process that unpickles a published class before vLLM loaded the plugin (a spawned engine or worker) makes
    # the classes here first.
    if name in _PUBLISHED:
        try:
            register()
        except ExpqError as err:  # no vLLM: the class does not exist (hasattr / getattr(..., default) work)
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {err}") from None
        if name in globals():
            return globals()[name]
        if "refusal" in _STATE:  # this process's vLLM lacks what the plugin uses: say so, not only "no attribute"
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {_STATE['refusal']}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_refusal(err: ExpqError) -> None:
    """Register, under ``QUANT_METHOD``, a config whose ``from_config`` raises ``err`` (else raise ``err``)."""
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    except ImportError:
        raise err from None

    class ExpqUnsupportedVllm(QuantizationConfig):  # type: ignore[misc, valid-type]
        @classmethod
        def get_name(cls):
            return QUANT_METHOD

        @classmethod
        def get_supported_act_dtypes(cls):
            return [torch.bfloat16, torch.half]

        @classmethod
        def get_min_capability(cls):
            return 80

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            raise err

        def get_quant_method(self, layer, prefix):
            raise err

    log(logging.WARNING, "expq's vLLM plugin is inactive: %s", err)
    register_quantization_config(QUANT_METHOD)(_publish(ExpqUnsupportedVllm, "ExpqUnsupportedVllm"))
    _STATE.update(config_cls=ExpqUnsupportedVllm, refusal=err)


def _config_class(api: SimpleNamespace, method_cls: type) -> type:
    """vLLM's QuantizationConfig for expq checkpoints (one class per process)."""

    class ExpqExpertsInt8Config(api.QuantizationConfig):
        """Routed experts stored as experts_int8 codes and scales by expq; linear layers unquantized."""

        def __init__(self, checkpoint_config: dict | None = None):
            super().__init__()
            self.checkpoint_config = dict(checkpoint_config or {})

        @classmethod
        def get_name(cls) -> str:
            return QUANT_METHOD

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.bfloat16, torch.half]

        @classmethod
        def get_min_capability(cls) -> int:
            return 80

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "ExpqExpertsInt8Config":
            method = config.get("quant_method", QUANT_METHOD)
            if method != QUANT_METHOD:
                raise ExpqError(f"quantization_config quant_method {method!r} is not {QUANT_METHOD!r}")
            return cls(config)

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            if isinstance(layer, api.LinearBase):
                return api.UnquantizedLinearMethod()
            if isinstance(layer, api.RoutedExperts):
                return method_cls(layer=layer)
            return None

    return ExpqExpertsInt8Config


def _refuse_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args, **kwargs):
    """The weight loader of the int8 expert parameters: only the plugin's routing fills them."""
    raise ExpqError(f"a {loaded_weight.dtype} {list(loaded_weight.shape)} tensor reached an expq int8 expert "
                    "parameter through the model's own loader; only the plugin's routing may fill it",
                    hint=f"was this checkpoint written by expq convert --format {SERVED.name}?")


def _method_class(api: SimpleNamespace) -> type:
    """The MoE method: vLLM's online int8 method with the stored tensors instead of a quantization pass."""

    class ExpqInt8MoEMethod(api.Int8OnlineMoEMethod):
        """vLLM's ``Int8OnlineMoEMethod`` (int8_w8a16 Triton modular kernel) over codes and scales read
        from the checkpoint: ``create_weights`` makes the int8 / fp32 parameters on the real device (not meta),
        ``process_weights_after_loading`` checks that they were filled and sets up the kernel, nothing else."""

        uses_meta_device = False
        expq_experts = None  # vllm_kernel.ExpqExperts, set after loading where expq's kernel serves the layer

        def __init__(self, *, layer: torch.nn.Module):
            # vLLM 0.24-0.29: __init__(*, layer); 0.30-0.33: __init__(*, moe: FusedMoEConfig) (vllm_compat)
            super().__init__(**{api.ctor: layer if api.ctor == "layer" else layer.moe_config})
            self.loader: LayerLoader | None = None

        @property
        def supports_eplb(self) -> bool:  # redundant expert slots are not routed by the plugin
            return False

        def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs):
            shards = getattr(self.moe, "w13_num_shards", 2)  # vLLM >= 0.28; 2 for gated activations
            if shards != 2:
                raise ExpqError(f"{getattr(layer, 'layer_name', 'a MoE layer')}: vLLM builds w13 from {shards} "
                                "projection(s); expq checkpoints hold gate and up (a gated activation)")
            layer.num_experts = num_experts
            layer.orig_dtype = params_dtype
            layer.weight_block_size = None
            for name, t in empty_params(num_experts, hidden_size, intermediate_size_per_partition).items():
                p = torch.nn.Parameter(t, requires_grad=False)
                layer.register_parameter(name, p)
                api.set_weight_attrs(p, {"weight_loader": _refuse_loader})
            if self.moe.has_bias:  # as vLLM's online method makes them, but on the device: the model loads them
                for name, shape in (("w13_bias", (num_experts, 2 * intermediate_size_per_partition)),
                                    ("w2_bias", (num_experts, hidden_size))):
                    p = torch.nn.Parameter(torch.zeros(*shape, dtype=params_dtype), requires_grad=False)
                    layer.register_parameter(name, p)
                    api.set_weight_attrs(p, extra_weight_attrs)
            layer.w13_input_scale = None
            layer.w2_input_scale = None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if getattr(layer, "_already_called_process_weights_after_loading", False):
                return
            if self.loader is None:
                if "routing" not in _STATE:
                    why = "vLLM's default loader never ran (the plugin routes expert tensors there only)"
                    hint = "serve with --load-format auto or safetensors"
                elif _STATE["routing"] != QUANT_METHOD:
                    why = f"the default loader ran for quantization {_STATE['routing']!r}, not {QUANT_METHOD!r}"
                    hint = "serve without --quantization: the checkpoint's quantization_config names the method"
                else:
                    why = "the routing found no such layer"
                    hint = f"was the checkpoint written by expq convert --format {SERVED.name} for this model?"
                raise SourceError(f"{getattr(layer, 'layer_name', 'a MoE layer')}: no expq expert tensor was "
                                  f"loaded: {why}", hint=hint)
            self.loader.check_complete()
            self._setup_kernel(layer)
            from . import vllm_kernel  # EXPQ_VLLM_KERNEL: expq's kernel or vLLM's for this layer

            self.expq_experts = vllm_kernel.setup(self, layer)
            layer._already_called_process_weights_after_loading = True

        def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
            if self.expq_experts is None:
                return super().apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
            return self.expq_experts(layer, x, topk_weights, topk_ids)

    return ExpqInt8MoEMethod


# --- weight routing -----------------------------------------------------------------------------------------------
def _patch_loader(api: SimpleNamespace) -> None:
    """Wrap ``DefaultModelLoader.get_all_weights`` once (the original is kept as ``_expq_original``)."""
    cls = api.DefaultModelLoader
    original = cls.get_all_weights
    if getattr(original, "_expq_original", None) is not None:
        return

    def get_all_weights(self, model_config, model):
        weights = original(self, model_config, model)
        _STATE["routing"] = getattr(model_config, "quantization", None)
        if _STATE["routing"] != QUANT_METHOD:
            return weights
        return routed_weights(weights, model_config, model, getattr(self.load_config, "download_dir", None))

    get_all_weights._expq_original = original  # type: ignore[attr-defined]
    get_all_weights.__doc__ = original.__doc__
    cls.get_all_weights = get_all_weights


def routed_weights(weights: Iterable[tuple[str, torch.Tensor]], model_config, model: torch.nn.Module,
                   download_dir: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's weight stream with expq's expert tensors loaded into ``model``'s RoutedExperts layers (see the
    module docstring). The checkpoint is opened when the first tensor arrives (vLLM has the files by then).

    Raises:
        ExpqError: the checkpoint cannot be read, a layer cannot be found or does not fit, a piece is missing.
    """
    it = iter(weights)
    first = next(it, None)
    if first is None:
        return
    ck = ConvertedCheckpoint(checkpoint_dir(model_config, download_dir))
    if ck.format.quant_method != QUANT_METHOD:
        raise SourceError(f"{model_config.model} is served as {QUANT_METHOD} but its format is {ck.format.name} "
                          f"(quant_method {ck.format.quant_method})")
    _warn_dtype(ck, model_config)
    loaders = attach_loaders(model, ck)
    yield from route_weights(itertools.chain([first], it), ck.format.classify, loaders)


def _warn_dtype(ck, model_config) -> None:
    """Online experts_int8 quantizes in the serving dtype: the stored codes equal it only when the checkpoint was
    converted in that dtype (expq.json's dtype)."""
    converted = getattr(getattr(ck.manifest, "options", None), "dtype", None)
    served = str(getattr(model_config, "dtype", "")).removeprefix("torch.")
    if converted and served and converted != served:
        log(logging.WARNING, "%s was converted in %s but is served in %s: outputs will differ from online "
            "experts_int8 in %s (serve with --dtype %s)", model_config.model, converted, served, served, converted)


def checkpoint_dir(model_config, download_dir: str | None = None) -> Path:
    """The local directory of ``model_config.model``: itself when it is a directory, else the Hub snapshot
    (``model_config.revision``) in the cache vLLM downloaded it to: the JSON files (index, expq.json, config) and
    the safetensors shards (not ``original/``), which vLLM has fetched into that cache already (so nothing is
    downloaded twice; a checkpoint without an index is read through its one shard's header)."""
    path = Path(model_config.model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_config.model, revision=getattr(model_config, "revision", None),
                                  cache_dir=download_dir, allow_patterns=["*.json", "*.safetensors"],
                                  ignore_patterns=["original/**/*"]))  # as vLLM's own download


def attach_loaders(model: torch.nn.Module, ck, api: SimpleNamespace | None = None,
                   method_cls: type | None = None) -> dict[int, LayerLoader]:
    """One ``LayerLoader`` per RoutedExperts layer of ``model`` that runs the expq method, keyed by its decoder
    layer (the unique such module whose dotted name contains ``.<layout.layers>.<L>.``), also set as the method's
    ``loader``.

    Raises:
        LayoutError: a layer's module cannot be placed, two modules claim one layer, the layer is not a MoE layer
            of the checkpoint, or its expert count differs.
    """
    api = api or _STATE["api"]
    method_cls = method_cls or _STATE["method_cls"]
    pattern = re.compile(rf"\.{re.escape(ck.layout.layers)}\.(\d+)\.")
    loaders: dict[int, LayerLoader] = {}
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, api.RoutedExperts) or not isinstance(module.quant_method, method_cls):
            continue
        m = pattern.search(f".{name}.")
        if m is None:
            raise LayoutError(f"RoutedExperts module {name} is not under a '{ck.layout.layers}.<L>' layer")
        L = int(m[1])
        if L in owners:
            raise LayoutError(f"layer {L} has two RoutedExperts modules: {owners[L]} and {name}")
        if L not in ck.moe_layers:
            raise LayoutError(f"module {name} is a MoE layer of the model but layer {L} is not one of the "
                              f"checkpoint's ({ck.moe_layers})")
        if module.global_num_experts != ck.num_experts:
            raise LayoutError(f"module {name} has {module.global_num_experts} experts, the checkpoint "
                              f"{ck.num_experts}")
        owners[L] = name
        loader = LayerLoader(L, {k: getattr(module, k).data for k in ("w13_weight", "w2_weight", "w13_scale",
                                                                      "w2_scale")},
                             ck.num_experts, partition(module, api),
                             describe=lambda e, p, L=L: ck.experts.module_name(L, e, p))
        module.quant_method.loader = loader
        loaders[L] = loader
    return loaders


def partition(module: torch.nn.Module, api: SimpleNamespace | None = None) -> Partition:
    """This rank's share of a RoutedExperts layer, read as vLLM's own ``weight_loader`` reads it: the
    tensor-parallel rank/size of ``moe_config.moe_parallel_config`` (``tp_rank`` via ``moe_config.tp_rank``),
    the layer's global -> local expert mapping, and interleaved w13 rows for the ``swigluoai`` activation."""
    api = api or _STATE["api"]
    pc = module.moe_config.moe_parallel_config
    emap = tuple(int(module._map_global_expert_id_to_local_expert_id(e)) for e in range(module.global_num_experts))
    return Partition(tp_rank=int(module.moe_config.tp_rank), tp_size=int(pc.tp_size), expert_map=emap,
                     interleaved=module.activation == api.MoEActivation.SWIGLUOAI)

"""Driving the real vLLM package on a CPU: vLLM's own MoE layers (``FusedMoE`` / ``FusedMoEFactory`` ->
``MoERunner`` -> ``RoutedExperts``) built with a quantization config, weights fed through vLLM's own loaders.

vLLM finds no GPU here, so the platform is vLLM's ``CpuPlatform``; ``gpu(sm)`` makes that platform answer the
probes a CUDA GPU of compute capability ``sm`` would (``is_cuda``, ``get_device_capability``, ...) while layers are
built, so that vLLM's oracles pick the backend they would pick on that GPU. Nothing here runs a GPU kernel.

``start(tp_size, rank, port)`` must run before a layer is built: it sets the VllmConfig and a gloo process group
(``tp_size`` processes for tensor parallelism).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import socket
from pathlib import Path

import torch

import vllm.platforms as _platforms  # noqa: I001 - the platform is chosen before anything else of vLLM is imported
from vllm.platforms.cpu import CpuPlatform

_platforms._current_platform = CpuPlatform()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402

import vllm.model_executor.layers.fused_moe as _fm  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.experts_int8 import ExpertsInt8Config  # noqa: E402

# modules whose import-time probes must see the CPU (they are imported here, before gpu() forces anything)
for _m in ("vllm.model_executor.layers.quantization.online.int8",
           "vllm.model_executor.layers.quantization.online.fp8",
           "vllm.model_executor.layers.fused_moe.oracle.int_wna16",
           "vllm.model_executor.layers.fused_moe.experts.marlin_moe",
           "vllm.model_executor.layers.fused_moe.experts.fused_humming_moe",
           "vllm.model_executor.layers.fused_moe.experts.triton_moe",
           "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe",
           "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
           ".compressed_tensors_moe_wna16",
           "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
           ".compressed_tensors_moe_wna16_marlin"):
    try:
        importlib.import_module(_m)
    except ImportError:  # not in every release
        pass

VERSION = tuple(int(x) for x in importlib.metadata.version("vllm").split(".")[:2])
FACTORY = getattr(_fm, "FusedMoEFactory", None) or _fm.FusedMoE  # renamed in 0.27

_VLLM_CONFIG: list = []


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(tp_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """Enter a default VllmConfig and a gloo group of ``tp_size`` ranks (this process is ``rank``)."""
    ctx = set_current_vllm_config(VllmConfig())
    ctx.__enter__()
    _VLLM_CONFIG.append(ctx)
    init_distributed_environment(world_size=tp_size, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    initialize_model_parallel(tp_size, 1)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the vllm.general_plugins entry points: expq's register()


def set_moe_backend(name: str) -> None:
    """``--moe-backend NAME`` ("auto", "marlin", ...) for the layers built from now on."""
    from vllm.config import get_current_vllm_config

    get_current_vllm_config().kernel_config.moe_backend = name


@contextlib.contextmanager
def gpu(sm: int):
    """vLLM's platform answers as a CUDA GPU of compute capability ``sm`` (80, 90, 100) would, inside."""
    p = _platforms._current_platform
    saved = dict(vars(p))
    major, minor = divmod(sm, 10)
    p.is_cuda_alike = lambda: True
    p.is_cuda = lambda: True
    p.is_cpu = lambda: False
    p.get_device_capability = lambda device_id=0: DeviceCapability(major, minor)
    p.has_device_capability = lambda cap, device_id=0: (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]) <= sm
    p.is_device_capability = lambda cap, device_id=0: (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]) == sm
    p.is_device_capability_family = lambda cap, device_id=0: (cap if isinstance(cap, int)
                                                               else cap[0] * 10 + cap[1]) // 10 == major
    try:
        yield
    finally:
        vars(p).clear()
        vars(p).update(saved)


# (gate, down, up) checkpoint names the model classes pass to the factory (vLLM >= 0.25; >= 0.32 the
# compressed-tensors scheme of a MoE layer is looked up under them)
CKPT_NAMES = {"mixtral": ("w1", "w2", "w3")}


def moe_layer(config: dict, quant_config, prefix: str, *, params_dtype=torch.bfloat16, sm: int = 90):
    """One MoE layer as a model's ``__init__`` builds it, for a transformers ``config`` dict: returns the
    ``RoutedExperts`` module (inside the ``MoERunner`` vLLM's factory returns)."""
    import inspect

    act = "swigluoai" if config.get("model_type") == "gpt_oss" else "silu"
    extra = {}
    if "ckpt_names" in inspect.signature(FACTORY).parameters:
        extra["ckpt_names"] = CKPT_NAMES.get(config.get("model_type"), ("gate_proj", "down_proj", "up_proj"))
    E = config.get("num_local_experts") or config.get("num_experts")
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    with gpu(sm):
        runner = FACTORY(num_experts=E, top_k=config.get("num_experts_per_tok", 2), hidden_size=config["hidden_size"],
                         intermediate_size=inter, params_dtype=params_dtype, quant_config=quant_config,
                         prefix=prefix, activation=act, has_bias=config.get("model_type") == "gpt_oss", **extra)
    return runner.routed_experts if hasattr(runner, "routed_experts") else runner


def quant_config_of(checkpoint: Path):
    """vLLM's QuantizationConfig for a checkpoint's ``quantization_config`` (as ``vllm serve`` reads it)."""
    import json

    q = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    if q["quant_method"] == "compressed-tensors":
        return CompressedTensorsConfig.from_config(q)
    from vllm.model_executor.layers.quantization import get_quantization_config

    return get_quantization_config(q["quant_method"]).from_config(q)


def online_config() -> ExpertsInt8Config:
    """What ``--quantization experts_int8`` runs."""
    return ExpertsInt8Config()


SHARD = {"gate": "w1", "up": "w3", "down": "w2"}
"""vLLM's weight_loader shard ids per projection."""


def load_expert(layer, param_name: str, tensor: torch.Tensor, weight_name: str, proj: str, expert: int) -> None:
    """One checkpoint tensor into ``layer``'s parameter through vLLM's own ``weight_loader`` (the layer's
    ``weight_loader``, or the online processing wrapper vLLM put on the parameter)."""
    param = getattr(layer, param_name)
    param.weight_loader(param, tensor, weight_name, shard_id=SHARD[proj], expert_id=expert)


def checkpoint_stream(root: Path):
    """(name, tensor) of every tensor of a checkpoint's shards, as vLLM's loader streams them."""
    from safetensors import safe_open

    for f in sorted(root.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def plugin_model(out: Path, *, tag: str = "", params_dtype=torch.bfloat16):
    """A module tree holding one vLLM MoE layer per MoE layer of the checkpoint at ``model.layers.L.mlp.experts``,
    built with the checkpoint's own quantization config (``tag``: a unique part of the layer names, since vLLM
    refuses a layer name twice). Returns (root, {layer: MoE layer}, the ConvertedCheckpoint)."""
    import json

    from expq.checkpoint import ConvertedCheckpoint

    config = json.loads((out / "config.json").read_text())
    qc = quant_config_of(out)
    ck = ConvertedCheckpoint(out)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    layers = {}
    name = f"{out.parent.name}.{tag}" if tag else out.parent.name
    for L in range(max(ck.moe_layers) + 1):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        if L in ck.moe_layers:
            block.mlp.experts = moe_layer(config, qc, f"{name}.model.layers.{L}.mlp.experts",
                                          params_dtype=params_dtype)
            layers[L] = block.mlp.experts
        root.model.layers.append(block)
    return root, layers, ck

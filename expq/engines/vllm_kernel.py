"""Which kernel runs the routed experts of a layer that expq's vLLM plugin serves: vLLM's or expq's.

``EXPQ_VLLM_KERNEL`` (read by each process that loads the model, when the weights are in place):

* ``vllm`` (the default): vLLM's own int8 W8A16 Triton fused-MoE kernel, exactly what ``--quantization
  experts_int8`` runs (identical log-probabilities to online experts_int8);
* ``expq``: expq's fused-MoE kernel (``expq.kernels``, as ``torch.ops.expq.fused_moe_int8``) on the same int8 codes
  and fp32 scales. Same arithmetic per element (int8 tile converted to the activation dtype, fp32 accumulation,
  per-row scale after the K loop); the top-k sum is fp32 and block sizes differ, so outputs may differ from vLLM's
  kernel in the last bits.

Any other value stops the model load with one line naming the variable and its values.

The seam, the same in vLLM 0.24 to 0.33: vLLM's MoE runner calls the quantization method's ``apply(layer=, x=,
topk_weights=, topk_ids=, shared_experts=, shared_experts_input=)`` inside its opaque ``vllm::moe_forward`` op (so
torch.compile never traces it, and CUDA graphs capture whatever it launches), after the router; ``topk_ids`` are
global expert ids, and ``layer.expert_map`` (global -> local, -1 elsewhere; None without expert parallelism) is what
vLLM's own Triton path applies to them in ``moe_align_block_size``. vLLM's int8 kernel there is a modular kernel
(``FusedMoEKernel``) of ``MoEPrepareAndFinalizeNoDPEPModular`` (the input times the router weight when the router
weight goes on the input, nothing else) and ``TritonExperts`` (GEMM1, activation, GEMM2 with the router weight, top-k
sum). ``ExpqExperts`` replaces exactly that pair, so it serves a layer only where vLLM set up that pair; anything
else (an all-to-all prepare/finalize of data + expert parallelism, shared experts run inside the kernel, an
activation or clamp expq's kernel lacks, weights vLLM re-laid for another backend, LoRA) keeps vLLM's kernel, with
one log line per reason.

At load, each kind of layer expq's kernel serves is warmed up once per process (``ExpqExperts.warm_up``): one
batch of each size that needs its own compiled kernel variant, up to vLLM's ``max_num_batched_tokens``, so that no
step size vLLM's own warm-up skips (those between its largest captured CUDA graph and its largest step) compiles
inside a request.

GPT-OSS's ``swigluoai``: vLLM keeps w13's gate and up rows interleaved (its activation reads even/odd columns);
expq's kernel reads gate rows then up rows, so a layer that expq serves has w13, its scales and its bias re-laid
once at load (a permutation of rows: the codes and scales are unchanged).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import torch

from ..errors import ExpqError, visible
from ..experts import gate_then_up

ENV = "EXPQ_VLLM_KERNEL"
KERNELS = ("expq", "vllm")
DEFAULT = "vllm"
"""The kernel without ``EXPQ_VLLM_KERNEL``. It becomes ``"expq"`` once bench/serve.py measures expq's kernel at least
as fast as vLLM's at every point (docs/benchmarks.md)."""

ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "swigluoai": "swigluoai"}
"""vLLM ``MoEActivation`` value -> expq activation (``expq.kernels.ACTIVATIONS``); other activations keep vLLM's
kernel. ``swigluoai`` has GPT-OSS's alpha 1.702 and clamp 7.0 in both (vLLM's ``swigluoai_and_mul`` defaults)."""

INTERLEAVED = frozenset({"swigluoai"})
"""Activations for which vLLM's layer holds w13's gate and up rows interleaved (``Partition.interleaved``)."""

_PREPARE_FINALIZE = "MoEPrepareAndFinalizeNoDPEPModular"
_CLAMPS = ("gemm1_clamp_limit", "gemm1_alpha", "gemm1_beta")
LOGGER = "vllm.expq"
"""The plugin's logger (the kernel served, its warm-up, fallbacks, version notes): a child of vLLM's ``vllm``
logger, so that its lines reach vLLM's log at vLLM's level whenever vLLM configures logging (its default,
``VLLM_CONFIGURE_LOGGING=1``: a handler on ``vllm``, which does not propagate; a logger outside that tree has no
handler there, and Python drops its lines below WARNING), before or after the plugin loads; where vLLM leaves
logging to the application, the lines propagate to the application's handlers. Its lines go through ``log`` (user
text escaped); expq's kernels log under a child of it (``expq.kernels.tuned.LOGGER``)."""
_LOG = logging.getLogger(LOGGER)
_LOGGED: set[str] = set()


def log(level: int, message: str, *args) -> None:
    """One line of the plugin in vLLM's log: ``message % args`` with its user text (a model path, a layer name, a
    config value) shown as expq prints user text (``errors.visible``, one line: no control character, newline
    included, reaches the log). Logged at the caller's line."""
    _LOG.log(level, visible(message % args if args else message, one_line=True), stacklevel=2)


def kernel_choice(environ: Mapping[str, str] | None = None) -> str:
    """``EXPQ_VLLM_KERNEL`` of ``environ`` (default ``os.environ``), lower-cased: ``"expq"`` or ``"vllm"``;
    ``DEFAULT`` when unset or empty.

    Raises:
        ExpqError: any other value (one line naming the variable, the value and the accepted values).
    """
    raw = (os.environ if environ is None else environ).get(ENV, "")
    value = raw.strip().lower() or DEFAULT
    if value not in KERNELS:
        raise ExpqError(f"{ENV}={raw!r}: expected one of {', '.join(KERNELS)} (default {DEFAULT})",
                        hint=f"unset {ENV} or set it to expq or vllm")
    return value


class ExpqExperts:
    """expq's kernel for one vLLM MoE layer: ``experts(layer, x, topk_weights, topk_ids)`` -> [T, H].

    Reads the layer's ``w13_weight`` int8 [E_local, 2I, H] (gate rows then up rows), ``w2_weight`` int8
    [E_local, H, I], ``w13_scale`` fp32 [E_local, 2I], ``w2_scale`` fp32 [E_local, H], ``expert_map`` and
    ``apply_router_weight_on_input`` at each call; holds the biases in fp32 (converted once) and the activation."""

    def __init__(self, activation: str, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None):
        from ..kernels.custom_op import fused_moe_int8_op  # registers torch.ops.expq.fused_moe_int8

        self.op = fused_moe_int8_op
        self.activation = activation
        self.w13_bias = None if w13_bias is None else w13_bias.detach().float().contiguous()
        self.w2_bias = None if w2_bias is None else w2_bias.detach().float().contiguous()

    def warm_up(self, layer: torch.nn.Module, max_tokens: int) -> list[int]:
        """Compile every kernel variant a step of up to ``max_tokens`` tokens can run on ``layer``
        (``expq.kernels.moe.warm_up``), once per process for each kind of layer (shapes, activation dtype
        ``layer.orig_dtype``, activation, biases, expert map, router weight on the input); the token counts run
        ([] when an earlier layer of the same kind did it). vLLM's own warm-up (profiling at its largest step, CUDA
        graph capture up to its largest captured batch) misses the step sizes in between, which would otherwise
        compile inside a request."""
        from ..kernels.moe import warm_up

        name = getattr(layer, "layer_name", None) or "a MoE layer"
        top_k = _top_k(layer)
        if top_k is None:
            _log_once("no top_k", f"{name}: vLLM's layer says no top_k; expq's kernel compiles each step size the "
                                  "first time it meets it")
            return []
        dtype = getattr(layer, "orig_dtype", torch.bfloat16)
        emap = getattr(layer, "expert_map", None)
        on_input = bool(getattr(layer, "apply_router_weight_on_input", False))
        key = (tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape), str(layer.w13_weight.device), dtype,
               self.activation, self.w13_bias is not None, self.w2_bias is not None,
               None if emap is None else emap.numel(), on_input, top_k, max_tokens)
        if key in _WARMED:
            return []
        _WARMED.add(key)
        counts = warm_up(layer.w13_weight, layer.w2_weight, layer.w13_scale, layer.w2_scale, top_k=top_k,
                         max_tokens=max_tokens, dtype=dtype, activation=self.activation, w13_bias=self.w13_bias,
                         w2_bias=self.w2_bias, apply_router_weight_on_input=on_input, expert_map=emap)
        if layer.w13_weight.is_cuda:
            torch.cuda.empty_cache()  # the warm-up's buffers: not held into vLLM's memory profiling
        log(logging.INFO, "expq's kernel warmed up for steps of 1 to %d tokens (%d step sizes run, one per kernel "
            "variant) on %s and the layers like it", max_tokens, len(counts), name)
        return counts

    def __call__(self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        return self.op(x, layer.w13_weight, layer.w2_weight, layer.w13_scale, layer.w2_scale, topk_weights,
                       topk_ids, self.w13_bias, self.w2_bias, getattr(layer, "expert_map", None), self.activation,
                       bool(getattr(layer, "apply_router_weight_on_input", False)), "triton")


def setup(method, layer: torch.nn.Module, environ: Mapping[str, str] | None = None) -> ExpqExperts | None:
    """After vLLM's kernel is set up for ``layer`` (``method._setup_kernel``): expq's kernel for it when
    ``EXPQ_VLLM_KERNEL`` asks for it and it can serve the layer (``why_not``), else None (vLLM's kernel; one
    warning per reason and process). Re-lays an interleaved w13 (``INTERLEAVED``) to gate-then-up rows in place.

    Raises:
        ExpqError: ``EXPQ_VLLM_KERNEL`` has an unknown value.
    """
    if kernel_choice(environ) != "expq":
        return None
    reason = why_not(method, layer)
    name = getattr(layer, "layer_name", None) or "a MoE layer"
    if reason is not None:
        _log_once(reason, f"expq's kernel cannot serve {name} (nor any layer like it): {reason}; vLLM's int8 "
                          f"kernel runs it")
        return None
    activation = _activation(layer)
    if activation in INTERLEAVED:
        deinterleave_w13(layer)
    _log_once("served", f"{ENV}=expq: the routed experts run expq's fused-MoE kernel ({name} and the others)")
    experts = ExpqExperts(activation, getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None))
    experts.warm_up(layer, max_batched_tokens())
    return experts


DEFAULT_MAX_BATCHED_TOKENS = 8192
"""The step size ``max_batched_tokens`` assumes without a vLLM config in context."""

_WARMED: set = set()


def max_batched_tokens() -> int:
    """The most tokens one vLLM step holds (``scheduler_config.max_num_batched_tokens`` of the vLLM config in
    context), ``DEFAULT_MAX_BATCHED_TOKENS`` without one."""
    try:
        from vllm.config import get_current_vllm_config

        value = getattr(getattr(get_current_vllm_config(), "scheduler_config", None), "max_num_batched_tokens", None)
    except Exception:  # noqa: BLE001 - no vLLM config in context
        value = None
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_MAX_BATCHED_TOKENS


def _top_k(layer: torch.nn.Module) -> int | None:
    """The layer's experts per token (vLLM's FusedMoE ``top_k``, else its ``moe_config.experts_per_token``), or
    None when the layer says neither."""
    for owner, name in ((layer, "top_k"), (getattr(layer, "moe_config", None), "experts_per_token")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def why_not(method, layer: torch.nn.Module) -> str | None:
    """Why expq's kernel cannot take the place of vLLM's for ``layer`` (one phrase), or None when it can."""
    kernel = getattr(method, "moe_kernel", None)
    if kernel is None or getattr(method, "is_monolithic", False):
        return "vLLM set up no modular kernel for it"
    prepare = type(getattr(kernel, "prepare_finalize", None)).__name__
    if prepare != _PREPARE_FINALIZE:
        return f"vLLM moves its tokens with {prepare} (data/expert-parallel all-to-all), not {_PREPARE_FINALIZE}"
    if getattr(kernel, "can_overlap_shared_experts", False):
        return "vLLM runs shared experts inside the MoE kernel"
    if _activation(layer) not in ACTIVATIONS:
        return f"activation {_activation(layer)!r} is not one of expq's ({', '.join(ACTIVATIONS)})"
    quant = getattr(method, "moe_quant_config", None)
    clamps = [k for k in _CLAMPS if getattr(quant, k, None) is not None]
    if clamps:
        return f"vLLM's quant config sets {', '.join(clamps)}"
    if _lora_enabled():
        return "LoRA is enabled (vLLM's MoE LoRA wraps its own kernel)"
    return _layout_problem(layer)


def _layout_problem(layer: torch.nn.Module) -> str | None:
    """Why the layer's tensors are not what expq's kernel reads, or None."""
    try:
        w13, w2, s13, s2 = layer.w13_weight, layer.w2_weight, layer.w13_scale, layer.w2_scale
    except AttributeError as e:
        return f"the layer lacks a tensor ({e})"
    from ..kernels import select_backend

    try:
        select_backend(w13.device, "triton")  # CUDA (or CPU under TRITON_INTERPRET=1: tests)
    except ValueError:
        return f"its weights are on {w13.device.type}, where expq's Triton kernel does not run"
    E, I2, H = w13.shape if w13.dim() == 3 else (0, 0, 0)
    want = {"w13_weight": (w13, torch.int8, (E, I2, H)), "w2_weight": (w2, torch.int8, (E, H, I2 // 2)),
            "w13_scale": (s13, torch.float32, (E, I2)), "w2_scale": (s2, torch.float32, (E, H))}
    for name, (t, dtype, shape) in want.items():
        if w13.dim() != 3 or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            return (f"{name} is {t.dtype} {list(t.shape)}, not the contiguous {dtype} {list(shape)} expq's kernel "
                    f"reads (vLLM re-laid it for another backend?)")
    emap = getattr(layer, "expert_map", None)
    if emap is not None and emap.numel() != getattr(layer, "global_num_experts", emap.numel()):
        return f"its expert map has {emap.numel()} entries for {layer.global_num_experts} experts"
    return None


def _activation(layer: torch.nn.Module) -> str:
    act = getattr(layer, "activation", "silu")
    return str(getattr(act, "value", act))


def _lora_enabled() -> bool:
    try:
        from vllm.config import get_current_vllm_config

        return getattr(get_current_vllm_config(), "lora_config", None) is not None
    except Exception:  # noqa: BLE001 - no vLLM config in context: no LoRA known
        return False


def deinterleave_w13(layer: torch.nn.Module) -> None:
    """w13 (codes, scales, bias) rows from interleaved (gate 0, up 0, gate 1, ...) to gate rows then up rows, in
    place (``experts.gate_then_up``)."""
    with torch.no_grad():
        for name in ("w13_weight", "w13_scale", "w13_bias"):
            t = getattr(layer, name, None)
            if t is not None:
                t.copy_(gate_then_up(t))


def _log_once(key: str, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log(logging.INFO if key == "served" else logging.WARNING, message)

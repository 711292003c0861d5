"""The experts_int8 fused MoE: launch logic for the Triton kernel, and the torch implementations.

Inputs are exactly vLLM's ``experts_int8`` layout (``vllm/model_executor/layers/quantization/experts_int8.py``):

* ``hidden_states`` [T, H], bf16 / fp16 (fp32 also accepted);
* ``w13`` int8 [E, 2I, H]: rows 0..I-1 the gate projection (gate_proj, w1), rows I..2I-1 the up projection
  (up_proj, w3), one output channel per row; ``w2`` int8 [E, H, I] (down_proj);
* ``w13_scale`` fp32 [E, 2I], ``w2_scale`` fp32 [E, H]: one scale per output row, dequantized weight = code * scale;
* ``topk_weights`` [T, top_k] float, ``topk_ids`` [T, top_k] int32 / int64;
* optional biases ``w13_bias`` [E, 2I], ``w2_bias`` [E, H] (GPT-OSS), any float dtype;
* optional ``expert_map`` int [E_global] (expert parallelism, vLLM's ``expert_map``): ``topk_ids`` are then global
  ids, mapped to this rank's local experts [0, E), ``-1`` for an expert another rank holds (its pairs add nothing).

The computation is vLLM's ``fused_experts`` with ``use_int8_w8a16=True`` (``fused_moe.py``): sort the T*top_k
(token, slot) pairs by expert and pad each expert's group to a multiple of BLOCK_SIZE_M (``moe_align_block_size``);
GEMM1 ``[T*top_k, 2I] = x @ (w13 codes).T`` with the int8 tile converted to the activation dtype and fp32 accumulation,
then ``* w13_scale`` and ``+ w13_bias`` in fp32, stored in the activation dtype; the activation-and-mul in fp32 from
that cache, stored in the activation dtype [T*top_k, I]; GEMM2 the same with w2, plus the router weight multiplied in
fp32 before the cast; finally the sum over the top_k slots of each token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
"""Supported activations of the gate/up product, in the order of the kernel's ACTIVATION ids."""

SWIGLUOAI_ALPHA = 1.702
"""GPT-OSS swiglu alpha (GPT-OSS reference ``swiglu``; transformers ``GptOssExperts.alpha``)."""
SWIGLUOAI_LIMIT = 7.0
"""GPT-OSS swiglu clamp limit (GPT-OSS reference ``swiglu_limit``; transformers ``GptOssExperts.limit``)."""

BACKENDS = ("auto", "triton", "torch")

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ID_DTYPES = (torch.int32, torch.int64)

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "LaunchPlan",
    "SPLIT_K_MAX_BYTES",
    "SWIGLUOAI_ALPHA",
    "SWIGLUOAI_LIMIT",
    "UNSORTED_MAX_PAIRS_PER_EXPERT",
    "act_and_mul",
    "fused_moe_int8",
    "fused_moe_torch",
    "fused_moe_triton",
    "gemm2_split_k",
    "get_config",
    "launch_plan",
    "moe_align_block_size",
    "moe_reference",
    "moe_reference_dense",
    "naive_block_assignment",
    "max_padded_length",
    "select_backend",
    "sorts_pairs",
    "warm_up",
    "warm_up_token_counts",
]


# ------------------------------------------------------------------------------------------------------------------
# Backend choice.


def _interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def select_backend(device, backend: str = "auto") -> str:
    """Which implementation ``fused_moe_int8`` runs for tensors on ``device``.

    Args:
        device: a ``torch.device`` or device string (``"cuda"``, ``"cuda:1"``, ``"cpu"``, ...).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``"triton"`` or ``"torch"``. ``"auto"`` gives ``"triton"`` on CUDA (NVIDIA or ROCm) and ``"torch"`` on every
        other device. ``"triton"`` on CPU is allowed only when the environment variable ``TRITON_INTERPRET=1`` is
        set (the kernels then run in Triton's interpreter: slow, for tests only; its bf16 is unreliable).

    Raises:
        ValueError: ``backend`` is not one of ``BACKENDS``; or ``"triton"`` was asked for on a device where it cannot
            run (CPU without ``TRITON_INTERPRET=1``, or a device that is neither CUDA nor CPU).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        return "triton"
    if backend == "auto":
        return "torch"
    if device.type == "cpu" and _interpret_enabled():
        return "triton"
    if device.type == "cpu":
        raise ValueError("backend: 'triton' on CPU needs the environment variable TRITON_INTERPRET=1 "
                         "(Triton's interpreter); use backend='torch' or 'auto' on CPU")
    raise ValueError(f"backend: 'triton' runs on CUDA devices (or CPU with TRITON_INTERPRET=1), not {device.type!r}")


# ------------------------------------------------------------------------------------------------------------------
# Argument checks.


def _check_inputs(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                  apply_router_weight_on_input, dense=False, expert_map=None):
    """Validate the arguments; return (T, H, E, I, top_k). Raises ValueError naming the bad argument.

    ``dense``: w13 / w2 are floating-point weights (``moe_reference_dense``) and there are no scales.
    ``expert_map``: topk_ids are global ids into it (see ``fused_moe_int8``).
    """

    def tensor(name, t):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")

    named = [("hidden_states", hidden_states), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
             ("topk_ids", topk_ids)]
    if not dense:
        named += [("w13_scale", w13_scale), ("w2_scale", w2_scale)]
    for name, t in named:
        tensor(name, t)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states: expected [T, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in _ACT_DTYPES:
        raise ValueError(f"hidden_states: expected dtype bfloat16, float16 or float32, got {hidden_states.dtype}")
    t_dim, h_dim = hidden_states.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if dense and not w.is_floating_point():
            raise ValueError(f"{name}: expected floating-point (dense) weights, got {w.dtype}")
        if not dense and w.dtype != torch.int8:
            raise ValueError(f"{name}: expected dtype int8 (experts_int8 codes), got {w.dtype}")
    if w13.dim() != 3 or w13.shape[1] % 2 != 0 or w13.shape[1] == 0:
        raise ValueError(f"w13: expected [E, 2I, H] with an even, non-zero second dimension, got {tuple(w13.shape)}")
    e_dim, two_i, _ = w13.shape
    i_dim = two_i // 2
    if w13.shape[2] != h_dim:
        raise ValueError(f"w13: expected [E, 2I, H] with H={h_dim} (hidden_states' last dim), got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e_dim, h_dim, i_dim):
        raise ValueError(f"w2: expected [E, H, I] = {(e_dim, h_dim, i_dim)} (from w13 and hidden_states), "
                         f"got {tuple(w2.shape)}")
    for name, s, shape in (("w13_scale", w13_scale, (e_dim, two_i)), ("w2_scale", w2_scale, (e_dim, h_dim))):
        if dense:
            break
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32 (one scale per output row), got {s.dtype}")
        if tuple(s.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(s.shape)}")
    for name, b, shape in (("w13_bias", w13_bias, (e_dim, two_i)), ("w2_bias", w2_bias, (e_dim, h_dim))):
        if b is None:
            continue
        tensor(name, b)
        if not b.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point dtype, got {b.dtype}")
        if tuple(b.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(b.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t_dim or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: expected [T, top_k] with T={t_dim}, top_k >= 1, got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids: expected dtype int32 or int64, got {topk_ids.dtype}")
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (t_dim, top_k):
        raise ValueError(f"topk_weights: expected shape {(t_dim, top_k)} (as topk_ids), "
                         f"got {tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights: expected a floating-point dtype, got {topk_weights.dtype}")
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input: needs top_k == 1 (Llama-4 style), got top_k={top_k}")
    if expert_map is not None:
        tensor("expert_map", expert_map)
        if expert_map.dim() != 1 or expert_map.dtype not in _ID_DTYPES or expert_map.numel() < e_dim:
            raise ValueError(f"expert_map: expected int32 / int64 [E_global] with E_global >= E = {e_dim}, got "
                             f"{expert_map.dtype} {tuple(expert_map.shape)}")
    device = hidden_states.device
    named = [("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale),
             ("topk_weights", topk_weights), ("topk_ids", topk_ids), ("w13_bias", w13_bias), ("w2_bias", w2_bias),
             ("expert_map", expert_map)]
    for name, t in named:
        if t is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, but hidden_states is on {device}")
    # Range of expert ids: checked where it costs no device synchronisation (CPU). On CUDA it is not checked: the
    # Triton sort leaves such a pair out, and the token's output is then undefined (the torch backend raises a
    # device-side index error).
    if device.type == "cpu":
        n_ids = e_dim if expert_map is None else expert_map.numel()
        _check_range("topk_ids", topk_ids, 0, n_ids, "expert ids")
        if expert_map is not None:
            _check_range("expert_map", expert_map, -1, e_dim, "local expert ids (or -1)")
    return t_dim, h_dim, e_dim, i_dim, top_k


def _check_range(name, ids, lo_ok, end, what):
    """ValueError unless every value of the CPU tensor ``ids`` lies in [lo_ok, end)."""
    if ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < lo_ok or hi >= end:
            raise ValueError(f"{name}: {what} must lie in [{lo_ok}, {end}), got range [{lo}, {hi}]")


def _local_ids(topk_ids, expert_map):
    """topk_ids [T, top_k] as this rank's local expert ids: ``expert_map[topk_ids]`` (-1: another rank's expert),
    one gather on the device (no synchronisation); ``topk_ids`` itself without a map."""
    if expert_map is None:
        return topk_ids
    return torch.index_select(expert_map, 0, topk_ids.reshape(-1)).view(topk_ids.shape)


# ------------------------------------------------------------------------------------------------------------------
# The activation, in torch (fp32).


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The gate/up activation in fp32: x [..., 2I] -> [..., I] fp32 (g = x[..., :I], u = x[..., I:]).

    * ``silu``: silu(g) * u (vLLM ``silu_and_mul``);
    * ``gelu``: exact erf gelu(g) * u (vLLM ``gelu_and_mul``);
    * ``gelu_tanh``: tanh-approximate gelu(g) * u (vLLM ``gelu_tanh_and_mul``);
    * ``swigluoai``: GPT-OSS (reference ``swiglu``, transformers ``GptOssExperts``; vLLM ``swigluoai_and_mul``)
      g = min(g, 7), u = clamp(u, -7, 7), (u + 1) * g * sigmoid(1.702 g). The halves are [gate | up] here
      (w13's layout), not the interleaved columns of the GPT-OSS checkpoint.

    Raises:
        ValueError: unknown ``activation`` or an odd last dimension.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dimension [..., 2I], got {tuple(x.shape)}")
    i_dim = x.shape[-1] // 2
    g = x[..., :i_dim].float()
    u = x[..., i_dim:].float()
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(g) * u
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    g = g.clamp(max=SWIGLUOAI_LIMIT)
    u = u.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (u + 1.0) * (g * torch.sigmoid(SWIGLUOAI_ALPHA * g))


# ------------------------------------------------------------------------------------------------------------------
# fp32 reference.


def moe_reference(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, activation="silu",
                  w13_bias=None, w2_bias=None, apply_router_weight_on_input=False, expert_map=None) -> torch.Tensor:
    """The experts_int8 MoE in fp32 from dequantized weights: the yardstick for the other implementations.

    Every step is fp32 with no intermediate rounding: weights ``code.float() * scale[:, None]``, the input
    ``hidden_states.float()``, the biases and router weights in fp32. For each token t and slot k with expert
    e = topk_ids[t, k] and weight r = topk_weights[t, k]:

        h = x_t @ W13_e.T + b13_e                  (x_t multiplied by r first if apply_router_weight_on_input)
        out_t += r * (act(h) @ W2_e.T + b2_e)      (r omitted if apply_router_weight_on_input)

    (with ``expert_map``, e = expert_map[topk_ids[t, k]], and a pair whose e is -1 adds nothing)

    Args / shapes: as ``fused_moe_int8``.

    Returns:
        fp32 [T, H].

    Raises:
        ValueError: as ``fused_moe_int8``.

    Source: vLLM ``fused_experts`` (``fused_moe.py``) with ``use_int8_w8a16``; activations as ``act_and_mul``.
    """
    _, _, _, _, top_k = _check_inputs(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation,
                                      w13_bias, w2_bias, apply_router_weight_on_input, expert_map=expert_map)
    return _reference(hidden_states, lambda e: w13[e].float() * w13_scale[e].float()[:, None],
                      lambda e: w2[e].float() * w2_scale[e].float()[:, None], topk_weights,
                      _local_ids(topk_ids, expert_map), top_k, activation, w13_bias, w2_bias,
                      apply_router_weight_on_input)


def moe_reference_dense(hidden_states, w13, w2, topk_weights, topk_ids, *, activation="silu", w13_bias=None,
                        w2_bias=None, apply_router_weight_on_input=False) -> torch.Tensor:
    """``moe_reference`` for unquantized weights: the source model's experts in fp32.

    Args:
        w13: floating [E, 2I, H] (gate rows then up rows, as ``fused_moe_int8``'s w13), any float dtype;
        w2: floating [E, H, I]; everything else as ``fused_moe_int8``.

    Returns:
        fp32 [T, H], with the formula of ``moe_reference`` and W13_e = w13[e].float(), W2_e = w2[e].float().

    Raises:
        ValueError: wrong shapes or dtypes (naming the argument), unknown activation, on-input with top_k > 1.
    """
    _, _, _, _, top_k = _check_inputs(hidden_states, w13, w2, None, None, topk_weights, topk_ids, activation,
                                      w13_bias, w2_bias, apply_router_weight_on_input, dense=True)
    return _reference(hidden_states, lambda e: w13[e].float(), lambda e: w2[e].float(), topk_weights, topk_ids,
                      top_k, activation, w13_bias, w2_bias, apply_router_weight_on_input)


def _reference(hidden_states, w13_of, w2_of, topk_weights, topk_ids, top_k, activation, w13_bias, w2_bias,
               apply_router_weight_on_input):
    """fp32 MoE with per-expert fp32 weights w13_of(e) [2I, H] and w2_of(e) [H, I]; pairs of expert -1 add nothing."""
    t_dim, h_dim = hidden_states.shape
    out = torch.zeros(t_dim, h_dim, dtype=torch.float32, device=hidden_states.device)
    if t_dim == 0:
        return out
    x_all = hidden_states.float()
    weights = topk_weights.float().reshape(-1)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tok = pairs // top_k
        r = weights[pairs][:, None]
        x = x_all[tok]
        if apply_router_weight_on_input:
            x = x * r
        h = x @ w13_of(e).T
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = act_and_mul(h, activation) @ w2_of(e).T
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * r
        out.index_add_(0, tok, y)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Torch backend.


def fused_moe_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, activation="silu",
                    w13_bias=None, w2_bias=None, apply_router_weight_on_input=False, expert_map=None) -> torch.Tensor:
    """The experts_int8 MoE in plain torch, rounding where the Triton kernels round.

    Per expert that has tokens: gather its (token, slot) pairs; ``x @ codes.T`` with fp32 accumulation (the input in
    the activation dtype is exact in fp32, and so are the int8 codes); ``* scale + bias`` in fp32, rounded to the
    activation dtype (GEMM1's cache); the activation in fp32, rounded; GEMM2 the same way with the router weight
    multiplied in fp32 before the rounding; ``index_add`` into an fp32 [T, H] sum, cast to the activation dtype.

    Args / shapes / returns / raises: as ``fused_moe_int8``.
    """
    t_dim, h_dim, e_dim, i_dim, top_k = _check_inputs(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                                      topk_ids, activation, w13_bias, w2_bias,
                                                      apply_router_weight_on_input, expert_map=expert_map)
    return _fused_moe_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                            _local_ids(topk_ids, expert_map), activation, w13_bias, w2_bias,
                            apply_router_weight_on_input, top_k)


def _fused_moe_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, w13_bias,
                     w2_bias, apply_router_weight_on_input, top_k):
    dtype = hidden_states.dtype
    t_dim, h_dim = hidden_states.shape
    e_dim = w13.shape[0]
    out = torch.zeros(t_dim, h_dim, dtype=torch.float32, device=hidden_states.device)
    if t_dim == 0:
        return out.to(dtype)
    x_all = hidden_states
    if apply_router_weight_on_input:
        # As vLLM's prepare step: the input times the router weight, in the activation dtype (top_k == 1).
        x_all = hidden_states * topk_weights.to(dtype)
    flat_ids = topk_ids.reshape(-1).long()  # local ids; -1: another rank's expert (sorted first, skipped)
    flat_w = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)
    missing, *counts = torch.bincount(flat_ids + 1, minlength=e_dim + 1).tolist()
    start = missing
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tok = pairs // top_k
        x = x_all[tok].float()
        h = x @ w13[e].float().T
        h = h * w13_scale[e]
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        h = h.to(dtype)
        a = act_and_mul(h, activation).to(dtype).float()
        y = a @ w2[e].float().T
        y = y * w2_scale[e]
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not apply_router_weight_on_input:
            y = y * flat_w[pairs][:, None]
        out.index_add_(0, tok, y.to(dtype).float())
    return out.to(dtype)


# ------------------------------------------------------------------------------------------------------------------
# Triton backend: token sort, block sizes, the pipeline.


def _device_guard(device: torch.device):
    """Triton launches on the current CUDA device: switch to ``device`` only when the tensors live on another one."""
    switch = device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device()
    return torch.cuda.device(device) if switch else contextlib.nullcontext()


def max_padded_length(numel: int, block_size: int, num_experts: int) -> int:
    """``moe_align_block_size``'s bound on the padded length of ``numel`` pairs over ``num_experts`` experts in
    blocks of ``block_size`` (the length of its ``sorted_token_ids``; see its docstring for why it holds)."""
    bound = min(numel + num_experts * (block_size - 1), numel * block_size)
    return -(-bound // block_size) * block_size


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int, *, backend: str = "auto"):
    """Sort the T*top_k (token, slot) pairs by expert and pad each expert's group to a multiple of ``block_size``.

    Pair p = t * top_k + k (row-major in ``topk_ids``). The result has the layout of vLLM's ``moe_align_block_size``
    and never synchronises with the device (so the call can be captured in a CUDA graph). ``backend`` as
    ``select_backend``: ``"triton"`` is ``moe_align_kernel``, one launch (after ``moe_align_count_kernel``'s chunk
    histograms when pairs x bins pass ``ALIGN_ONE_PASS_WORK``; what the Triton pipeline runs; on CUDA the
    default), ``"torch"`` about 30 small torch ops; both give the same tensors bit for bit for ids in
    [0, num_experts). An id outside that range: the triton backend leaves its pair out of every group, the torch
    backend raises (CPU) or makes a device-side index error (CUDA).

    Returns:
        sorted_token_ids: int32 [max_padded], the pair ids grouped by expert (ascending expert, and ascending pair id
            within an expert); each group is followed by padding entries equal to T*top_k up to a multiple of
            ``block_size``; unused tail entries are T*top_k as well.
        expert_ids: int32 [max_padded // block_size], the expert of each block; -1 for blocks past the end.
        num_tokens_post_padded: int32 [1], the used length of ``sorted_token_ids`` (sum of the padded group sizes).

    ``max_padded`` = min(T*top_k + E*(block_size-1), T*top_k*block_size) rounded up to a multiple of
    ``block_size``: a bound that holds for any routing (an expert with c >= 1 pairs takes ceil(c / block_size)
    blocks, which is at most c and at most c / block_size + 1).

    Raises:
        ValueError: ``topk_ids`` not integer, ``block_size`` < 1 or ``num_experts`` < 1, or a ``backend`` that
            cannot run here (see ``select_backend``).
    """
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids: expected dtype int32 or int64, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    device = topk_ids.device
    numel = topk_ids.numel()
    max_padded = max_padded_length(numel, block_size, num_experts)
    if select_backend(device, backend) == "triton" and numel > 0:
        from . import fused_moe_triton as fk

        with _device_guard(device):
            return fk.invoke_moe_align(topk_ids, block_size, num_experts, max_padded)
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(numel, device=device) - count_start[sorted_experts]
    pos = padded_start[sorted_experts] + rank
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, pos, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_size, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, torch.full_like(expert_ids, -1)).to(torch.int32)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def naive_block_assignment(topk_ids: torch.Tensor, block_size: int):
    """One block per (token, slot) pair, unsorted: the decode shortcut of vLLM's ``fused_experts_impl`` (used by vLLM
    when T*top_k*4 <= E; expq's pipeline gets the same blocks without building these arrays: its GEMMs read the
    experts from topk_ids directly where ``sorts_pairs`` is false).

    With few pairs and many experts, almost every pair has an expert of its own, so sorting buys nothing and costs
    kernel launches. Same outputs as ``moe_align_block_size`` (same meaning): sorted_token_ids int32
    [T*top_k*block_size] with pair p at p*block_size and padding (T*top_k) elsewhere; expert_ids int32 [T*top_k] =
    topk_ids flattened; num_tokens_post_padded int32 [1] = T*top_k*block_size.

    Raises:
        ValueError: ``topk_ids`` not integer or ``block_size`` < 1.
    """
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids: expected dtype int32 or int64, got {topk_ids.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size: expected >= 1, got {block_size}")
    device = topk_ids.device
    numel = topk_ids.numel()
    sorted_token_ids = torch.full((numel, block_size), numel, dtype=torch.int32, device=device)
    sorted_token_ids[:, 0] = torch.arange(numel, dtype=torch.int32, device=device)
    expert_ids = topk_ids.reshape(-1).to(torch.int32)
    num_tokens_post_padded = torch.full((1,), numel * block_size, dtype=torch.int32, device=device)
    return sorted_token_ids.reshape(-1), expert_ids, num_tokens_post_padded


# Block sizes by average number of (token, slot) pairs per expert. Small groups (decode) are bound by reading the
# weights: BLOCK_SIZE_M 16 wastes little on padding and long K tiles keep loads in flight. From 17 pairs per expert
# on, one 64-row block per expert converts each int8 weight tile to the activation dtype once for all its rows, and
# that conversion, not the bandwidth, is the cost. GROUP_SIZE_M 8 makes consecutive programs walk the M blocks of one
# N tile before the next tile (an expert's blocks reuse its weight tile from L2). Entries: (max pairs per expert,
# config). Measured on one H200 (Triton 3.6, bf16, CUDA-graph replay, bench/bench_kernel.py --sweep over 14 configs,
# Mixtral-8x7B / Qwen3-30B-A3B / DeepSeek-V3 shapes): the first row is within 17% of the best swept config at 0.25,
# 1 and 8 pairs per expert; 64x128x64 was the best at 32 (by 16% to 18% over BLOCK_SIZE_M 32), 64 and 128 pairs per
# expert, and within 5% of the best (128x256x64) at 1024.
_CONFIG_TABLE = (
    (16, dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=4,
              SPLIT_K=1, SWAP_AB=False, FUSE_ACT=False)),
    (math.inf, dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4,
                    SPLIT_K=1, SWAP_AB=False, FUSE_ACT=False)),
)

# Under the interpreter (CPU) the block shape sets the cost of every numpy op: small tiles, and they exercise masks.
_INTERPRETER_CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=4,
                           num_stages=1, SPLIT_K=1, SWAP_AB=False, FUSE_ACT=False)


def get_config(num_tokens: int, num_experts: int, top_k: int, device=None, *, hidden_size: int | None = None,
               intermediate_size: int | None = None, dtype=None, tuned: bool = True) -> dict:
    """Block sizes for ``fused_moe_w8a16_kernel``: BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, SPLIT_K
    (split-K factor of GEMM2, the down projection; 1 = none), SWAP_AB (tiles computed transposed, both GEMMs) and
    FUSE_ACT (GEMM1 computes gate and up tiles of BLOCK_SIZE_N columns each and stores act(gate) * up: no
    activation launch, same bits).

    With ``hidden_size``, ``intermediate_size`` and ``dtype`` given, a CUDA ``device`` and ``tuned``: the entry of
    the GPU's tuned table (``expq.kernels.tuned``: exact (E, H, I, top_k, dtype), nearest token bucket) when there
    is one. Otherwise (no table for this GPU, shape not in it, shape not given) the built-in default: chosen from
    ``_CONFIG_TABLE`` by the average number of (token, slot) pairs per expert, ``num_tokens * top_k /
    num_experts``: BLOCK_SIZE_M 16 for decode-sized groups up to 64 for large prefill groups. CPU (interpreter)
    gets small fixed tiles. Returns a new dict.
    """
    if device is not None and torch.device(device).type == "cpu":
        return dict(_INTERPRETER_CONFIG)
    if tuned and hidden_size is not None and intermediate_size is not None and dtype is not None:
        from . import tuned as _tuned

        cfg = _tuned.lookup(num_tokens, num_experts, hidden_size, intermediate_size, top_k, dtype, device)
        if cfg is not None:
            return cfg
    per_expert = num_tokens * top_k / max(num_experts, 1)
    for limit, config in _CONFIG_TABLE:
        if per_expert <= limit:
            return dict(config)
    raise AssertionError("unreachable")


_ACT_IDS = {name: i for i, name in enumerate(ACTIVATIONS)}

UNSORTED_MAX_PAIRS_PER_EXPERT = 1 / 8
"""With at most this many (token, slot) pairs per expert (T * top_k <= E / 8: decode of a model with many experts,
where pairs rarely share an expert) the pipeline skips the sort: each pair is a block of its own, its expert read
from topk_ids by the GEMMs (vLLM's naive block assignment, used there from T * top_k * 4 <= E; stricter here since
a shared expert is then read once per pair). See ``sorts_pairs``."""


def sorts_pairs(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the Triton pipeline sorts the (token, slot) pairs by expert (``moe_align_block_size``) for this
    batch. It does not for one token (a router's top_k experts are distinct, so the sorted blocks would hold one
    pair each anyway; a token that names an expert twice only loses the sharing of that expert's block) nor when
    T * top_k <= E * ``UNSORTED_MAX_PAIRS_PER_EXPERT``: then each pair is a block of its own and the GEMMs read its
    expert from topk_ids; the output is the same bit for bit."""
    return num_tokens > 1 and num_tokens * top_k > num_experts * UNSORTED_MAX_PAIRS_PER_EXPERT


SPLIT_K_MAX_BYTES = 256 * 2**20
"""Largest fp32 split-K partial buffer (SPLIT_K x T*top_k x H x 4 bytes) the pipeline allocates: a larger SPLIT_K is
halved until it fits (SPLIT_K is for decode-sized batches; a table's nearest bucket may hand it to a big one)."""


def gemm2_split_k(config: dict, intermediate_size: int, num_pairs: int, hidden_size: int) -> int:
    """The split-K factor GEMM2 (K = ``intermediate_size``) runs with for ``config["SPLIT_K"]``: at most one split per
    BLOCK_SIZE_K block of K, and halved while the fp32 partials (splits x ``num_pairs`` x ``hidden_size`` x 4 bytes)
    pass ``SPLIT_K_MAX_BYTES``."""
    split = max(1, min(config["SPLIT_K"], -(-intermediate_size // config["BLOCK_SIZE_K"])))
    while split > 1 and split * num_pairs * hidden_size * 4 > SPLIT_K_MAX_BYTES:  # a decode knob: no huge buffer
        split //= 2
    return split


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the Triton pipeline launches for one batch, as far as it decides which compiled kernel variants run:
    the block config (``get_config``), whether the pairs are sorted (``sorts_pairs``) and in how many passes
    (``align_passes``; 0: no sort), and GEMM2's split-K factor (``gemm2_split_k``). Token counts themselves are not
    specialised on (``fused_moe_triton.TOKEN_COUNT_ARGS``), so two batches of one layer with equal plans run the same
    compiled kernels."""

    config: tuple  # get_config's dict as sorted (key, value) pairs
    sorts: bool
    align_passes: int
    split_k: int

    @property
    def block_config(self) -> dict:
        """The block config as the dict ``get_config`` returned (a new dict)."""
        return dict(self.config)


def launch_plan(num_tokens: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, dtype,
                device, *, config: dict | None = None) -> LaunchPlan:
    """The ``LaunchPlan`` of a batch of ``num_tokens`` tokens (>= 1) for a layer of ``num_experts`` local experts of
    ``hidden_size`` x ``intermediate_size`` with ``top_k`` slots per token, activations in ``dtype`` on ``device``;
    ``config`` overrides ``get_config``: a block config already checked by ``expq.kernels.tuned.check_config``
    (as ``fused_moe_triton`` checks its argument before planning), taken as it is."""
    if config is None:
        config = get_config(num_tokens, num_experts, top_k, device, hidden_size=hidden_size,
                            intermediate_size=intermediate_size, dtype=dtype)
    num_pairs = num_tokens * top_k
    sorts = sorts_pairs(num_tokens, top_k, num_experts)
    passes = 0
    if sorts:
        from .fused_moe_triton import align_passes

        passes = align_passes(num_pairs, num_experts)
    return LaunchPlan(tuple(sorted(config.items())), sorts, passes,
                      gemm2_split_k(config, intermediate_size, num_pairs, hidden_size))


WARM_UP_MAX_TOKENS = 1 << 17
"""The largest batch ``warm_up_token_counts`` looks at (a serving engine's tokens per step rarely pass 2^14)."""


def warm_up_token_counts(max_tokens: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                         dtype, device) -> list[int]:
    """The smallest token count of each distinct ``launch_plan`` among batches of 1 to ``max_tokens`` tokens (at
    most ``WARM_UP_MAX_TOKENS``), ascending: one batch of each size runs every kernel variant any batch up to
    ``max_tokens`` can need."""
    seen: set[LaunchPlan] = set()
    counts = []
    for t in range(1, min(max_tokens, WARM_UP_MAX_TOKENS) + 1):
        plan = launch_plan(t, num_experts, top_k, hidden_size, intermediate_size, dtype, device)
        if plan not in seen:
            seen.add(plan)
            counts.append(t)
    return counts


def warm_up(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, *, top_k: int,
            max_tokens: int, dtype=torch.bfloat16, activation: str = "silu", w13_bias=None, w2_bias=None,
            apply_router_weight_on_input: bool = False, expert_map=None) -> list[int]:
    """Compile now every Triton kernel variant a batch of up to ``max_tokens`` tokens of this layer can need: one
    ``fused_moe_int8`` call (backend ``"triton"``) per ``warm_up_token_counts`` size, on zero activations in
    ``dtype`` routed round-robin over the experts. Weights, biases and ``expert_map`` as ``fused_moe_int8``'s.
    A serving engine calls it at load, so that no batch size its own warm-up (profiling, CUDA graph capture) misses
    compiles inside a request. Returns the token counts run.

    Raises:
        ValueError: as ``fused_moe_int8`` (wrong shapes or dtypes, Triton unable to run on the weights' device).
    """
    device = w13.device
    e_local, two_i, h_dim = w13.shape
    e_global = e_local if expert_map is None else expert_map.numel()
    counts = warm_up_token_counts(max_tokens, e_local, top_k, h_dim, two_i // 2, dtype, device)
    for t in counts:
        x = torch.zeros(t, h_dim, dtype=dtype, device=device)
        ids = (torch.arange(t * top_k, device=device, dtype=torch.int32) % e_global).reshape(t, top_k)
        weights = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
        fused_moe_int8(x, w13, w2, w13_scale, w2_scale, weights, ids, activation=activation, w13_bias=w13_bias,
                       w2_bias=w2_bias, apply_router_weight_on_input=apply_router_weight_on_input, backend="triton",
                       expert_map=expert_map)
    return counts


def fused_moe_triton(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, activation="silu",
                     w13_bias=None, w2_bias=None, apply_router_weight_on_input=False, config=None,
                     expert_map=None) -> torch.Tensor:
    """The experts_int8 MoE through the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Args / shapes / returns / raises: as ``fused_moe_int8``; ``config`` overrides ``get_config``'s block sizes
    (a dict with BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages, and optionally
    SPLIT_K (default 1), SWAP_AB and FUSE_ACT (default False); checked by ``expq.kernels.tuned.check_config``,
    ValueError naming the bad key).

    Launches (no device synchronisation, CUDA-graph capturable): the sort (``moe_align_kernel``, after
    ``moe_align_count_kernel`` for large batches; none where ``sorts_pairs`` says so: one token, or few pairs per
    expert, each pair then a block of its own), GEMM1, the activation
    (fused into GEMM1 with FUSE_ACT), GEMM2 (split over K into fp32 partials when SPLIT_K > 1), and
    ``moe_sum_kernel`` (the top-k sum and the split-K reduction, in a fixed order; skipped when top_k == 1 and
    SPLIT_K == 1). With ``expert_map``: one gather first (global to local ids), and GEMM2's output buffer is
    zero-filled, so that the pairs of other ranks' experts, which no GEMM computes, add 0 to the sum.
    """
    if config is not None:
        from . import tuned as _tuned

        try:
            config = _tuned.check_config(config)
        except ValueError as e:
            raise ValueError(f"config: {e}") from None
    t_dim, h_dim, e_dim, i_dim, top_k = _check_inputs(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                                      topk_ids, activation, w13_bias, w2_bias,
                                                      apply_router_weight_on_input, expert_map=expert_map)
    return _fused_moe_triton(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation,
                             w13_bias, w2_bias, apply_router_weight_on_input, top_k, config, expert_map)


def _fused_moe_triton(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, w13_bias,
                      w2_bias, apply_router_weight_on_input, top_k, config, expert_map=None):
    from . import fused_moe_triton as fk

    dtype = hidden_states.dtype
    device = hidden_states.device
    t_dim, h_dim = hidden_states.shape
    e_dim, two_i, _ = w13.shape
    i_dim = two_i // 2
    if t_dim == 0:
        return hidden_states.new_zeros(0, h_dim)
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError("hidden_states: bfloat16 on CPU runs in Triton's interpreter, whose bfloat16 arithmetic is "
                         "wrong; use float16 / float32 there, or backend='torch'")
    plan = launch_plan(t_dim, e_dim, top_k, h_dim, i_dim, dtype, device, config=config)
    config = plan.block_config
    num_pairs = t_dim * top_k
    topk_ids = _local_ids(topk_ids, expert_map)
    new_out = torch.empty if expert_map is None else torch.zeros  # pairs of other ranks' experts add 0

    x = hidden_states.contiguous()
    if apply_router_weight_on_input:
        # vLLM's prepare step (MoEPrepareAndFinalizeNoEP): a1 * topk_weights in the activation dtype; top_k == 1.
        x = x * topk_weights.to(dtype)
    flat_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    scale13 = w13_scale.contiguous()
    scale2 = w2_scale.contiguous()
    bias13 = None if w13_bias is None else w13_bias.to(torch.float32).contiguous()
    bias2 = None if w2_bias is None else w2_bias.to(torch.float32).contiguous()

    block_m = config["BLOCK_SIZE_M"]
    split = plan.split_k
    fuse = config["FUSE_ACT"]
    cache1 = None if fuse else torch.empty(num_pairs, two_i, dtype=dtype, device=device)
    cache2 = torch.empty(num_pairs, i_dim, dtype=dtype, device=device)
    if split == 1 and top_k == 1:
        out = cache3 = new_out(t_dim, h_dim, dtype=dtype, device=device)  # GEMM2 writes the result itself
    else:
        out = torch.empty(t_dim, h_dim, dtype=dtype, device=device)
        cache3 = (new_out(num_pairs, h_dim, dtype=dtype, device=device) if split == 1 else
                  new_out(split, num_pairs, h_dim, dtype=torch.float32, device=device))

    with _device_guard(device):
        if not plan.sorts:  # decode: no sort, a block per pair
            blocks = dict(sorted_token_ids=None, expert_ids=None, num_tokens_post_padded=None,
                          unsorted_ids=topk_ids.reshape(-1).contiguous())  # the kernel reads ids[p] at ptr + p
        else:
            sorted_ids, expert_ids, num_post = fk.invoke_moe_align(topk_ids, block_m, e_dim,
                                                                   max_padded_length(num_pairs, block_m, e_dim),
                                                                   passes=plan.align_passes)
            blocks = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=num_post)
        if fuse:  # GEMM1 and the activation in one launch
            fk.invoke_fused_moe_w8a16(x, w13, cache2, scale13, bias13, None, **blocks, top_k=top_k,
                                      mul_routed_weight=False, config=config, fuse_act=_ACT_IDS[activation],
                                      alpha=SWIGLUOAI_ALPHA, limit=SWIGLUOAI_LIMIT)
        else:
            fk.invoke_fused_moe_w8a16(x, w13, cache1, scale13, bias13, None, **blocks, top_k=top_k,
                                      mul_routed_weight=False, config=config)
            fk.invoke_act_and_mul(cache1, cache2, _ACT_IDS[activation], alpha=SWIGLUOAI_ALPHA,
                                  limit=SWIGLUOAI_LIMIT)
        fk.invoke_fused_moe_w8a16(cache2, w2, cache3, scale2, bias2, flat_w, **blocks, top_k=1,
                                  mul_routed_weight=not apply_router_weight_on_input, config=config, split_k=split)
        if cache3 is not out:
            fk.invoke_moe_sum(cache3, out, top_k)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Public entry point.


def fused_moe_int8(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, activation="silu",
                   w13_bias=None, w2_bias=None, apply_router_weight_on_input=False, backend="auto",
                   expert_map=None) -> torch.Tensor:
    """Routed experts with experts_int8 weights: out[t] = sum_k r[t,k] * (down(act(gate_up(x_t))) + b2).

    Args:
        hidden_states: [T, H] bfloat16 / float16 (float32 accepted) activations; T may be 0.
        w13: int8 [E, 2I, H] codes; rows 0..I-1 gate_proj (w1), rows I..2I-1 up_proj (w3).
        w2: int8 [E, H, I] codes of down_proj.
        w13_scale: float32 [E, 2I], w2_scale: float32 [E, H]: per-output-row scales (weight = code * scale).
        topk_weights: [T, top_k] router weights (float32 or the activation dtype; used in fp32).
        topk_ids: [T, top_k] int32 / int64 expert ids in [0, E). The same expert twice for a token is computed twice.
            On CUDA the range is not checked (no synchronisation): an id outside it gives an undefined output for
            that token.
        activation: one of ``ACTIVATIONS`` (see ``act_and_mul``), applied to g = first I, u = last I columns of
            GEMM1's output after scale and bias.
        w13_bias: optional [E, 2I], w2_bias: optional [E, H] expert biases (any float dtype; used in fp32).
        apply_router_weight_on_input: Llama-4 style: multiply each token's input by its router weight (in the
            activation dtype, as vLLM) before the experts and not the output; needs top_k == 1.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, resolved by ``select_backend``.
        expert_map: optional int32 / int64 [E_global] (expert parallelism; vLLM's ``expert_map``): ``topk_ids`` are
            then global ids in [0, E_global), expert_map[g] the local expert in [0, E) holding global expert g, or
            -1 when another rank holds it: such a pair adds nothing to its token's output (another rank adds it).

    Returns:
        [T, H] in hidden_states' dtype.

    Raises:
        ValueError: a wrong shape or dtype (the message names the argument), an unknown activation or backend,
            apply_router_weight_on_input with top_k > 1, tensors on different devices, expert ids (or expert_map
            values) out of range (checked on CPU only, where it costs no synchronisation: on CUDA such a token's
            output is undefined),
            backend 'triton' where it cannot run, or bfloat16 through the Triton interpreter (CPU).

    The arithmetic is vLLM's ``fused_experts`` with ``use_int8_w8a16=True`` (``fused_moe.py``, the Triton
    ``fused_moe_kernel`` and its ``invoke_fused_moe_kernel`` pipeline, as used by ``experts_int8``): int8 tiles
    converted to the activation dtype, fp32 accumulation, per-channel scale after the K loop, bias, router weight,
    one cast per GEMM; intermediate caches in the activation dtype; the activation in fp32. GPT-OSS's swiglu follows
    the GPT-OSS reference implementation / transformers ``GptOssExperts``.
    """
    t_dim, h_dim, e_dim, i_dim, top_k = _check_inputs(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                                      topk_ids, activation, w13_bias, w2_bias,
                                                      apply_router_weight_on_input, expert_map=expert_map)
    chosen = select_backend(hidden_states.device, backend)
    if chosen == "triton":
        return _fused_moe_triton(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation,
                                 w13_bias, w2_bias, apply_router_weight_on_input, top_k, None, expert_map)
    return _fused_moe_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                            _local_ids(topk_ids, expert_map), activation, w13_bias, w2_bias,
                            apply_router_weight_on_input, top_k)

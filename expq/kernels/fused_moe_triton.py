"""Triton kernels of the experts_int8 fused MoE: one grouped GEMM over experts (int8 weights, 16-bit activations)
and the gate/up activation.

The GEMM is vLLM's ``fused_moe_kernel`` on its ``use_int8_w8a16`` path
(``vllm/model_executor/layers/fused_moe/fused_moe.py``), reduced to that path: each program computes one
[BLOCK_SIZE_M, BLOCK_SIZE_N] tile of ``C = A[rows] @ dequant(B[expert]).T`` for a block of sorted (token, slot) pairs
that all go to one expert. The int8 tile is converted to the activation dtype, ``tl.dot`` accumulates in fp32 over the
K loop, and after the loop the fp32 accumulator is multiplied by the per-output-channel scale, the bias is added, the
router weight is multiplied in (optional), and the tile is cast to the activation dtype and stored.

Launch logic (sorting tokens by expert, choosing block sizes, the two-GEMM pipeline) lives in ``expq.kernels.moe``;
this module holds the kernels and two thin wrappers that launch them.

CPU tensors run through Triton's interpreter whatever ``TRITON_INTERPRET`` said when this module was imported:
``triton.jit`` decides between compiling and interpreting when the decorator runs (Triton 3.x reads
``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret`` at decoration time), so the wrappers build an
interpreted twin of each kernel for CPU tensors. CUDA tensors always use the decorated kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The kernels call only builtins of triton.language, no @triton.jit helpers (tl.cdiv, tl.sigmoid, tl.zeros, ...):
# those are compiled-mode objects when Triton was imported without TRITON_INTERPRET, and cannot run inside the
# interpreted twin that CPU tensors use (see _kernel_for).

# Activation ids, the ACTIVATION constexpr of moe_act_and_mul_kernel (index in expq.kernels.moe.ACTIVATIONS).
ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_SWIGLUOAI = 0, 1, 2, 3


@triton.jit
def fused_moe_w8a16_kernel(
    # Pointers.
    a_ptr,  # activations, row r of the pair p = sorted_token_ids[i] is A[p // TOP_K]; [rows, K], act dtype
    b_ptr,  # int8 weight codes [E, N, K] (one output channel per row)
    c_ptr,  # output [num_valid_tokens, N], act dtype; row = (token, slot) pair id
    b_scale_ptr,  # fp32 [E, N], one scale per output channel
    b_bias_ptr,  # fp32 [E, N] (read only if HAS_BIAS)
    topk_weights_ptr,  # fp32 [num_valid_tokens] (read only if MUL_ROUTED_WEIGHT)
    sorted_token_ids_ptr,  # int32 [EM]: pair ids sorted by expert, each expert's group padded with num_valid_tokens
    expert_ids_ptr,  # int32 [EM // BLOCK_SIZE_M]: the expert of each block of BLOCK_SIZE_M sorted ids (-1: none)
    num_tokens_post_padded_ptr,  # int32 [1]: number of used entries of sorted_token_ids
    # Sizes. K is a compile-time constant (one value per weight matrix: H for GEMM1, I for GEMM2).
    N,
    K: tl.constexpr,
    EM,
    num_valid_tokens,
    # Strides, in elements.
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_bse,
    stride_bsn,
    stride_bbe,
    stride_bbn,
    # Meta-parameters.
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_SIZE_K == 0: no K masks
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    compute_type: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program id -> (block of sorted pairs, block of output channels), grouped along M for L2 reuse (as vLLM).
    pid = tl.program_id(axis=0)
    num_pid_m = (EM + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M
    num_pid_n = (N + BLOCK_SIZE_N - 1) // BLOCK_SIZE_N
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Blocks past the padded end hold no pairs.
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    off_expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if off_expert < 0:
        return

    # The block's (token, slot) pair ids; padding entries equal num_valid_tokens and are masked out everywhere.
    offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_tokens

    # Output channels; wrapped modulo N so that weight, scale and bias loads stay in bounds (the store is masked).
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + off_expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn

    # K loop: int8 tile -> activation dtype, fp32 accumulation. No scale inside the loop.
    accumulator = tl.full((BLOCK_SIZE_M, BLOCK_SIZE_N), 0.0, dtype=tl.float32)
    for k in range(0, (K + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
        accumulator = tl.dot(a, b.to(compute_type), acc=accumulator, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    # Epilogue in fp32: per-output-channel scale, then bias, then router weight; one cast at the end.
    b_scale = tl.load(b_scale_ptr + off_expert * stride_bse + offs_bn * stride_bsn)
    accumulator = accumulator * b_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(b_bias_ptr + off_expert * stride_bbe + offs_bn * stride_bbn)
        accumulator = accumulator + bias[None, :]
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        accumulator = accumulator * moe_weight[:, None]
    out = accumulator.to(compute_type)

    # Store: only real pairs, only columns < N.
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=token_mask[:, None] & (offs_cn[None, :] < N))


@triton.jit
def moe_act_and_mul_kernel(
    x_ptr,  # [M, 2I] GEMM1 output, act dtype: gate in columns [0, I), up in [I, 2I)
    out_ptr,  # [M, I] act dtype
    I,
    stride_xm,
    stride_om,
    ACTIVATION: tl.constexpr,  # ACT_SILU / ACT_GELU / ACT_GELU_TANH / ACT_SWIGLUOAI
    ALPHA: tl.constexpr,  # swigluoai only
    LIMIT: tl.constexpr,  # swigluoai only
    BLOCK: tl.constexpr,
):
    row = tl.program_id(axis=0).to(tl.int64)
    cols = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_xm + I + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        # SiLU-and-mul: silu(g) * u (vLLM silu_and_mul).
        y = g / (1.0 + tl.exp(-g)) * u
    elif ACTIVATION == 1:
        # Exact (erf) GELU-and-mul (vLLM gelu_and_mul).
        y = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACTIVATION == 2:
        # tanh-approximate GELU-and-mul (vLLM gelu_tanh_and_mul); 0.5 (1 + tanh(z)) = sigmoid(2 z).
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        y = g / (1.0 + tl.exp(-2.0 * z)) * u
    else:
        # GPT-OSS swiglu (vLLM swigluoai_and_mul): g clamped above, u clamped both sides, (u + 1) * g * sigmoid(a g).
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        y = (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
    tl.store(out_ptr + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------------------------
# Thin wrappers.

_INTERPRETED: dict = {}


def _kernel_for(kernel, device: torch.device):
    """The decorated kernel for GPU tensors; an interpreted twin of it for CPU tensors."""
    if device.type != "cpu":
        return kernel
    twin = _INTERPRETED.get(kernel)
    if twin is None:
        from triton.runtime.interpreter import InterpretedFunction

        twin = kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)
        _INTERPRETED[kernel] = twin
    return twin


_COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def invoke_fused_moe_w8a16(a, b, c, b_scale, b_bias, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, *, top_k, mul_routed_weight, config):
    """Launch ``fused_moe_w8a16_kernel`` over every block of ``sorted_token_ids``.

    a [rows, K] act dtype; b int8 [E, N, K]; c [num_pairs, N] act dtype (written only at real pairs);
    b_scale fp32 [E, N]; b_bias fp32 [E, N] or None; topk_weights fp32 [num_pairs] (or None when not multiplied);
    sorted_token_ids / expert_ids / num_tokens_post_padded int32 from ``moe_align_block_size`` with
    ``config["BLOCK_SIZE_M"]``; ``top_k``: pairs per row of ``a`` (the router's top_k for GEMM1, 1 for GEMM2).
    """
    num_pairs, n = c.shape
    k_dim = a.shape[1]
    em = sorted_token_ids.shape[0]
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    kernel = _kernel_for(fused_moe_w8a16_kernel, a.device)
    has_bias = b_bias is not None
    bias = b_bias if has_bias else b_scale  # a valid dummy pointer; never read
    weights = topk_weights if mul_routed_weight else b_scale
    kernel[grid](
        a, b, c, b_scale, bias, weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k_dim, em, num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        b_scale.stride(0), b_scale.stride(1), bias.stride(0), bias.stride(1),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"], EVEN_K=k_dim % bk == 0,
        TOP_K=top_k, MUL_ROUTED_WEIGHT=bool(mul_routed_weight), HAS_BIAS=has_bias,
        compute_type=_COMPUTE_TYPES[a.dtype], DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def invoke_act_and_mul(x, out, activation_id, *, alpha=1.702, limit=7.0, block=None):
    """Launch ``moe_act_and_mul_kernel``: x [M, 2I] -> out [M, I], both in the activation dtype, computed in fp32."""
    m, i_dim = out.shape
    if block is None:
        block = min(1024, triton.next_power_of_2(max(i_dim, 16)))
    grid = (m, triton.cdiv(i_dim, block))
    kernel = _kernel_for(moe_act_and_mul_kernel, x.device)
    kernel[grid](x, out, i_dim, x.stride(0), out.stride(0), ACTIVATION=activation_id, ALPHA=float(alpha),
                 LIMIT=float(limit), BLOCK=block, num_warps=4 if block >= 512 else 2)

"""Triton kernels of the experts_int8 fused MoE: the token sort, one grouped GEMM over experts (int8 weights, 16-bit
activations), the gate/up activation, and the top-k sum.

The GEMM is vLLM's ``fused_moe_kernel`` on its ``use_int8_w8a16`` path
(``vllm/model_executor/layers/fused_moe/fused_moe.py``), reduced to that path: each program computes one
[BLOCK_SIZE_M, BLOCK_SIZE_N] tile of ``C = A[rows] @ dequant(B[expert]).T`` for a block of sorted (token, slot) pairs
that all go to one expert. The int8 tile is converted to the activation dtype, ``tl.dot`` accumulates in fp32 over the
K loop, and after the loop the fp32 accumulator is multiplied by the per-output-channel scale, the bias is added, the
router weight is multiplied in (optional), and the tile is cast to the activation dtype and stored. Two knobs that
vLLM's kernel lacks, neither changing the arithmetic of an output element except the split-K order of the fp32 sum:

* ``SWAP_AB``: the tile is computed transposed, ``C^T = dequant(B) @ A^T``, so the converted weight tile is the
  first MMA operand (Hopper's wgmma reads that one from registers, the second from shared memory) and the tokens are
  the MMA's N dimension, which may be as small as 16 (the M dimension of wgmma is at least 64);
* ``SPLIT_K``: ``program_id(1)`` takes a contiguous share of the K blocks and stores an fp32 partial (scaled,
  router-weighted; the bias in share 0), for GEMMs with few output tiles (decode-sized groups, large K); the partials
  are summed in a fixed order by ``moe_sum_kernel``, so the result is deterministic.

``moe_align_kernel`` is ``moe_align_block_size`` in one launch (vLLM has a CUDA op for it; the torch version is about
30 small kernels), ``moe_sum_kernel`` the sum over the top_k slots (and the split-K partials).

Launch logic (choosing block sizes, the pipeline) lives in ``expq.kernels.moe``; this module holds the kernels and
thin wrappers that launch them.

CPU tensors run through Triton's interpreter whatever ``TRITON_INTERPRET`` said when this module was imported:
``triton.jit`` decides between compiling and interpreting when the decorator runs (Triton 3.x reads
``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret`` at decoration time), so the wrappers build an
interpreted twin of each kernel for CPU tensors. CUDA tensors always use the decorated kernel.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

# The kernels call builtins of triton.language and this module's helpers of _CALLED_HELPERS only, no other
# @triton.jit helpers (tl.cdiv, tl.sigmoid, tl.zeros, tl.sum, ...): those are compiled-mode objects when Triton was
# imported without TRITON_INTERPRET, and cannot run inside the interpreted twin that CPU tensors use (see _twin,
# which gives this module's own helpers interpreted twins as well).


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


# Combine functions of tl.reduce / tl.associative_scan: Triton's own (tl.sum / tl.max / tl.cumsum use them, and the
# interpreter runs them as numpy sums, maxima and cumsums), else equivalent ones of ours (slow in the interpreter).
# tl.sum and friends themselves are @triton.jit helpers, which the interpreted twin cannot call (see above).
_ADD = getattr(tl.standard, "_sum_combine", _add_combine)
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)

# Activation ids, the ACTIVATION constexpr of moe_act_and_mul_kernel (index in expq.kernels.moe.ACTIVATIONS).
ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_SWIGLUOAI = 0, 1, 2, 3


@triton.jit
def _act_and_mul(g, u, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act(g) * u in fp32 (g, u fp32 tiles): the activation of moe_act_and_mul_kernel and of GEMM1's FUSE_ACT."""
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
    return y


@triton.jit
def _expert_bin(ids, offs, numel, num_experts):
    """The histogram bin of each pair's id (int32): the id where the lane is a pair (offs < numel) and the id lies in
    [0, num_experts) (compared in the ids' own dtype, int64 too), else num_experts (the bin of masked lanes and bad
    ids, which no group gets)."""
    return tl.where((offs < numel) & (ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)


_CALLED_HELPERS = ("_act_and_mul", "_expert_bin")
"""The @triton.jit helpers the kernels call (their CPU twins call interpreted twins of them; see ``_twin``)."""


# Token counts are never specialised on (Triton specialises integer arguments on == 1 and divisibility by 16): a
# batch size met for the first time while serving must not compile a new variant (a compile in the middle of a
# serving step; vLLM's jit_monitor warns about those). The sizes left specialised (N, strides) depend on the
# weights only.
TOKEN_COUNT_ARGS = {"fused_moe_w8a16_kernel": ("EM", "num_valid_tokens"),
                    "moe_align_count_kernel": ("numel",),
                    "moe_align_kernel": ("numel", "max_padded")}


@triton.jit(do_not_specialize=TOKEN_COUNT_ARGS["fused_moe_w8a16_kernel"])
def fused_moe_w8a16_kernel(
    # Pointers.
    a_ptr,  # activations, row r of the pair p = sorted_token_ids[i] is A[p // TOP_K]; [rows, K], act dtype
    b_ptr,  # int8 weight codes [E, N, K] (one output channel per row)
    c_ptr,  # output [SPLIT_K, num_valid_tokens, N]: act dtype (SPLIT_K == 1) or fp32 partial sums (SPLIT_K > 1)
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
    stride_cs,
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
    SPLIT_K: tl.constexpr,  # program_id(1) in [0, SPLIT_K) takes K blocks [pid_k * K_ITERS, (pid_k + 1) * K_ITERS)
    SWAP_AB: tl.constexpr,  # accumulate the tile transposed: [BLOCK_SIZE_N, BLOCK_SIZE_M] = dequant(B) @ A^T
    FUSE_ACT: tl.constexpr,  # GEMM1 only: N = I; rows n and I + n of B give gate and up; C = act(gate) * up
    ACTIVATION: tl.constexpr,  # FUSE_ACT: as moe_act_and_mul_kernel
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_SIZE_K == 0: no K masks
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    compute_type: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UNSORTED: tl.constexpr = False,  # one block per pair, no sort: expert_ids_ptr = the flat topk_ids (any int)
    num_experts=0,  # UNSORTED: ids outside [0, num_experts) are skipped
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

    if UNSORTED:
        # Decode with few pairs per expert (vLLM's naive block assignment, without building its arrays): block m
        # is pair m alone, its expert read from topk_ids; the other rows are padding.
        off_expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if (off_expert < 0) | (off_expert >= num_experts):
            return
        offs_token = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_valid_tokens).to(tl.int64)
    else:
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
    a_rows = offs_token // TOP_K

    # Output channels; wrapped modulo N so that weight, scale and bias loads stay in bounds (the store is masked).
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N

    # This program's share of the K loop (all of it without split-K).
    K_BLOCKS: tl.constexpr = (K + BLOCK_SIZE_K - 1) // BLOCK_SIZE_K
    K_ITERS: tl.constexpr = (K_BLOCKS + SPLIT_K - 1) // SPLIT_K
    pid_k = tl.program_id(axis=1)
    if SPLIT_K == 1:
        k_first = 0
        k_last = K_BLOCKS
    else:
        k_first = pid_k * K_ITERS
        k_last = min(k_first + K_ITERS, K_BLOCKS)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_base = a_ptr + k_first * BLOCK_SIZE_K * stride_ak
    b_base = b_ptr + off_expert * stride_be + k_first * BLOCK_SIZE_K * stride_bk
    if SWAP_AB:
        # A^T tile [BLOCK_SIZE_K, BLOCK_SIZE_M], B tile [BLOCK_SIZE_N, BLOCK_SIZE_K] (rows of W, K contiguous).
        a_ptrs = a_base + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak
        b_ptrs = b_base + offs_bn[:, None] * stride_bn + offs_k[None, :] * stride_bk
        accumulator = tl.full((BLOCK_SIZE_N, BLOCK_SIZE_M), 0.0, dtype=tl.float32)
    else:
        # A tile [BLOCK_SIZE_M, BLOCK_SIZE_K], B^T tile [BLOCK_SIZE_K, BLOCK_SIZE_N] (FUSE_ACT: and the up rows').
        a_ptrs = a_base + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_base + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        accumulator = tl.full((BLOCK_SIZE_M, BLOCK_SIZE_N), 0.0, dtype=tl.float32)
        if FUSE_ACT:
            up_ptrs = b_ptrs + N * stride_bn
            up_accumulator = tl.full((BLOCK_SIZE_M, BLOCK_SIZE_N), 0.0, dtype=tl.float32)

    # K loop: int8 tile -> activation dtype, fp32 accumulation. No scale inside the loop.
    for k in range(k_first, k_last):
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=token_mask[None, :], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_SIZE_K
                a = tl.load(a_ptrs, mask=token_mask[None, :] & (offs_k[:, None] < k_left),
                            other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0)
            accumulator = tl.dot(b.to(compute_type), a, acc=accumulator, input_precision=DOT_PRECISION)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_left = K - k * BLOCK_SIZE_K
                a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left),
                            other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)
            accumulator = tl.dot(a, b.to(compute_type), acc=accumulator, input_precision=DOT_PRECISION)
            if FUSE_ACT:
                if EVEN_K:
                    b_up = tl.load(up_ptrs)
                else:
                    b_up = tl.load(up_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0)
                up_accumulator = tl.dot(a, b_up.to(compute_type), acc=up_accumulator, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_SIZE_K * stride_bk
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    # Epilogue in fp32: per-output-channel scale, then bias (once, in split 0), then router weight; one cast at the
    # end (to the activation dtype, or none for an fp32 split-K partial).
    b_scale = tl.load(b_scale_ptr + off_expert * stride_bse + offs_bn * stride_bsn)
    if HAS_BIAS:
        bias = tl.load(b_bias_ptr + off_expert * stride_bbe + offs_bn * stride_bbn)
        bias = tl.where(pid_k == 0, bias, 0.0)
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)
    c_base = c_ptr + pid_k.to(tl.int64) * stride_cs  # int64: split offsets pass 2^31 elements on large problems
    if SWAP_AB:
        accumulator = accumulator * b_scale[:, None]
        if HAS_BIAS:
            accumulator = accumulator + bias[:, None]
        if MUL_ROUTED_WEIGHT:
            accumulator = accumulator * moe_weight[None, :]
        c_ptrs = c_base + offs_token[None, :] * stride_cm + offs_cn[:, None] * stride_cn
        c_mask = token_mask[None, :] & (offs_cn[:, None] < N)
    else:
        accumulator = accumulator * b_scale[None, :]
        if HAS_BIAS:
            accumulator = accumulator + bias[None, :]
        if MUL_ROUTED_WEIGHT:
            accumulator = accumulator * moe_weight[:, None]
        if FUSE_ACT:
            # As the unfused pipeline: gate and up rounded to the activation dtype (its GEMM1 cache), act in fp32.
            up_scale = tl.load(b_scale_ptr + off_expert * stride_bse + (offs_bn + N) * stride_bsn)
            up = up_accumulator * up_scale[None, :]
            if HAS_BIAS:
                up_bias = tl.load(b_bias_ptr + off_expert * stride_bbe + (offs_bn + N) * stride_bbn)
                up = up + up_bias[None, :]
            gate = accumulator.to(compute_type).to(tl.float32)
            up = up.to(compute_type).to(tl.float32)
            accumulator = _act_and_mul(gate, up, ACTIVATION, ALPHA, LIMIT)
        c_ptrs = c_base + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
    # Store: only real pairs, only columns < N.
    tl.store(c_ptrs, accumulator.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def moe_sum_kernel(
    x_ptr,  # [SPLITS, num_pairs, N]: GEMM2 output, act dtype (SPLITS == 1) or fp32 split-K partials
    out_ptr,  # [T, N] act dtype, T = num_pairs // TOP_K
    N,
    stride_xs,
    stride_xm,
    stride_om,
    TOP_K: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out[t] = sum over slots k (in order) of round(sum over splits s (in order) of x[s, t * TOP_K + k]): each pair's
    # value is rounded to the activation dtype once, as the GEMM2 cache of the unsplit pipeline holds it.
    row = tl.program_id(axis=0).to(tl.int64)
    cols = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for k in range(TOP_K):
        pair = x_ptr + (row * TOP_K + k) * stride_xm + cols
        v = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, SPLITS):
            # (row * 0 + s): the split index as int64 (row is), since S * num_pairs * N may pass 2^31
            v += tl.load(pair + (row * 0 + s) * stride_xs, mask=mask, other=0.0)
        if SPLITS > 1:
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += v
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=TOKEN_COUNT_ARGS["moe_align_count_kernel"])
def moe_align_count_kernel(
    topk_ids_ptr,  # [numel] int32 / int64 expert id of each (token, slot) pair
    chunk_counts_ptr,  # out int32 [num_programs, NB]: the histogram of chunk p's ids (bin num_experts: masked / bad)
    numel,
    num_experts,
    NB: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # The first pass of the two-pass sort: program p histograms the ids of pairs [p * CHUNK, (p + 1) * CHUNK).
    pid = tl.program_id(axis=0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=0)
    ids = _expert_bin(ids, offs, numel, num_experts)
    tl.store(chunk_counts_ptr + pid * NB + tl.arange(0, NB), tl.histogram(ids, NB))


@triton.jit(do_not_specialize=TOKEN_COUNT_ARGS["moe_align_kernel"])
def moe_align_kernel(
    topk_ids_ptr,  # [numel] int32 / int64 expert id of each (token, slot) pair
    sorted_token_ids_ptr,  # out int32 [max_padded]
    expert_ids_ptr,  # out int32 [max_padded // BLOCK_M]
    num_tokens_post_padded_ptr,  # out int32 [1]
    scratch_ptr,  # int32 [num_programs, NB]: each program's first free position per expert
    numel,
    num_experts,
    max_padded,
    BLOCK_M: tl.constexpr,
    NB: tl.constexpr,  # a power of two > num_experts: bin num_experts collects masked lanes and bad ids
    CHUNK: tl.constexpr,  # pairs placed per program
    HCHUNK: tl.constexpr,  # pairs per histogram step
    COUNTED: tl.constexpr,  # chunk_counts_ptr holds every chunk's histogram (moe_align_count_kernel ran first)
    chunk_counts_ptr,  # int32 [num_programs, NB] when COUNTED
    QB: tl.constexpr,  # chunk histograms summed per step when COUNTED
):
    # Program p places pairs [p * CHUNK, (p + 1) * CHUNK) at padded_start[e] + (pairs of expert e before it), which
    # is moe_align_block_size's stable order; program 0 also writes the padding, the block experts and the length.
    # No grid-wide synchronisation: every program gets the per-expert counts (all pairs, and the pairs before its
    # chunk) itself, by histogramming all ids (one pass: few chunks) or by summing the chunk histograms of
    # moe_align_count_kernel (COUNTED: many chunks); the positions the programs write are disjoint.
    pid = tl.program_id(axis=0)
    bins = tl.arange(0, NB)
    chunk_start = pid * CHUNK
    counts = tl.full((NB,), 0, tl.int32)
    before = tl.full((NB,), 0, tl.int32)
    if COUNTED:
        num_chunks = tl.num_programs(axis=0)
        for q0 in range(0, num_chunks, QB):
            q = q0 + tl.arange(0, QB)
            h = tl.load(chunk_counts_ptr + q[:, None] * NB + bins[None, :], mask=(q < num_chunks)[:, None], other=0)
            counts += tl.reduce(h, 0, _ADD)
            before += tl.reduce(tl.where((q < pid)[:, None], h, 0), 0, _ADD)
    else:
        for start in range(0, numel, HCHUNK):
            offs = start + tl.arange(0, HCHUNK)
            ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=0)
            ids = _expert_bin(ids, offs, numel, num_experts)
            counts += tl.histogram(ids, NB)
            before += tl.histogram(tl.where(offs < chunk_start, ids, num_experts), NB)
    real = bins < num_experts
    counts = tl.where(real, counts, 0)
    before = tl.where(real, before, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.associative_scan(padded, 0, _ADD)
    starts = ends - padded

    # This program's pairs: position = start of its expert + earlier pairs of that expert (earlier chunks, then
    # earlier lanes of this chunk).
    row = scratch_ptr + pid * NB
    tl.store(row + bins, starts + before)
    tl.debug_barrier()
    lane = tl.arange(0, CHUNK)
    offs = chunk_start + lane
    ids = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=0)
    ids = _expert_bin(ids, offs, numel, num_experts)
    rank = tl.reduce(((ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), 1, _ADD)
    pos = tl.load(row + ids) + rank
    tl.store(sorted_token_ids_ptr + pos, offs.to(tl.int32), mask=ids < num_experts)

    if pid == 0:
        total = tl.reduce(padded, 0, _ADD)
        tl.store(num_tokens_post_padded_ptr, total)
        pad_value = tl.full((NB,), 0, tl.int32) + numel
        # Each expert's blocks, and the padding after its pairs (fewer than BLOCK_M entries).
        blocks = padded // BLOCK_M
        first_block = starts // BLOCK_M
        for j in range(0, tl.reduce(blocks, 0, _MAX)):
            tl.store(expert_ids_ptr + first_block + j, bins, mask=j < blocks)
        for j in range(0, BLOCK_M - 1):
            tl.store(sorted_token_ids_ptr + starts + counts + j, pad_value, mask=j < padded - counts)
        # Past the used length: no expert, padding ids.
        num_blocks = max_padded // BLOCK_M
        for start in range(total // BLOCK_M, num_blocks, HCHUNK):
            b = start + tl.arange(0, HCHUNK)
            tl.store(expert_ids_ptr + b, tl.full((HCHUNK,), -1, tl.int32), mask=b < num_blocks)
        for start in range(total, max_padded, HCHUNK):
            p = start + tl.arange(0, HCHUNK)
            tl.store(sorted_token_ids_ptr + p, tl.full((HCHUNK,), 0, tl.int32) + numel, mask=p < max_padded)


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
    y = _act_and_mul(g, u, ACTIVATION, ALPHA, LIMIT)
    tl.store(out_ptr + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------------------------
# Thin wrappers.

_INTERPRETED: dict = {}


def _kernel_for(kernel, device: torch.device):
    """The decorated kernel for GPU tensors; an interpreted twin of it for CPU tensors."""
    if device.type != "cpu":
        return kernel
    return _twin(kernel)


def _twin(jitted):
    """``jitted`` (a kernel or a @triton.jit helper of this module) as an InterpretedFunction whose own calls to
    this module's helpers go to their interpreted twins too (a compiled-mode helper cannot be called there)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(jitted, InterpretedFunction):
        return jitted
    twin = _INTERPRETED.get(jitted)
    if twin is None:
        fn = jitted.fn
        scope = dict(fn.__globals__)
        for name in fn.__code__.co_names:
            value = scope.get(name)
            if name in _CALLED_HELPERS and isinstance(value, triton.runtime.JITFunction):
                scope[name] = _twin(value)
        twin = InterpretedFunction(types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                                      fn.__closure__))
        _INTERPRETED[jitted] = twin
    return twin


_COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def invoke_fused_moe_w8a16(a, b, c, b_scale, b_bias, topk_weights, sorted_token_ids, expert_ids,
                           num_tokens_post_padded, *, top_k, mul_routed_weight, config, split_k=1, fuse_act=None,
                           alpha=1.702, limit=7.0, unsorted_ids=None):
    """Launch ``fused_moe_w8a16_kernel`` over every block of ``sorted_token_ids``.

    a [rows, K] act dtype; b int8 [E, N, K]; c [num_pairs, N] act dtype when ``split_k`` is 1, else fp32
    [split_k, num_pairs, N] (split s holds the partial sum over its K blocks, scaled and router-weighted, the bias in
    split 0 only); c is written only at real pairs. b_scale fp32 [E, N]; b_bias fp32 [E, N] or None; topk_weights
    fp32 [num_pairs] (or None when not multiplied); sorted_token_ids / expert_ids / num_tokens_post_padded int32 from
    ``moe_align_block_size`` with ``config["BLOCK_SIZE_M"]``; ``top_k``: pairs per row of ``a`` (the router's top_k
    for GEMM1, 1 for GEMM2); ``config["SWAP_AB"]`` (default False) computes each tile transposed.
    ``fuse_act``: an activation id (GEMM1 only, SWAP_AB False, split_k 1): b holds [gate; up] rows [E, 2N, K] and
    c [num_pairs, N] receives act(gate) * up directly (``alpha`` / ``limit``: swigluoai's).
    ``unsorted_ids``: the flat topk_ids [num_pairs] (int32 / int64) instead of the three sorted arrays (pass None
    for them): one block per pair, in pair order; pairs whose id is outside [0, E) are not computed.
    """
    if fuse_act is not None and (split_k != 1 or config.get("SWAP_AB", False) or mul_routed_weight):
        raise ValueError("fuse_act: GEMM1 only (no split-K, no SWAP_AB, no router weight)")
    k_dim = a.shape[1]
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    if c3.shape[0] != split_k:
        raise ValueError(f"c: expected {split_k} split(s) in dim 0, got shape {tuple(c.shape)}")
    _, num_pairs, n = c3.shape
    unsorted = unsorted_ids is not None
    if unsorted:
        sorted_token_ids = expert_ids = num_tokens_post_padded = unsorted_ids  # one pointer; only expert_ids is read
    em = num_pairs * config["BLOCK_SIZE_M"] if unsorted else sorted_token_ids.shape[0]
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn), split_k)
    kernel = _kernel_for(fused_moe_w8a16_kernel, a.device)
    has_bias = b_bias is not None
    bias = b_bias if has_bias else b_scale  # a valid dummy pointer; never read
    weights = topk_weights if mul_routed_weight else b_scale
    kernel[grid](
        a, b, c3, b_scale, bias, weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k_dim, em, num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c3.stride(0), c3.stride(1), c3.stride(2),
        b_scale.stride(0), b_scale.stride(1), bias.stride(0), bias.stride(1),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"], SPLIT_K=split_k,
        SWAP_AB=bool(config.get("SWAP_AB", False)), FUSE_ACT=fuse_act is not None,
        ACTIVATION=0 if fuse_act is None else int(fuse_act), ALPHA=float(alpha), LIMIT=float(limit),
        EVEN_K=k_dim % bk == 0,
        TOP_K=top_k, MUL_ROUTED_WEIGHT=bool(mul_routed_weight), HAS_BIAS=has_bias,
        compute_type=_COMPUTE_TYPES[a.dtype], DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UNSORTED=unsorted, num_experts=b.shape[0],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def invoke_moe_sum(x, out, top_k):
    """Launch ``moe_sum_kernel``: x [num_pairs, N] act dtype or [S, num_pairs, N] fp32 split-K partials ->
    out [num_pairs // top_k, N] act dtype, the sum over each token's top_k slots (in slot order, fp32), each pair
    rounded to the activation dtype first (after summing its S partials in order)."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    splits, _, n = x3.shape
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    grid = (out.shape[0], triton.cdiv(n, block))
    kernel = _kernel_for(moe_sum_kernel, x.device)
    kernel[grid](x3, out, n, x3.stride(0), x3.stride(1), out.stride(0), TOP_K=top_k, SPLITS=splits, BLOCK=block,
                 num_warps=4 if block >= 512 else 2)


ALIGN_CHUNK = 128
"""Pairs placed by one program of ``moe_align_kernel``."""

ALIGN_ONE_PASS_WORK = 2**18
"""Up to this many (pair, bin) lanes (number of pairs x NB, NB = the power of two above the expert count) the sort
is one launch (each program histograms all ids); beyond it, two (``moe_align_count_kernel`` histograms each chunk
once, each placing program sums those). Measured on an H200 (bench/profile_kernel.py, the sort alone, CUDA graph,
2026-12-01): one pass is faster up to 2^18 (Mixtral NB 16 at 2,048 pairs: 14.6 against 19.5 us; Qwen3 NB 256 at
1,024 pairs: 10.0 against 11.2), two passes beyond (DeepSeek-V3 NB 512 at 1,024 pairs: 13.2 against 15.4; Qwen3
at 32,768 pairs: 42.8 against 72.0; DeepSeek-V3 at 32,768: 42.6 against 127.9)."""


def align_passes(numel: int, num_experts: int) -> int:
    """How many passes ``invoke_moe_align`` sorts ``numel`` (token, slot) pairs over ``num_experts`` experts in by
    default: 1 while one program places them all or pairs x bins stay within ``ALIGN_ONE_PASS_WORK``, else 2 (a
    histogram pass first). Each pass count is its own compiled kernel variant."""
    programs = max(1, triton.cdiv(numel, ALIGN_CHUNK))
    return 1 if programs == 1 or numel * triton.next_power_of_2(num_experts + 1) <= ALIGN_ONE_PASS_WORK else 2


def invoke_moe_align(topk_ids, block_size, num_experts, max_padded, *, passes=None):
    """``moe_align_block_size``'s three outputs for ``topk_ids`` (any shape, int32 / int64), computed on the device
    without synchronising (``max_padded`` is the caller's bound): ``moe_align_kernel``, preceded by
    ``moe_align_count_kernel`` when ``passes`` is 2 (None: 1 up to ``ALIGN_ONE_PASS_WORK`` pair x bin lanes,
    else 2). Both ways give the same tensors bit for bit.

    Ids outside [0, num_experts) are left out of every group (their pairs are never computed)."""
    flat = topk_ids.reshape(-1).contiguous()  # reshape may return a strided view (a column slice, an expand)
    numel = flat.numel()
    device = flat.device
    nb = triton.next_power_of_2(num_experts + 1)
    programs = max(1, triton.cdiv(numel, ALIGN_CHUNK))
    if passes is None:
        passes = align_passes(numel, num_experts)
    if passes not in (1, 2):
        raise ValueError(f"passes: expected 1, 2 or None, got {passes!r}")
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_size, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    scratch = torch.empty(passes, programs, nb, dtype=torch.int32, device=device)
    if passes == 2:
        _kernel_for(moe_align_count_kernel, device)[(programs,)](flat, scratch[1], numel, num_experts, NB=nb,
                                                                 CHUNK=ALIGN_CHUNK, num_warps=4)
    kernel = _kernel_for(moe_align_kernel, device)
    kernel[(programs,)](flat, sorted_ids, expert_ids, num_post, scratch[0], numel, num_experts, max_padded,
                        BLOCK_M=block_size, NB=nb, CHUNK=ALIGN_CHUNK, HCHUNK=1024, COUNTED=passes == 2,
                        chunk_counts_ptr=scratch[passes - 1], QB=max(1, min(16, 4096 // nb)), num_warps=4)
    return sorted_ids, expert_ids, num_post


def invoke_act_and_mul(x, out, activation_id, *, alpha=1.702, limit=7.0, block=None):
    """Launch ``moe_act_and_mul_kernel``: x [M, 2I] -> out [M, I], both in the activation dtype, computed in fp32."""
    m, i_dim = out.shape
    if block is None:
        block = min(1024, triton.next_power_of_2(max(i_dim, 16)))
    grid = (m, triton.cdiv(i_dim, block))
    kernel = _kernel_for(moe_act_and_mul_kernel, x.device)
    kernel[grid](x, out, i_dim, x.stride(0), out.stride(0), ACTIVATION=activation_id, ALPHA=float(alpha),
                 LIMIT=float(limit), BLOCK=block, num_warps=4 if block >= 512 else 2)

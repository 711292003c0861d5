"""CPU tests of expq.kernels: the Triton kernels under Triton's interpreter, the torch backend, the fp32 reference.

How the interpreter is reached: ``triton.jit`` decides between compiling and interpreting when the decorator runs,
reading ``TRITON_INTERPRET`` (Triton 3.x: ``triton.knobs.runtime.interpret``) at that moment, i.e. when the kernel
module is imported. Setting the variable at the top of this file would therefore depend on import order, and would
leak into every later test module of the same pytest process (on a GPU machine it would turn the GPU tests' kernels
into interpreted ones). So this module does not set it globally: ``expq.kernels.fused_moe_triton`` runs CPU tensors
through an interpreted twin of each kernel whatever the variable said at import, and the ``interpret`` fixture sets
``TRITON_INTERPRET=1`` only for the duration of a test, for ``select_backend``'s check. One test runs a subprocess
with the variable set before anything is imported, the other way the kernels can be interpreted.

Error measures, against ``moe_reference`` (fp32 from dequantized weights):
    rel   = ||out - ref|| / ||ref||                 (Frobenius, whole [T, H])
    token = max_t ||out_t - ref_t|| / ||ref_t||     (the worst token)

Bounds. The kernel path rounds four times to the activation dtype: GEMM1's cache, the activation's output, GEMM2's
cache, and the top_k sum; everything else is fp32. Each rounding has relative error at most u (fp16: u = 2^-11
~ 4.9e-4; bf16: 2^-8 ~ 3.9e-3) and, being independent across elements, adds about u/sqrt(3) rms; the activation and
GEMM2 do not amplify relative errors by more than ~2 on these well-conditioned random problems. Measured: rel ~ 1.0u,
token ~ 1.6u. Bounds: rel <= 8u and token <= 16u (fp16: 3.9e-3 and 7.8e-3): a factor 8 above what is measured, and
a factor ~50 below the negative control (one expert's scales doubled gives rel ~ 0.2 to 0.4). fp32 activations: the
only error is fp32 accumulation (u = 2^-24 ~ 6e-8, K <= 96 terms, measured rel ~ 3e-7); bound 1e-5 rel, 2e-5 token.

Bit-identity between two runs is asserted only where every output element goes through the same operations in the
same order. Under the interpreter, ``tl.dot`` is ``np.matmul`` on fp32 tiles, i.e. OpenBLAS's sgemm, whose kernel is
picked at run time for the CPU (numpy's wheels are built with DYNAMIC_ARCH): the Haswell kernel (AMD EPYC, any AVX2
CPU) sums an element's K products in an order that depends on the element's place in the tile (rows 6-11 of a
16-row tile in one sequential FMA chain, the other rows otherwise), the SkylakeX kernel (AVX-512 Intel Xeon) in one
sequential FMA chain for every element. So two runs are bit-identical on every CPU only when they make the same
``np.matmul`` calls on operands with each element at the same place (same tile shapes, same row and column in the
tile, same K blocks); elementwise steps (numpy's exp, division, casts; erf through math.erf) give an element the same
bits wherever it sits in its array (checked on numpy's AVX-512, AVX2 and baseline loops). Where the order
differs (SWAP_AB's transposed tiles put a token in a column instead of a row; SPLIT_K sums fp32 partials; FUSE_ACT
with I not a multiple of BLOCK_SIZE_N puts the up columns elsewhere in the tile) the two runs are compared with
ORDER_BOUND, and each with the fp32 reference. ORDER_BOUND: fp32 activations carry the fp32 accumulation error of
each order (measured up to 2.6u32 rel = 1.6e-7 on the Haswell kernel, 1.3u32 on SkylakeX): bound 8 u32 = 4.8e-7;
16-bit activations are rounded at the same four points in both runs, which hides the fp32 difference except for a
rare flipped rounding: bound 2u (measured <= 0.06u). ``make test-cpu-variants`` runs the kernel, scheme and golden
tests under each OpenBLAS kernel and numpy SIMD level this machine can emulate.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from expq.kernels import ACTIVATIONS, fused_moe_int8, moe_reference, select_backend
from expq.kernels import moe as moe_mod

REPO = Path(__file__).resolve().parents[1]

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
REL_BOUND = {torch.float16: 8 * UNIT_ROUNDOFF[torch.float16], torch.bfloat16: 8 * UNIT_ROUNDOFF[torch.bfloat16],
             torch.float32: 1e-5}
TOKEN_BOUND = {dt: 2 * b for dt, b in REL_BOUND.items()}
ORDER_BOUND = {torch.float16: 2 * UNIT_ROUNDOFF[torch.float16], torch.float32: 8 * 2.0**-24}  # two orders of one sum

# Sizes: H and I are not multiples of the interpreter tiles (BLOCK_N = BLOCK_K = 32), nor of 16.
E, H, I = 6, 72, 40


@pytest.fixture
def interpret(monkeypatch):
    """TRITON_INTERPRET=1 for this test only (select_backend allows backend='triton' on CPU then)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_problem(e=E, h=H, i=I, t=33, top_k=2, dtype=torch.float16, *, seed=0, bias=False, routing="random",
                 w13_gain=1.0):
    """A random experts_int8 MoE problem: int8 codes, per-row scales giving unit-variance activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g)
    # code ~ U[-127, 127] has std ~ 73; scale ~ sqrt(3) / (127 sqrt(fan_in)) keeps outputs O(1).
    w13_scale = (torch.rand(e, 2 * i, generator=g) + 0.5) * (w13_gain * math.sqrt(3) / (127 * math.sqrt(h)))
    w2_scale = (torch.rand(e, h, generator=g) + 0.5) * (math.sqrt(3) / (127 * math.sqrt(i)))
    if routing == "random":
        logits = torch.randn(t, e, generator=g)
        topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    elif routing == "all":  # pair p goes to expert p % e: every expert is used once t * top_k >= e
        topk_ids = (torch.arange(t * top_k) % e).reshape(t, top_k)
        topk_weights = torch.rand(t, top_k, generator=g) + 0.1
    else:
        raise ValueError(routing)
    kwargs = {}
    if bias:
        kwargs["w13_bias"] = torch.randn(e, 2 * i, generator=g) * 0.5
        kwargs["w2_bias"] = torch.randn(e, h, generator=g) * 0.5
    args = (x, w13, w2, w13_scale, w2_scale, topk_weights.float(), topk_ids.to(torch.int32))
    return args, kwargs


def errors(out, ref):
    """(rel, worst-token rel); tokens whose reference is exactly 0 (all router weights 0) must be exactly 0."""
    assert out.shape == ref.shape
    diff = out.float() - ref
    rel = (diff.norm() / ref.norm()).item()
    ref_norm = ref.norm(dim=1)
    live = ref_norm > 0
    assert bool((out[~live] == 0).all()), "tokens with zero router weight got a non-zero output"
    token = (diff.norm(dim=1)[live] / ref_norm[live]).max().item()
    return rel, token


def assert_close_to_reference(out, ref, dtype, what=""):
    rel, token = errors(out, ref)
    assert math.isfinite(rel) and rel <= REL_BOUND[dtype], f"{what}: rel {rel:.3e} > {REL_BOUND[dtype]:.3e}"
    assert token <= TOKEN_BOUND[dtype], f"{what}: worst token {token:.3e} > {TOKEN_BOUND[dtype]:.3e}"
    return rel, token


def run(backend, args, kwargs, **extra):
    if backend == "triton":
        return moe_mod.fused_moe_triton(*args, **kwargs, **extra)
    return fused_moe_int8(*args, **kwargs, backend="torch", **extra)


# ------------------------------------------------------------------------------------------------------------------
# Token sort / padding.


def check_alignment(topk_ids, block, num_experts, sorted_ids, expert_ids, num_post):
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    n_post = int(num_post.item())
    assert sorted_ids.dtype == torch.int32 and expert_ids.dtype == torch.int32 and num_post.dtype == torch.int32
    assert sorted_ids.numel() % block == 0 and expert_ids.numel() == sorted_ids.numel() // block
    assert n_post % block == 0 and n_post <= sorted_ids.numel()
    used = sorted_ids[:n_post].long()
    real = used[used < numel]
    # every (token, slot) pair exactly once; everything else is padding (== numel)
    assert sorted(real.tolist()) == list(range(numel))
    assert bool((used[used >= numel] == numel).all())
    assert bool((sorted_ids[n_post:] == numel).all())
    # each block holds pairs of its expert only; blocks past the end are -1
    blocks = used.view(-1, block)
    for b in range(blocks.shape[0]):
        e = int(expert_ids[b])
        members = blocks[b][blocks[b] < numel]
        assert members.numel() > 0, f"block {b} is all padding"
        assert bool((flat[members] == e).all()), f"block {b}: pairs of another expert than {e}"
    assert bool((expert_ids[n_post // block:] == -1).all())
    return blocks


@pytest.mark.parametrize("t,top_k,num_experts,block", [(1, 1, 4, 16), (5, 2, 8, 4), (33, 2, 6, 16), (40, 3, 5, 8),
                                                       (7, 2, 64, 16), (100, 1, 3, 16)])
def test_align_block_size_layout(t, top_k, num_experts, block):
    g = torch.Generator().manual_seed(t * 100 + top_k)
    topk_ids = torch.randint(0, num_experts, (t, top_k), generator=g)
    sorted_ids, expert_ids, num_post = moe_mod.moe_align_block_size(topk_ids, block, num_experts)
    blocks = check_alignment(topk_ids, block, num_experts, sorted_ids, expert_ids, num_post)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
    # groups padded to a multiple of the block: expert e has exactly ceil(count_e / block) blocks, in expert order
    expected = [e for e in range(num_experts) for _ in range(-(-int(counts[e]) // block))]
    assert expert_ids[:blocks.shape[0]].tolist() == expected
    assert int(num_post) == sum(-(-int(c) // block) * block for c in counts)
    # the documented bound, a multiple of the block, covers this routing and is the outputs' length
    bound = moe_mod.max_padded_length(t * top_k, block, num_experts)
    assert bound % block == 0 and int(num_post) <= bound == sorted_ids.numel() == expert_ids.numel() * block
    # within an expert the pairs keep their order (stable sort)
    for e in range(num_experts):
        members = [p for p in sorted_ids[:int(num_post)].tolist() if p < t * top_k and topk_ids.reshape(-1)[p] == e]
        assert members == sorted(members)


def test_align_block_size_empty_experts_and_duplicates():
    # all pairs on expert 2 (others empty), and tokens routed twice to the same expert
    topk_ids = torch.tensor([[2, 2], [2, 2], [2, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, num_post = moe_mod.moe_align_block_size(topk_ids, 4, 5)
    check_alignment(topk_ids, 4, 5, sorted_ids, expert_ids, num_post)
    assert int(num_post) == 8
    assert expert_ids.tolist()[:2] == [2, 2]
    assert sorted_ids[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 6]


def test_naive_block_assignment_layout():
    topk_ids = torch.tensor([[3, 9], [3, 0]])
    sorted_ids, expert_ids, num_post = moe_mod.naive_block_assignment(topk_ids, 16)
    check_alignment(topk_ids, 16, 10, sorted_ids, expert_ids, num_post)
    assert expert_ids.tolist() == [3, 9, 3, 0]
    assert int(num_post) == 64


@pytest.mark.parametrize("t,top_k,num_experts,block,dtype", [
    (1, 1, 4, 16, torch.int64), (5, 2, 8, 4, torch.int32), (33, 2, 6, 16, torch.int64),
    (40, 3, 5, 8, torch.int32), (7, 2, 64, 16, torch.int32), (100, 1, 3, 128, torch.int64),
    # 4 chunks of ALIGN_CHUNK (128) pairs, 400 x 32 lanes: one launch, several placing programs
    (50, 8, 16, 16, torch.int64),
    # more pairs than one histogram step (1024), pairs x bins past ALIGN_ONE_PASS_WORK: the two-pass sort
    (300, 8, 130, 64, torch.int32)])
def test_align_triton_kernel_equals_torch(interpret, t, top_k, num_experts, block, dtype):
    g = torch.Generator().manual_seed(t + num_experts)
    topk_ids = torch.randint(0, num_experts, (t, top_k), generator=g).to(dtype)
    ref = moe_mod.moe_align_block_size(topk_ids, block, num_experts, backend="torch")
    got = moe_mod.moe_align_block_size(topk_ids, block, num_experts, backend="triton")
    for name, r, o in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), ref, got):
        assert o.dtype == torch.int32 and torch.equal(o, r), name
    check_alignment(topk_ids, block, num_experts, *got)


UNSORTED_KNOBS = [dict(), dict(FUSE_ACT=True), dict(SPLIT_K=2), dict(SWAP_AB=True)]


@pytest.mark.parametrize("knobs", UNSORTED_KNOBS, ids=["plain", "fuse", "splitk", "swap"])
@pytest.mark.parametrize("e,t,top_k,bias,ids_dtype", [(64, 1, 4, False, torch.int32), (64, 2, 4, True, torch.int64),
                                                       (8, 1, 2, True, torch.int32)])
def test_decode_without_the_sort_equals_the_sorted_pipeline(interpret, monkeypatch, knobs, e, t, top_k, bias,
                                                            ids_dtype):
    # one token, or T * top_k <= E / 8: each pair is a block of its own, its expert read from topk_ids (no sort
    # launch); the output is the sorted pipeline's (forced by a sorts_pairs that always says yes): bit for bit when
    # every expert has one pair (row 0 of its block in both runs, padding rows around it: the same np.matmul calls);
    # the (64, 2, 4) problem gives expert 31 two pairs, the second in row 1 of the sorted block, where an sgemm
    # kernel may sum in another order (module docstring): ORDER_BOUND there.
    args, kwargs = make_problem(e=e, t=t, top_k=top_k, seed=60 + t, bias=bias)
    args = args[:6] + (args[6].to(ids_dtype),)
    cfg = dict(moe_mod.get_config(t, e, top_k, "cpu"), **knobs)
    assert not moe_mod.sorts_pairs(t, top_k, e) and moe_mod.sorts_pairs(9, top_k, e)
    unsorted = moe_mod.fused_moe_triton(*args, **kwargs, config=cfg)
    monkeypatch.setattr(moe_mod, "sorts_pairs", lambda *a: True)
    sorted_ = moe_mod.fused_moe_triton(*args, **kwargs, config=cfg)
    ids = args[6].reshape(-1).tolist()
    assert (len(set(ids)) < len(ids)) == (t == 2)  # both kinds are exercised
    if len(set(ids)) == len(ids):
        assert torch.equal(unsorted, sorted_)
    else:
        assert errors(unsorted, sorted_.float())[0] <= ORDER_BOUND[torch.float16]
    ref = moe_mod.moe_reference(*args, **kwargs)
    assert (unsorted.float() - ref).abs().max() <= 8 * 2**-11 * ref.abs().max()


@pytest.mark.parametrize("e,t,top_k", [(64, 2, 4), (8, 9, 2)], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("view", ["column-slice", "step-slice", "expand"])
def test_strided_topk_ids_are_read_as_their_values(interpret, e, t, top_k, view):
    # topk_ids whose reshape(-1) is a strided view (not a copy): the sort and the sort-free GEMMs must read the
    # values, not the storage (a [T, k, 2] tensor's [..., 0], every other column, a broadcast row), in both paths
    args, kwargs = make_problem(e=e, t=t, top_k=top_k, seed=80 + t)
    ids = args[6]
    if view == "column-slice":
        strided = torch.stack([ids, (ids + 1) % e], dim=-1)[..., 0]
    elif view == "step-slice":
        strided = torch.stack([ids, (ids + 1) % e], dim=-1).reshape(t, 2 * top_k)[:, ::2]
    else:
        strided = ids[:1, :1].expand(t, top_k)  # one expert for every pair: a stride-0 view
        args = args[:6] + (strided.contiguous(),)
    assert not strided.reshape(-1).is_contiguous() and torch.equal(strided, args[6])
    want = moe_mod.moe_reference(*args, **kwargs)
    got = moe_mod.fused_moe_triton(*args[:6], strided, **kwargs)
    assert torch.equal(got, moe_mod.fused_moe_triton(*args, **kwargs))
    assert (got.float() - want).norm() <= 4 * 2**-11 * want.norm()
    for r, o in zip(moe_mod.moe_align_block_size(args[6], 16, e, backend="torch"),
                    moe_mod.moe_align_block_size(strided, 16, e, backend="triton")):
        assert torch.equal(r, o)


def test_bfloat16_through_the_interpreter_is_refused():
    args, kwargs = make_problem(t=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 on CPU"):
        moe_mod.fused_moe_triton(*args, **kwargs)


def test_split_k_buffer_is_bounded(monkeypatch):
    # a SPLIT_K that a table's nearest bucket hands to a large batch is halved until its fp32 partials fit
    args, kwargs = make_problem(t=21, top_k=2, seed=45)
    cfg = dict(moe_mod.get_config(21, E, 2, "cpu"), SPLIT_K=2)
    want = moe_mod.fused_moe_triton(*args, **kwargs, config=dict(cfg, SPLIT_K=1))
    monkeypatch.setattr(moe_mod, "SPLIT_K_MAX_BYTES", 21 * 2 * H * 4 * 2 - 1)  # one byte short of SPLIT_K 2
    assert torch.equal(moe_mod.fused_moe_triton(*args, **kwargs, config=cfg), want)


def test_align_triton_kernel_skewed_and_bad_ids(interpret):
    # every pair on the last expert (the others empty), duplicates within a token
    topk_ids = torch.full((9, 2), 4, dtype=torch.int32)
    ref = moe_mod.moe_align_block_size(topk_ids, 4, 5, backend="torch")
    for r, o in zip(ref, moe_mod.moe_align_block_size(topk_ids, 4, 5, backend="triton")):
        assert torch.equal(o, r)
    # an id outside [0, E) is left out of every group (the torch backend refuses it on CPU: scatter index error)
    for dt in (torch.int32, torch.int64):
        bad = torch.tensor([[0, 7], [1, -1]], dtype=dt)
        sorted_ids, expert_ids, num_post = moe_mod.moe_align_block_size(bad, 2, 3, backend="triton")
        assert int(num_post) == 4 and sorted_ids[:4].tolist() == [0, 4, 2, 4]
    # int64 ids are range-checked before any narrowing: 2^32 + 1 is not expert 1
    wide = torch.tensor([[0, 2**32 + 1], [1, -(2**32)]], dtype=torch.int64)
    sorted_ids, _, num_post = moe_mod.moe_align_block_size(wide, 2, 3, backend="triton")
    assert int(num_post) == 4 and sorted_ids[:4].tolist() == [0, 4, 2, 4]
    sorted_ids, expert_ids, num_post = moe_mod.moe_align_block_size(bad, 2, 3, backend="triton")
    assert int(num_post) == 4 and expert_ids[:2].tolist() == [0, 1]
    assert sorted_ids[:4].tolist() == [0, 4, 2, 4]
    with pytest.raises(RuntimeError):
        moe_mod.moe_align_block_size(bad, 2, 3, backend="torch")


@pytest.mark.parametrize("numel,num_experts,block", [(2000, 130, 16), (129, 5, 4), (1500, 384, 64)])
def test_align_one_pass_and_two_pass_agree(interpret, numel, num_experts, block):
    # the one-launch sort (every program histograms all ids) and the two-pass sort (chunk histograms first) place
    # every pair alike, bad ids (negative, >= E, past int32) in chunks other than the first included
    from expq.kernels import fused_moe_triton as fk

    g = torch.Generator().manual_seed(numel)
    ids = torch.randint(0, num_experts, (numel,), generator=g)
    ids[[0, numel // 2, numel - 1]] = torch.tensor([-1, num_experts, 2**32 + 1])
    bound = moe_mod.max_padded_length(numel, block, num_experts)
    one = fk.invoke_moe_align(ids, block, num_experts, bound, passes=1)
    two = fk.invoke_moe_align(ids, block, num_experts, bound, passes=2)
    for name, a, b in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), one, two):
        assert torch.equal(a, b), name
    assert int(one[2]) == sum(-(-int((ids == e).sum()) // block) * block for e in range(num_experts))
    with pytest.raises(ValueError, match="passes"):
        fk.invoke_moe_align(ids, block, num_experts, bound, passes=3)


# ------------------------------------------------------------------------------------------------------------------
# Kernel (interpreter) and torch backend against the fp32 reference.


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("t,top_k", [(1, 1), (5, 2), (33, 2)])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_matches_reference(backend, t, top_k, dtype):
    args, kwargs = make_problem(t=t, top_k=top_k, dtype=dtype, seed=t + 7 * top_k)
    out = run(backend, args, kwargs)
    assert out.dtype == dtype and out.shape == (t, H)
    ref = moe_reference(*args, **kwargs)
    assert ref.dtype == torch.float32
    assert ref.norm() > 0.05 * math.sqrt(ref.numel())  # a problem with real signal, not near-zero outputs
    assert_close_to_reference(out, ref, dtype, f"{backend} t={t} top_k={top_k}")


def test_torch_backend_bf16():
    # bf16 is exact on CPU torch (not under the interpreter): the torch backend is checked at bf16's bound.
    args, kwargs = make_problem(t=17, dtype=torch.bfloat16, seed=3, bias=True)
    out = fused_moe_int8(*args, **kwargs, backend="torch")
    assert out.dtype == torch.bfloat16
    rel, _ = assert_close_to_reference(out, moe_reference(*args, **kwargs), torch.bfloat16, "torch bf16")
    assert rel > 1e-4  # rounding to bf16 really happened (the intermediate caches are bf16, not fp32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_activations_and_biases(activation, bias):
    args, kwargs = make_problem(t=9, top_k=2, dtype=torch.float16, seed=11, bias=bias,
                                w13_gain=4.0 if activation == "swigluoai" else 1.0)
    ref = moe_reference(*args, **kwargs, activation=activation)
    out_tri = moe_mod.fused_moe_triton(*args, **kwargs, activation=activation)
    out_torch = fused_moe_int8(*args, **kwargs, activation=activation, backend="torch")
    assert_close_to_reference(out_tri, ref, torch.float16, f"triton {activation}")
    assert_close_to_reference(out_torch, ref, torch.float16, f"torch {activation}")
    # the activation matters: the reference with another activation is far away
    other = "gelu" if activation == "silu" else "silu"
    assert errors(out_tri, moe_reference(*args, **kwargs, activation=other))[0] > 20 * REL_BOUND[torch.float16]
    if bias:  # the biases matter
        assert errors(out_tri, moe_reference(*args, activation=activation))[0] > 20 * REL_BOUND[torch.float16]


def test_swigluoai_clamps_are_exercised():
    # w13_gain 4 makes gate/up values beyond the limit 7 in both directions; check they occur, so that the clamp
    # paths of the kernel are compared to the reference in test_activations_and_biases.
    (x, w13, _, w13_scale, *_), _ = make_problem(t=9, top_k=2, dtype=torch.float16, seed=11, w13_gain=4.0)
    h = torch.einsum("th,eoh->teo", x.float(), w13.float() * w13_scale[:, :, None])
    g, u = h[..., :I], h[..., I:]
    assert bool((g > 7).any()) and bool((u > 7).any()) and bool((u < -7).any())


def reference_activation(h, activation):
    """The activations restated from their sources, in fp64."""
    h = h.double()
    g, u = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
    if activation == "silu":
        return g / (1 + torch.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u
    if activation == "gelu_tanh":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    # GPT-OSS reference swiglu(x, alpha=1.702, limit=7.0), on [gate | up] halves
    x_glu = g.clamp(max=7.0)
    x_linear = u.clamp(min=-7.0, max=7.0)
    return x_glu * torch.sigmoid(1.702 * x_glu) * (x_linear + 1)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(+large) = inf; the result is right
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_activation_kernel(activation, dtype):
    from expq.kernels import fused_moe_triton as fk

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 2 * 50, generator=g) * 5).to(dtype)  # values well past +-7 for the clamps
    want = reference_activation(x, activation)
    torch_out = moe_mod.act_and_mul(x, activation)
    assert torch_out.dtype == torch.float32
    assert torch.allclose(torch_out.double(), want, rtol=1e-5, atol=1e-5)
    out = torch.empty(7, 50, dtype=dtype)
    fk.invoke_act_and_mul(x, out, ACTIVATIONS.index(activation), block=16)  # 16 does not divide 50: masks
    tol = 2 * UNIT_ROUNDOFF.get(dtype, 1e-6)
    assert torch.allclose(out.double(), want, rtol=tol, atol=tol), (out.double() - want).abs().max()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_router_weight_on_input(backend):
    args, kwargs = make_problem(t=13, top_k=1, dtype=torch.float16, seed=21)
    ref = moe_reference(*args, apply_router_weight_on_input=True)
    out = run(backend, args, kwargs, apply_router_weight_on_input=True)
    assert_close_to_reference(out, ref, torch.float16, f"{backend} on-input")
    # the flag matters (silu is not linear): the output-side weighting is far away
    assert errors(out, moe_reference(*args))[0] > 20 * REL_BOUND[torch.float16]
    args2, _ = make_problem(t=13, top_k=2, seed=21)
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        run(backend, args2, {}, apply_router_weight_on_input=True)


@pytest.mark.parametrize("which", ["w13_scale", "w2_scale"])
def test_negative_control_doubled_expert_scales(which):
    """A kernel run with one expert's scales doubled must fail the bound: the comparison can detect a wrong scale."""
    args, kwargs = make_problem(t=33, top_k=2, dtype=torch.float16, seed=4)
    ref = moe_reference(*args, **kwargs)
    bad = list(args)
    idx = 3 if which == "w13_scale" else 4
    expert = int(args[6][0, 0])
    bad[idx] = args[idx].clone()
    bad[idx][expert] *= 2
    rel_good, _ = errors(moe_mod.fused_moe_triton(*args, **kwargs), ref)
    rel_bad, token_bad = errors(moe_mod.fused_moe_triton(*bad, **kwargs), ref)
    assert rel_good <= REL_BOUND[torch.float16]
    assert rel_bad > 20 * REL_BOUND[torch.float16] and token_bad > TOKEN_BOUND[torch.float16]


def test_every_expert_used_and_multi_block_groups():
    # E=4, 72 pairs: every expert gets 18 pairs, i.e. two BLOCK_SIZE_M=16 blocks each (one partial).
    args, kwargs = make_problem(e=4, t=36, top_k=2, dtype=torch.float16, seed=8, routing="all", bias=True)
    assert set(args[6].reshape(-1).tolist()) == {0, 1, 2, 3}
    ref = moe_reference(*args, **kwargs)
    for backend in ("triton", "torch"):
        assert_close_to_reference(run(backend, args, kwargs), ref, torch.float16, backend)
    # each expert's own contribution is right: zero the router weights of all but one expert
    x, w13, w2, s13, s2, tw, ti = args
    for e in range(4):
        tw_e = torch.where(ti == e, tw, torch.zeros_like(tw))
        one = (x, w13, w2, s13, s2, tw_e, ti)
        assert_close_to_reference(moe_mod.fused_moe_triton(*one, **kwargs), moe_reference(*one, **kwargs),
                                  torch.float16, f"expert {e}")


def test_empty_experts_duplicates_and_sparse_path():
    # every token on expert 2 twice (must not happen with real routers, must not crash), other experts empty
    args, kwargs = make_problem(t=5, top_k=2, seed=9)
    x, w13, w2, s13, s2, tw, _ = args
    ti = torch.full((5, 2), 2, dtype=torch.int32)
    dup = (x, w13, w2, s13, s2, tw, ti)
    ref = moe_reference(*dup)
    for backend in ("triton", "torch"):
        assert_close_to_reference(run(backend, dup, {}), ref, torch.float16, f"{backend} duplicates")
    # few pairs, many experts (T*top_k*4 <= E, where vLLM skips the sort): mostly one-pair blocks
    args, kwargs = make_problem(e=16, t=2, top_k=2, seed=10, bias=True)
    assert_close_to_reference(moe_mod.fused_moe_triton(*args, **kwargs), moe_reference(*args, **kwargs),
                              torch.float16, "sparse path")


EP_MAPS = {"linear-rank1": (-1, -1, -1, 0, 1, 2), "round-robin-rank0": (0, -1, 1, -1, 2, -1),
           "permuted": (2, -1, 0, -1, -1, 1)}


def ep_problem(emap, t, top_k, dtype, seed, bias=True, e_global=E):
    """A global problem, this rank's share of it (the local experts of ``emap``), and the reference: the global
    problem with the router weights of other ranks' experts set to 0 (what this rank must add). The rows of skipped
    pairs in GEMM1's cache are never written (as on the GPU): the interpreter's numpy warns about their garbage."""
    args, kwargs = make_problem(e=e_global, t=t, top_k=top_k, dtype=dtype, seed=seed, bias=bias)
    x, w13, w2, s13, s2, tw, ti = args
    order = sorted((loc, g) for g, loc in enumerate(emap) if loc >= 0)
    held = [g for _, g in order]
    local = (x, w13[held], w2[held], s13[held], s2[held], tw, ti)
    local_kw = {k: v[held] for k, v in kwargs.items()}
    mine = torch.isin(ti, torch.tensor(held))
    ref = moe_reference(x, w13, w2, s13, s2, torch.where(mine, tw, torch.zeros_like(tw)), ti, **kwargs)
    return local, local_kw, torch.tensor(emap, dtype=torch.int32), ref, mine


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on unused rows
@pytest.mark.parametrize("name", sorted(EP_MAPS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_expert_map_adds_only_local_experts(name, backend, dtype):
    """Expert parallelism: global topk_ids through vLLM's expert_map; the pairs of other ranks' experts add exactly
    nothing (tokens routed only there get exactly 0), local ones match the global reference."""
    local, kw, emap, ref, mine = ep_problem(EP_MAPS[name], t=17, top_k=2, dtype=dtype, seed=31)
    assert mine.any() and not mine.all() and (~mine).all(dim=1).any()  # some tokens have no local expert at all
    assert torch.equal(moe_reference(*local, **kw, expert_map=emap), ref)
    out = run(backend, local, kw, expert_map=emap)
    assert_close_to_reference(out, ref, dtype, f"{backend} {name}")
    assert bool((out[(~mine).all(dim=1)] == 0).all())
    # negative control: the same local weights read as if the global ids were local ones
    bad = run(backend, (*local[:6], local[6].clamp(max=len(local[1]) - 1)), kw).float()
    assert ((bad - ref).norm() / ref.norm()).item() > 20 * REL_BOUND[dtype]


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on unused rows
@pytest.mark.parametrize("top_k,split_k", [(1, 1), (1, 2), (2, 2)])
def test_expert_map_zero_fills_every_gemm2_buffer(top_k, split_k):
    """Each form of GEMM2's output (the result itself at top_k 1, fp32 split-K partials) starts at zero under a map,
    so that skipped pairs add nothing; the sort-free decode path (many experts, one token) too."""
    local, kw, emap, ref, _ = ep_problem(EP_MAPS["round-robin-rank0"], t=11, top_k=top_k, dtype=torch.float16,
                                         seed=32)
    cfg = dict(moe_mod.get_config(11, 3, top_k, "cpu"), SPLIT_K=split_k)
    out = moe_mod.fused_moe_triton(*local, **kw, expert_map=emap, config=cfg)
    assert_close_to_reference(out, ref, torch.float16, f"top_k {top_k} split {split_k}")
    big = tuple(-1 if g % 2 else g // 2 for g in range(64))  # 32 of 64 experts here: one token is sort-free
    local, kw, emap, ref, _ = ep_problem(big, t=1, top_k=4, dtype=torch.float16, seed=33, e_global=64)
    assert not moe_mod.sorts_pairs(1, 4, 32)
    assert_close_to_reference(moe_mod.fused_moe_triton(*local, **kw, expert_map=emap), ref, torch.float16,
                              "sort-free")


def test_expert_map_argument_errors():
    local, kw, emap, _, _ = ep_problem(EP_MAPS["linear-rank1"], t=4, top_k=2, dtype=torch.float16, seed=34)
    x, w13, w2, s13, s2, tw, ti = local
    cases = [(emap.float(), ti, "expert_map: expected int32"), (emap[:2], ti, "expert_map: expected int32"),
             (torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int32), ti, r"expert_map: local expert ids \(or -1\)"),
             (emap, torch.full_like(ti, len(emap)), r"topk_ids: expert ids must lie in \[0, 6\)")]
    for m, ids, msg in cases:
        for fn in (fused_moe_int8, moe_reference):
            with pytest.raises(ValueError, match=msg):
                fn(x, w13, w2, s13, s2, tw, ids, **kw, expert_map=m)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_tokens(backend):
    args, kwargs = make_problem(t=0, top_k=2)
    out = run(backend, args, kwargs)
    assert out.shape == (0, H) and out.dtype == torch.float16
    assert moe_reference(*args).shape == (0, H)


def test_block_configs():
    cfgs = [moe_mod.get_config(t, 8, 2, "cuda") for t in (1, 8, 32, 128, 1024, 4096)]
    ms = [c["BLOCK_SIZE_M"] for c in cfgs]
    assert ms[0] == 16 and ms[-1] >= 64 and ms == sorted(ms)
    for c in cfgs:
        assert {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"} <= set(c)
    # the same answer with other tiles: BLOCK_N 64 leaves a partial second tile of H=72, BLOCK_K 64 > I=40
    args, kwargs = make_problem(t=21, top_k=2, seed=12, bias=True)
    ref = moe_reference(*args, **kwargs)
    for cfg in (dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
                dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=4, num_warps=4, num_stages=2)):
        assert_close_to_reference(moe_mod.fused_moe_triton(*args, **kwargs, config=cfg), ref, torch.float16,
                                  str(cfg))
    # H=96, I=48 are multiples of BLOCK_K=16: the kernel's unmasked-K (EVEN_K) loop
    args, kwargs = make_problem(h=96, i=48, t=21, top_k=2, seed=15, bias=True)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    assert_close_to_reference(moe_mod.fused_moe_triton(*args, **kwargs, config=cfg), moe_reference(*args, **kwargs),
                              torch.float16, "EVEN_K")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.float32, marks=pytest.mark.slow)],
                         ids=["fp16", "fp32"])
@pytest.mark.parametrize("split_k,swap_ab", [(1, True), (2, False), (4, True), (8, False)])
@pytest.mark.parametrize("top_k,bias,activation", [(2, False, "silu"), (1, True, "swigluoai"), (3, True, "gelu")])
def test_split_k_and_swap_ab(split_k, swap_ab, top_k, bias, activation, dtype):
    # SPLIT_K splits GEMM2's K (= I = 40, two BLOCK_K=32 blocks, the last partial: SPLIT_K 4 and 8 are clamped to 2);
    # SWAP_AB computes both GEMMs' tiles transposed. Same bounds as the unsplit kernel, and within ORDER_BOUND of it:
    # not bit-identical, even at SPLIT_K 1, since a transposed tile puts an output element at another place of the
    # sgemm tile, where OpenBLAS's Haswell kernel (AMD EPYC) sums its products in another order (module docstring).
    args, kwargs = make_problem(t=21, top_k=top_k, dtype=dtype, seed=40 + split_k + top_k, bias=bias)
    kwargs["activation"] = activation
    cfg = dict(moe_mod.get_config(21, E, top_k, "cpu"), SPLIT_K=split_k, SWAP_AB=swap_ab)
    out = moe_mod.fused_moe_triton(*args, **kwargs, config=cfg)
    ref = moe_reference(*args, **kwargs)
    assert out.dtype == dtype and out.shape == (21, H)
    assert_close_to_reference(out, ref, dtype, f"SPLIT_K={split_k} SWAP_AB={swap_ab}")
    plain = moe_mod.fused_moe_triton(*args, **kwargs, config=dict(cfg, SPLIT_K=1, SWAP_AB=False))
    assert errors(out, plain.float())[0] <= ORDER_BOUND[dtype]


# (activation, bias, H, I, dtype). I = 40 is not a multiple of the interpreter's BLOCK_SIZE_N (32): the fused GEMM1's
# up tiles start at column 0 of a tile, the unfused GEMM1's up columns (from column I of [gate | up]) at column 8, so
# the two runs sum an up element at different places of the sgemm tile: ORDER_BOUND. I = 64: every gate and up
# element sits at the same row and column of a same-shaped tile in both runs: bit-identical (fp32 too).
FUSED_CASES = [(a, True, H, I, torch.float16) for a in ACTIVATIONS] + [
    ("silu", False, H, I, torch.float32), ("silu", False, H, 64, torch.float32), ("gelu", True, H, 64, torch.float32),
    ("swigluoai", True, 96, 64, torch.float16)]  # the last: the unmasked K loop


@pytest.mark.parametrize("activation,bias,h,i,dtype", FUSED_CASES,
                         ids=[f"{c[0]}-{'bias' if c[1] else 'nobias'}-H{c[2]}-I{c[3]}-{str(c[4])[6:]}"
                              for c in FUSED_CASES])
def test_fused_activation_equals_the_unfused_pipeline(activation, bias, h, i, dtype):
    # FUSE_ACT: GEMM1 computes the gate and up tiles itself and stores act(gate) * up, rounding gate and up to the
    # activation dtype first as the unfused pipeline's cache does: the same arithmetic, one launch fewer.
    args, kwargs = make_problem(h=h, i=i, t=19, top_k=2, dtype=dtype, seed=50 + i, bias=bias,
                                w13_gain=3.0 if activation == "swigluoai" else 1.0)
    kwargs["activation"] = activation
    cfg = moe_mod.get_config(19, E, 2, "cpu")
    plain = moe_mod.fused_moe_triton(*args, **kwargs, config=dict(cfg, FUSE_ACT=False))
    fused = moe_mod.fused_moe_triton(*args, **kwargs, config=dict(cfg, FUSE_ACT=True))
    if i % cfg["BLOCK_SIZE_N"] == 0:  # the same np.matmul calls element for element (see FUSED_CASES)
        assert torch.equal(fused, plain)
    else:
        assert errors(fused, plain.float())[0] <= ORDER_BOUND[dtype]
    assert_close_to_reference(fused, moe_reference(*args, **kwargs), dtype, f"FUSE_ACT {activation}")
    split = moe_mod.fused_moe_triton(*args, **kwargs, config=dict(cfg, FUSE_ACT=True, SPLIT_K=2))
    assert_close_to_reference(split, moe_reference(*args, **kwargs), dtype, "FUSE_ACT + SPLIT_K")


def test_split_k_even_k_and_on_input():
    # H=96, I=64: K blocks of 32 divide both (the unmasked loop), SPLIT_K 2 gives each split one full block;
    # Llama-4 style router weight on the input (top_k 1: GEMM2's partials still go through the sum kernel)
    args, kwargs = make_problem(h=96, i=64, t=13, top_k=1, seed=44)
    cfg = dict(moe_mod.get_config(13, E, 1, "cpu"), SPLIT_K=2, SWAP_AB=True)
    out = moe_mod.fused_moe_triton(*args, **kwargs, apply_router_weight_on_input=True, config=cfg)
    assert_close_to_reference(out, moe_reference(*args, **kwargs, apply_router_weight_on_input=True),
                              torch.float16, "even K, on input")


@pytest.mark.parametrize("bad,key", [(dict(SPLIT_K=3), "SPLIT_K"), (dict(BLOCK_SIZE_N=48), "BLOCK_SIZE_N"),
                                     (dict(BLOCK_SIZE_M=2**21), "BLOCK_SIZE_M"), (dict(GROUP_SIZE_M=10**12), "GROUP"),
                                     (dict(SWAP_AB="yes"), "SWAP_AB"), (dict(FUSE_ACT=1), "FUSE_ACT"),
                                     (dict(FUSE_ACT=True, SWAP_AB=True), "FUSE_ACT")])
def test_bad_config_is_refused(bad, key):
    args, kwargs = make_problem(t=3)
    with pytest.raises(ValueError, match=f"config: .*{key}"):
        moe_mod.fused_moe_triton(*args, **kwargs, config=dict(moe_mod.get_config(3, E, 2, "cpu"), **bad))


def test_deterministic():
    args, kwargs = make_problem(t=33, top_k=2, seed=13, bias=True)
    a = moe_mod.fused_moe_triton(*args, **kwargs)
    b = moe_mod.fused_moe_triton(*args, **kwargs)
    assert torch.equal(a, b)
    c = fused_moe_int8(*args, **kwargs, backend="torch")
    d = fused_moe_int8(*args, **kwargs, backend="torch")
    assert torch.equal(c, d)
    # both backends round at the same points: on fp16 they agree far below the reference bound
    assert errors(a, c.float())[0] <= UNIT_ROUNDOFF[torch.float16]


# ------------------------------------------------------------------------------------------------------------------
# Backend choice and argument checks.


def test_select_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("cpu") == "torch"
    assert select_backend(torch.device("cpu"), "torch") == "torch"
    assert select_backend("cuda") == "triton"
    assert select_backend("cuda:1", "auto") == "triton"
    assert select_backend("cuda", "torch") == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("cpu", "triton")
    with pytest.raises(ValueError, match="backend"):
        select_backend("cpu", "cutlass")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu", "triton") == "triton"
    assert select_backend("cpu") == "torch"  # auto stays torch on CPU


def test_public_entry_point_dispatch(interpret):
    args, kwargs = make_problem(t=5, top_k=2, seed=14)
    auto = fused_moe_int8(*args, **kwargs)
    assert torch.equal(auto, fused_moe_int8(*args, **kwargs, backend="torch"))
    tri = fused_moe_int8(*args, **kwargs, backend="triton")
    assert torch.equal(tri, moe_mod.fused_moe_triton(*args, **kwargs))


def _bad(index, value):
    args, _ = make_problem(t=3, top_k=2)
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("args,kwargs,name", [
    (_bad(0, torch.randn(3, H + 1).half()), {}, "w13"),
    (_bad(0, torch.randn(3, H).to(torch.float64)), {}, "hidden_states"),
    (_bad(0, torch.randn(3, 2, H).half()), {}, "hidden_states"),
    (_bad(1, torch.zeros(E, 2 * I, H)), {}, "w13"),
    (_bad(1, torch.zeros(E, 2 * I + 1, H, dtype=torch.int8)), {}, "w13"),
    (_bad(2, torch.zeros(E, H, I + 1, dtype=torch.int8)), {}, "w2"),
    (_bad(2, torch.zeros(E, H, I, dtype=torch.float16)), {}, "w2"),
    (_bad(3, torch.ones(E, 2 * I, dtype=torch.float16)), {}, "w13_scale"),
    (_bad(3, torch.ones(E, I)), {}, "w13_scale"),
    (_bad(4, torch.ones(E, H + 1)), {}, "w2_scale"),
    (_bad(5, torch.ones(3, 1)), {}, "topk_weights"),
    (_bad(5, torch.ones(3, 2, dtype=torch.int32)), {}, "topk_weights"),
    (_bad(6, torch.zeros(3, 2)), {}, "topk_ids"),
    (_bad(6, torch.zeros(4, 2, dtype=torch.int32)), {}, "topk_ids"),
    (_bad(6, torch.full((3, 2), E, dtype=torch.int32)), {}, "topk_ids"),
    (_bad(6, torch.full((3, 2), -1, dtype=torch.int32)), {}, "topk_ids"),
    (_bad(0, torch.randn(3, H).half()), {"activation": "relu"}, "activation"),
    (_bad(0, torch.randn(3, H).half()), {"w13_bias": torch.zeros(E, I)}, "w13_bias"),
    (_bad(0, torch.randn(3, H).half()), {"w2_bias": torch.zeros(E, H, dtype=torch.int32)}, "w2_bias"),
    (_bad(0, torch.randn(3, H).half()), {"backend": "nope"}, "backend"),
])
def test_argument_errors(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        fused_moe_int8(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "backend"}
    if "backend" not in name:
        with pytest.raises(ValueError, match=name):
            moe_reference(*args, **kwargs)


@pytest.mark.parametrize("on_input", [False, True])
def test_reference_dense_equals_reference_on_dequantized_weights(on_input):
    args, kwargs = make_problem(t=11, top_k=1 if on_input else 2, seed=16, bias=True)
    x, w13, w2, s13, s2, tw, ti = args
    kw = dict(kwargs, activation="gelu_tanh", apply_router_weight_on_input=on_input)
    dense = moe_mod.moe_reference_dense(x, w13.float() * s13[:, :, None], w2.float() * s2[:, :, None], tw, ti, **kw)
    ref = moe_reference(*args, **kw)
    assert dense.dtype == torch.float32
    assert torch.allclose(dense, ref, rtol=1e-5, atol=1e-6)
    # bf16 source weights are accepted; int8 codes are not dense weights
    moe_mod.moe_reference_dense(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), tw, ti, **kw)
    with pytest.raises(ValueError, match="w13"):
        moe_mod.moe_reference_dense(x, w13, w2.float(), tw, ti, **kw)


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, kwargs = make_problem(t=2, top_k=1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused_moe_int8(*args, **kwargs, backend="triton")


def test_interpreter_set_before_import_subprocess():
    """The other way to interpret: TRITON_INTERPRET=1 before Triton is imported (kernels decorated as interpreted)."""
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_kernels import make_problem, errors
        from expq.kernels import fused_moe_int8, moe_reference
        from expq.kernels import fused_moe_triton as fk
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(fk.fused_moe_w8a16_kernel, InterpretedFunction)
        args, kwargs = make_problem(t=9, top_k=2, seed=2, bias=True)
        out = fused_moe_int8(*args, **kwargs, activation="gelu", backend="triton")
        print(errors(out, moe_reference(*args, **kwargs, activation="gelu"))[0])
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = float(proc.stdout.strip().splitlines()[-1])
    assert rel <= REL_BOUND[torch.float16]


def test_gemm2_split_k_clamps_to_k_blocks_and_the_partial_buffer():
    """GEMM2's split: at most cdiv(I, BLOCK_SIZE_K), halved while splits x pairs x H x 4 bytes pass the limit."""
    cfg = dict(SPLIT_K=8, BLOCK_SIZE_K=128)
    assert moe_mod.gemm2_split_k(cfg, 768, 4, 2048) == 6  # cdiv(768, 128); not a power of two: the kernel's K share
    assert moe_mod.gemm2_split_k(cfg, 300, 4, 2048) == 3  # cdiv(300, 128)
    assert moe_mod.gemm2_split_k(dict(cfg, SPLIT_K=1), 4096, 4, 2048) == 1
    pairs = moe_mod.SPLIT_K_MAX_BYTES // (4 * 2048 * 4)  # exactly 4 splits fit
    assert moe_mod.gemm2_split_k(cfg, 4096, pairs, 2048) == 4
    assert moe_mod.gemm2_split_k(cfg, 4096, pairs + 1, 2048) == 2


def test_token_counts_are_not_specialised_on():
    """Every kernel argument that varies with the number of tokens is compiled unspecialised (a serving step with a
    new batch size must not compile a new variant), and every argument left specialised is not one of them. Read in
    a fresh interpreter without TRITON_INTERPRET (interpreted kernels have no compile-time parameters)."""
    code = """
import json
from expq.kernels import fused_moe_triton as fmt
names = ("fused_moe_w8a16_kernel", "moe_align_count_kernel", "moe_align_kernel", "moe_sum_kernel",
         "moe_act_and_mul_kernel")
print(json.dumps({n: [[p.name, bool(p.do_not_specialize)] for p in getattr(fmt, n).params] for n in names}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    token_dependent = {"EM", "num_valid_tokens", "numel", "max_padded"}
    for name, params in json.loads(out.splitlines()[-1]).items():
        names = {p for p, _ in params}
        assert {p for p, unspecialised in params if unspecialised} == token_dependent & names, name
    assert token_dependent <= set().union(*({p for p, _ in v} for v in json.loads(out.splitlines()[-1]).values()))

"""The kernel check: per MoE layer, expq's fused-MoE kernel on the int8 weights (Triton on CUDA, the torch
implementation elsewhere) with routing forced so every expert gets tokens, against an fp32 reference from the
dequantized weights, and against the source experts when given."""

from __future__ import annotations

import math

import torch

from ..checkpoint import ConvertedCheckpoint, LayerExperts
from .record import KERNEL, SOURCE, Findings, LayerResult
from .thresholds import KERNEL_REL_TOL, KERNEL_TOKEN_TOL, SOURCE_REL_TOL


def forced_routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor,
                                                                                             torch.Tensor, int]:
    """Top-k ids that give every expert tokens (round-robin over a random permutation, distinct within a token) and
    positive weights summing to 1 per token. Returns (ids int32 [T, k], weights fp32 [T, k], T)."""
    T = max(tokens, math.ceil(num_experts / top_k))
    perm = torch.randperm(num_experts, generator=gen)
    slots = torch.arange(T * top_k) % num_experts
    ids = perm[slots].view(T, top_k)
    # make ids distinct within each token where possible (top_k <= E)
    for k in range(1, top_k):
        ids[:, k] = perm[(slots.view(T, top_k)[:, 0] + k) % num_experts]
    w = torch.rand(T, top_k, generator=gen) + 0.1
    return ids.to(torch.int32), (w / w.sum(dim=1, keepdim=True)).float(), T


def layer_kernel(ck: ConvertedCheckpoint, ex: LayerExperts, res: LayerResult, found: Findings, dev: torch.device,
                 act_dtype: torch.dtype, tokens: int, gen: torch.Generator,
                 src_w: dict[tuple[int, str], torch.Tensor] | None) -> None:
    """Run the kernel on layer ``res.layer``'s experts ``ex`` (``tokens`` random activations in ``act_dtype`` on
    ``dev``, drawn from ``gen``) and record under ``KERNEL`` its error against the fp32 reference on the same
    weights, and under ``SOURCE`` (when ``src_w``, the source matrices by (expert, proj), is given) against the
    source experts; the figures go into ``res``."""
    from ..kernels import fused_moe_int8, moe_reference, moe_reference_dense

    E, H = ex.w2.shape[0], ex.w2.shape[1]
    on_input = ck.layout.router_weight_on_input
    top_k = 1 if on_input else max(1, min(ck.top_k or 2, E))
    ids, weights, T = forced_routing(tokens, E, top_k, gen)
    x = (torch.randn(T, H, generator=gen) * 1.0).to(act_dtype)
    kw = dict(activation=ck.layout.activation, w13_bias=ex.w13_bias, w2_bias=ex.w2_bias,
              apply_router_weight_on_input=on_input)
    checks = (KERNEL, SOURCE) if src_w is not None else (KERNEL,)
    if ex.w13.dtype != torch.int8 or ex.w2.dtype != torch.int8:  # never pass without the int8 path
        for k in checks:
            found.add(k, res, f"layer {res.layer}: kernel input is not int8")
        return
    mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
    try:
        out = fused_moe_int8(x.to(dev), ex.w13.to(dev), ex.w2.to(dev), ex.w13_scale.to(dev), ex.w2_scale.to(dev),
                             weights.to(dev), ids.to(dev), **{**kw, "w13_bias": mv(ex.w13_bias),
                                                              "w2_bias": mv(ex.w2_bias)}).float().cpu()
    except Exception as e:  # noqa: BLE001 - a kernel failure is a failed check
        msg = f"layer {res.layer}: kernel failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for k in checks:
            found.add(k, res, msg)
        return
    res.experts_exercised = int(torch.unique(ids).numel())
    if res.experts_exercised != E:
        found.add(KERNEL, res, f"layer {res.layer}: only {res.experts_exercised} of {E} experts got tokens")
    ref = moe_reference(x, ex.w13, ex.w2, ex.w13_scale, ex.w2_scale, weights, ids, **kw)
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    tok = float(((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())
    res.kernel_rel_err, res.kernel_worst_token_err = round(rel, 6), round(tok, 6)
    if not (rel <= KERNEL_REL_TOL[act_dtype] and tok <= KERNEL_TOKEN_TOL[act_dtype]):
        found.add(KERNEL, res, f"layer {res.layer}: kernel output differs from the fp32 reference: {rel:.2e} relative "
                               f"(worst token {tok:.2e}; limits {KERNEL_REL_TOL[act_dtype]:.0e} / "
                               f"{KERNEL_TOKEN_TOL[act_dtype]:.0e})")
    if src_w is not None:
        _against_source(out, x, weights, ids, kw, res, found, src_w, moe_reference_dense)


def _against_source(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kw: dict,
                    res: LayerResult, found: Findings, src_w: dict[tuple[int, str], torch.Tensor],
                    moe_reference_dense) -> None:
    """The kernel's output ``out`` against the fp32 MoE on the source's own matrices (``SOURCE``)."""
    E = res.experts
    if len(src_w) != 3 * E:
        found.add(SOURCE, res, f"layer {res.layer}: not compared, {3 * E - len(src_w)} of its {3 * E} expert "
                               "matrices have no source matrix of the same shape")
        return
    w13 = torch.stack([torch.cat([src_w[(e, "gate")], src_w[(e, "up")]]) for e in range(E)])
    w2 = torch.stack([src_w[(e, "down")] for e in range(E)])
    src_ref = moe_reference_dense(x, w13, w2, weights, ids, **kw)
    srel = float((out - src_ref).norm() / src_ref.norm().clamp_min(1e-30))
    res.source_rel_err = round(srel, 6)
    if srel > SOURCE_REL_TOL:
        found.add(SOURCE, res, f"layer {res.layer}: kernel output differs from the source experts by {srel:.2e} "
                               f"relative (limit {SOURCE_REL_TOL:.0e}; worst tokens go to expert "
                               f"{_worst_expert(out, src_ref, ids)})")


def _worst_expert(out: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> int:
    err = (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    t = int(err.argmax())
    return int(ids[t, 0])

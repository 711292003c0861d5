"""The checks on the routed experts' codes and scales, and the checks against the source: every quantized matrix
bit for bit, each row's dequantization error, every other tensor byte for byte."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import ConvertedCheckpoint, LayerExperts
from ..plan import JobKind, Plan
from .record import BITS, CODES, ROW_ERROR, CheckResult, Findings, LayerResult, result
from .thresholds import row_error_limit


def layer_codes(ck: ConvertedCheckpoint, ex: LayerExperts, res: LayerResult, found: Findings,
                underflow_budget: int) -> int:
    """Layer ``res.layer``'s codes in range, scales finite and positive, each row's largest code 126 or 127 (or a
    zero row, or one of the ``underflow_budget`` rows the manifest lists as underflowed). Records one problem per
    expert matrix under ``CODES``; returns the underflow budget left."""
    L, I = res.layer, ex.w2.shape[2]
    tiny = torch.finfo(ex.scale_dtype).tiny
    for name, codes, scales in (("w13", ex.w13, ex.w13_scale), ("w2", ex.w2, ex.w2_scale)):
        for e in range(codes.shape[0]):
            c, s = codes[e], scales[e]
            msg = None
            if (c == -128).any():
                r = int(torch.nonzero((c == -128).any(dim=1))[0])
                msg = "code -128 outside [-127, 127]"
            elif not torch.isfinite(s).all() or (s < 0).any():
                r = int(torch.nonzero(~torch.isfinite(s) | (s < 0))[0])
                msg = f"scale {s[r].item()} is not finite and positive"
            else:
                cmax = c.abs().amax(dim=1)
                bad_zero = (s == 0) & (cmax != 0)
                weak = (s >= tiny) & (cmax < 126)
                n_bad_zero = int(bad_zero.sum())
                if n_bad_zero and n_bad_zero <= underflow_budget:
                    underflow_budget -= n_bad_zero  # rows the manifest lists as underflowed: scale 0, codes +-127
                    bad_zero = torch.zeros_like(bad_zero)
                if bad_zero.any():
                    r = int(torch.nonzero(bad_zero)[0])
                    msg = "scale 0 but codes are not all 0 (not a zero row)"
                elif weak.any():
                    r = int(torch.nonzero(weak)[0])
                    msg = (f"largest code is {int(cmax[r])} with scale {s[r].item():.3g}: the scheme maps each row's "
                           "absmax to 126/127, so these codes or this scale are wrong")
            if msg:
                p, row = (("gate", r) if r < I else ("up", r - I)) if name == "w13" else ("down", r)
                res.structure_ok = False
                found.add(CODES, res, f"layer {L} expert {e} {p} row {row} ({ck.modules.get((L, e, p), '?')}): {msg}")
    return underflow_budget


def layer_bits(ck: ConvertedCheckpoint, ex: LayerExperts, plan: Plan, jobs: list, res: LayerResult,
               found: Findings) -> dict[tuple[int, str], torch.Tensor]:
    """Re-quantize the source matrices of layer ``res.layer`` (its quantize ``jobs``) and compare with the layer's
    decoded experts ``ex``: codes and scales counted per matrix (``BITS``), each row's dequantization error against
    ``row_error_limit`` (``ROW_ERROR``). Returns (expert, proj) -> source matrix (fp32 [out, in])."""
    from ..scheme import dequantize_rows, quantize_rows

    L = res.layer
    src_w: dict[tuple[int, str], torch.Tensor] = {}
    codes_diff = scales_diff = 0
    worst = 0.0
    for j in jobs:
        w = j.expert.to_rows(plan.source.read_logical(j.tensor).to(plan.compute_dtype)).contiguous()
        ref_codes, ref_scales = quantize_rows(w)
        rows = j.expert.rows_per_matrix
        for i, m in enumerate(j.matrices):
            sl = slice(i * rows, (i + 1) * rows)
            module = ck.modules.get((m.layer, m.expert, m.proj), "?")
            codes, scales = ex.matrix(m.expert, m.proj)
            if codes.shape != ref_codes[sl].shape:
                found.add(BITS, res, f"layer {L} expert {m.expert} {m.proj} ({module}): shape {list(codes.shape)}, "
                                     f"source matrix {list(ref_codes[sl].shape)}")
                continue
            dc = int((codes != ref_codes[sl]).sum())
            ref_s = ref_scales[sl].float()  # fp32 holds every compute-dtype value exactly; NaN equals NaN here
            ds = int(((scales != ref_s) & ~(torch.isnan(scales) & torch.isnan(ref_s))).sum())
            codes_diff += dc
            scales_diff += ds
            if dc or ds:
                found.add(BITS, res, f"layer {L} expert {m.expert} {m.proj} ({module}): {dc} codes and {ds} scales "
                                     f"differ from re-quantizing {j.tensor.name}")
            wm = w[sl].float()
            s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)
            err = ((dequantize_rows(codes, scales) - wm).abs().amax(dim=1) / s)
            live = scales.float() > 0
            if live.any():
                worst = max(worst, float(err[live].max()))
            src_w[(m.expert, m.proj)] = wm
    res.codes_differ, res.scales_differ = codes_diff, scales_diff
    res.max_row_error_steps = round(worst, 4)
    given = sum(len(j.matrices) for j in jobs)
    if given != 3 * res.experts:
        for k in (BITS, ROW_ERROR):
            found.add(k, res, f"layer {L}: the source gives {given} of its {3 * res.experts} expert matrices")
    limit = row_error_limit(plan.compute_dtype)
    if worst > limit:
        found.add(ROW_ERROR, res, f"layer {L}: a row's dequantization error is {worst:.3f} steps (the scheme allows "
                                  f"{limit:.3f})")
    return src_w


def other_tensors_match_source(ck: ConvertedCheckpoint, plan: Plan) -> CheckResult:
    """Every tensor the source keeps is in the output with the same dtype, shape and bytes (a decoded one: the
    bytes of the source decoded again)."""
    bad = []
    n = 0
    for j in plan.jobs:
        if j.kind is JobKind.QUANTIZE:
            continue
        n += 1
        s = j.tensor
        o = ck.tensors.get(s.name)
        if o is None:
            bad.append(f"tensor {s.name}: in the source but not in the output")
            continue
        if (o.dtype, tuple(o.shape)) != (s.dtype, tuple(s.shape)):
            bad.append(f"tensor {s.name}: {o.dtype}{list(o.shape)} in the output, {s.dtype}{list(s.shape)} in the "
                       "source")
            continue
        if s.decoded:
            same = torch.equal(plan.source.read_logical(s).view(-1).view(torch.uint8),
                               ck.read(s.name).view(-1).view(torch.uint8))
        else:
            st = s.stored
            same = _same_bytes(plan.source.root / st.file, st.start, ck.root / o.file, o.start, st.nbytes)
        if not same:
            bad.append(f"tensor {s.name}: bytes differ from the source ({o.file})")
    return result("other tensors byte-identical to the source", bad, f"{n} tensors")


def _same_bytes(a: Path, a0: int, b: Path, b0: int, n: int, chunk: int = 64 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(a0)
        fb.seek(b0)
        while n:
            k = min(chunk, n)
            if fa.read(k) != fb.read(k):
                return False
            n -= k
    return True

"""Where the time of expq's fused-MoE pipeline goes, kernel by kernel (issue 13's "what limits it").

Usage (repo root, CUDA machine):
    PYTHONPATH=. python3 bench/profile_kernel.py --json prof.json --md prof.md
    PYTHONPATH=. EXPQ_KERNEL_CONFIGS=build/tune python3 bench/profile_kernel.py --shapes qwen --tokens 1 8

For each shape and token count of bench/bench_kernel.py (same weights and routing), the pipeline runs ``--iters``
times under ``torch.profiler`` with L2 flushed before each run (a 256 MiB write, as ``triton.testing.do_bench``),
with the config ``get_config`` gives (the GPU's tuned table when there is one). Per launch in pipeline order
(sort, GEMM1, activation, GEMM2, top-k sum) it reports the median GPU time in microseconds; for the GEMMs also the
weight bandwidth (int8 bytes of the experts that have tokens / kernel time) as a fraction of the copy bandwidth
measured in the same run, and the tensor throughput (2 * pairs * N * K / time, in TFLOP/s). "sort alone": the CUDA-graph
time of the sort by itself with one launch and with two (``invoke_moe_align(passes=...)``). "gaps" = the CUDA-graph
time of the whole pipeline (bench_kernel.graph_time) minus the sum of the kernel times: launch gaps and tails
between dependent kernels that a graph does not remove. "GEMM1 int8 / bf16 weights" (T >= ``--convert-from``): GEMM1
alone (unfused, the point's tiles, CUDA graph) on the int8 codes and on the same codes stored as bf16: the same
kernel and the same MMAs without the int8 -> bf16 conversion of each weight tile (and with twice the weight bytes,
which a compute-bound GEMM hides): the conversion's share of a prefill GEMM.

Batch invariance (``--invariance``, per shape): the first token of the largest batch, computed alone (T=1, with
T=1's config) and inside every batch size of ``--tokens`` (each with its own config); reported: the fraction of
its H outputs that differ from the T=1 result and the largest difference relative to the output's norm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernel import (SHAPES, add_point_args, copy_bandwidth, graph_time, make_routing,  # noqa: E402
                          make_weights)

from expq.kernels import moe  # noqa: E402

STEPS = ("sort", "gemm1", "act", "gemm2", "sum")
KERNELS = {"moe_align_kernel": "sort", "moe_align_count_kernel": "sort", "fused_moe_w8a16_kernel": "gemm",
           "moe_act_and_mul_kernel": "act", "moe_sum_kernel": "sum"}


def profile_point(run, iters):
    """{step: [us per iteration]} of one pipeline, from the profiler's CUDA kernel events."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    run()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    times: dict = {s: [] for s in STEPS}
    gemms = 0
    for e in events:
        kind = next((v for k, v in KERNELS.items() if k in e.name), None)
        if kind is None:
            continue
        if kind == "gemm":
            kind = "gemm1" if gemms % 2 == 0 else "gemm2"
            gemms += 1
        times[kind].append(e.time_range.elapsed_us())
    # one value per iteration: a step of several launches (the two-pass sort) is their sum
    per_iter = {s: len(v) // iters for s, v in times.items()}
    return {s: [sum(v[j * per_iter[s]:(j + 1) * per_iter[s]]) for j in range(iters)] if v else []
            for s, v in times.items()}


def conversion_cost(x, w13, s13, ti, t, e, i, top_k, dtype, cfg):
    """(GEMM1 us on the int8 codes, GEMM1 us on the codes as bf16): CUDA-graph replays of GEMM1 alone, unfused."""
    from expq.kernels import fused_moe_triton as fk

    cfg1 = dict(cfg, FUSE_ACT=False)
    bm = cfg1["BLOCK_SIZE_M"]
    sorted_ids, expert_ids, num_post = fk.invoke_moe_align(ti, bm, e, moe.max_padded_length(t * top_k, bm, e))
    cache = torch.empty(t * top_k, 2 * i, dtype=dtype, device="cuda")
    w13_bf = w13.to(dtype)

    def gemm1(w):
        fk.invoke_fused_moe_w8a16(x, w, cache, s13, None, None, sorted_ids, expert_ids, num_post, top_k=top_k,
                                  mul_routed_weight=False, config=cfg1)

    out = (graph_time(lambda: gemm1(w13), 50), graph_time(lambda: gemm1(w13_bf), 50))
    del w13_bf, cache
    torch.cuda.empty_cache()
    return out


def profile_shape(name, tokens, iters, dtype, copy_gbs, convert_from=1024):
    """The rows of one shape (see the module docstring)."""
    e, h, i, top_k = SHAPES[name]
    w13, w2, s13, s2, _ = make_weights(e, h, i, "cuda")
    rows = []
    for t in tokens:
        gen = torch.Generator(device="cuda").manual_seed(1000 + t)
        x, tw, ti = make_routing(t, e, h, top_k, dtype, "cuda", gen)
        cfg = moe.get_config(t, e, top_k, "cuda", hidden_size=h, intermediate_size=i, dtype=dtype)

        def run():
            return moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg)

        times = profile_point(run, iters)
        med = {s: (statistics.median(v) if v else 0.0) for s, v in times.items()}
        total_graph = graph_time(run, 50)
        # the sort alone, one launch against two (moe_align_count_kernel first), CUDA-graph replay
        from expq.kernels import fused_moe_triton as fk

        bm = cfg["BLOCK_SIZE_M"]
        bound = moe.max_padded_length(t * top_k, bm, e)
        sort_passes_us = {p: graph_time(lambda p=p: fk.invoke_moe_align(ti, bm, e, bound, passes=p), 20)
                          for p in (1, 2)}
        if t >= convert_from and moe.sorts_pairs(t, top_k, e):
            row_conv = conversion_cost(x, w13, s13, ti, t, e, i, top_k, dtype, cfg)
        else:
            row_conv = None
        active = int(torch.unique(ti).numel())
        pairs = t * top_k
        row = dict(shape=name, tokens=t, config=cfg, us=med, graph_us=total_graph,
                   gaps_us=None if total_graph is None else total_graph - sum(med.values()),
                   active_experts=active, copy_gbs=copy_gbs, sort_passes_us=sort_passes_us, gemm1_int8_bf16w_us=row_conv)
        for step, n, k in (("gemm1", 2 * i, h), ("gemm2", h, i)):
            us = med[step]
            if us > 0:
                row[f"{step}_copy_frac"] = active * n * k / (us * 1e-6) / (copy_gbs * 1e9)
                row[f"{step}_tflops"] = 2 * pairs * n * k / (us * 1e-6) / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
    inv = invariance(x, w13, w2, s13, s2, tw, ti, tokens, e, h, i, top_k, dtype)
    rows.append(dict(shape=name, invariance=inv))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def invariance(x, w13, w2, s13, s2, tw, ti, tokens, e, h, i, top_k, dtype):
    """{T: (fraction of token 0's outputs != alone, max |diff| / ||alone||)} for token 0 of the last batch."""
    def first(t):
        cfg = moe.get_config(t, e, top_k, "cuda", hidden_size=h, intermediate_size=i, dtype=dtype)
        return moe.fused_moe_triton(x[:t], w13, w2, s13, s2, tw[:t], ti[:t], config=cfg)[0].float()

    alone = first(1)
    out = {}
    for t in tokens:
        if t <= x.shape[0]:
            d = first(t) - alone
            out[t] = ((d != 0).float().mean().item(), (d.abs().max() / alone.norm()).item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_point_args(ap)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--convert-from", type=int, default=1024,
                    help="from this many tokens, time GEMM1 on int8 and on bf16 weights (the conversion's share)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_kernel.py needs a CUDA GPU")
    dtype = getattr(torch, a.dtype)
    copy_gbs = copy_bandwidth()
    rows = []
    for name in [n for n in SHAPES if any(n.startswith(s) for s in a.shapes)]:
        rows += profile_shape(name, a.tokens, a.iters, dtype, copy_gbs, a.convert_from)
        torch.cuda.empty_cache()
    lines = [f"copy bandwidth {copy_gbs:.0f} GB/s; {torch.cuda.get_device_name()}; median of {a.iters} profiled runs, "
             "L2 flushed", "",
             "| shape | T | sort | GEMM1 (%copy, TFLOP/s) | act | GEMM2 (%copy, TFLOP/s) | sum | gaps | graph "
             "| sort alone, 1 / 2 passes | GEMM1 int8 / bf16 weights |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "invariance" in r:
            continue
        u = r["us"]
        g1 = f"{u['gemm1']:.1f} ({100 * r.get('gemm1_copy_frac', 0):.0f}%, {r.get('gemm1_tflops', 0):.0f})"
        g2 = f"{u['gemm2']:.1f} ({100 * r.get('gemm2_copy_frac', 0):.0f}%, {r.get('gemm2_tflops', 0):.0f})"
        gaps = "" if r["gaps_us"] is None else f"{r['gaps_us']:.1f}"
        graph = "" if r["graph_us"] is None else f"{r['graph_us']:.1f}"
        lines.append(f"| {r['shape']} | {r['tokens']} | {u['sort']:.1f} | {g1} | {u['act']:.1f} | {g2} | "
                     f"{u['sum']:.1f} | {gaps} | {graph} | "
                     + " / ".join("-" if v is None else f"{v:.1f}" for v in r["sort_passes_us"].values()) + " | "
                     + ("" if not r["gemm1_int8_bf16w_us"] else
                        " / ".join("-" if v is None else f"{v:.1f}" for v in r["gemm1_int8_bf16w_us"])) + " |")
    lines += ["", "Batch invariance of token 0 (vs computed alone): fraction of outputs that differ, max |diff| / norm",
              ""]
    lines += [f"- {r['shape']}: " + ", ".join(f"T={t}: {f:.3f}, {m:.1e}" for t, (f, m) in r["invariance"].items())
              for r in rows if "invariance" in r]
    md = "\n".join(lines) + "\n"
    print(md)
    if a.md:
        Path(a.md).write_text(md)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, rows=rows), indent=1))


if __name__ == "__main__":
    main()

"""Benchmark of expq's experts_int8 fused MoE (Triton, int8 weights) against a bf16-weight baseline, on one GPU.

Usage (repo root, CUDA machine):
    python3 bench/bench_kernel.py                  # all shapes, tokens 1 8 32 128 1024 4096
    BENCH_OUT=bench.json python3 bench/bench_kernel.py
    python3 bench/bench_kernel.py --shapes mixtral --tokens 1 32 --dtype float16
    python3 bench/bench_kernel.py --sweep --shapes qwen --tokens 1 1024      # block-config tuning aid

Baseline (bf16 weights, the same routing): vLLM's ``fused_experts`` when ``import vllm`` works; else
``torch._grouped_mm`` (PyTorch's grouped GEMM, bf16 only) when it runs; else one bf16 ``x @ w.T`` per expert that
has tokens. Times are ``triton.testing.do_bench`` medians in microseconds, twice: "eager" (each call launched from
Python: includes launch overhead, which dominates small token counts) and "graph" (the call captured once in a CUDA
graph and replayed: GPU time). The int8 path never synchronises with the host, so it can be captured.
Speedup = baseline / int8, on graph times where both exist, else eager. "TB/s" = bytes of the int8 weights of the
experts that have tokens / int8 graph (else eager) time: the bandwidth bound that matters for small token counts.
Relative error is ||out - ref|| / ||ref|| against ``moe_reference`` (fp32, dequantized weights), for both paths.
Weights are random (int8 codes uniform in [-127, 127], per-row scales); routing is a random softmax top-k.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expq.kernels import fused_moe_int8, moe_reference  # noqa: E402

SHAPES = {
    # name: (E, H, I, top_k)
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
}
TOKENS = (1, 8, 32, 128, 1024, 4096)


def log(msg):
    print(f"# {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Baselines (bf16 weights, silu).


def _vllm_fused_experts():
    """vLLM's fused_experts, or None (not installed, or not importable here)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts  # type: ignore
    except Exception as exc:  # noqa: BLE001 - any import failure means: no vLLM baseline
        log(f"vLLM not usable ({type(exc).__name__}: {exc})")
        return None
    return fused_experts


def torch_loop_bf16(x, w13, w2, topk_weights, topk_ids):
    """One matmul pair per expert with tokens (synchronises: not capturable)."""
    t, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    i_dim = w2.shape[2]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start:start + c]
        start += c
        tok = pairs // top_k
        h = x[tok] @ w13[e].T
        a = (torch.nn.functional.silu(h[:, :i_dim].float()) * h[:, i_dim:].float()).to(x.dtype)
        y = (a @ w2[e].T).float() * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def torch_grouped_mm_bf16(x, w13, w2, topk_weights, topk_ids):
    """Sort pairs by expert, two ``torch._grouped_mm`` calls, silu-and-mul, weighted scatter-add (capturable)."""
    t, top_k = topk_ids.shape
    e_dim = w13.shape[0]
    i_dim = w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e_dim, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // top_k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    a = (torch.nn.functional.silu(h[:, :i_dim].float()) * h[:, i_dim:].float()).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float() * topk_weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------------------------------
# Timing.


def eager_time(fn, rep):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def graph_time(fn, rep):
    """Median time of one replay of fn captured in a CUDA graph (us), or None if fn cannot be captured."""
    import triton

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        us = triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") * 1e3
        del graph
        return us
    except Exception as exc:  # noqa: BLE001 - report and go on without graph timing
        log(f"graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.synchronize()
        return None


def make_weights(e, h, i, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, device=dev, generator=g)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, device=dev, generator=g)
    s13 = (torch.rand(e, 2 * i, device=dev, generator=g) + 0.5) * (math.sqrt(3) / (127 * math.sqrt(h)))
    s2 = (torch.rand(e, h, device=dev, generator=g) + 0.5) * (math.sqrt(3) / (127 * math.sqrt(i)))
    return w13, w2, s13, s2, g


def make_routing(t, e, h, top_k, dtype, dev, g):
    x = torch.randn(t, h, device=dev, generator=g).to(dtype)
    tw, ti = torch.topk(torch.randn(t, e, device=dev, generator=g).softmax(-1), top_k, dim=-1)
    return x, tw, ti.to(torch.int32)


# ------------------------------------------------------------------------------------------------------------------
# Block-config sweep (tuning aid for expq.kernels.moe._CONFIG_TABLE).

SWEEP_CONFIGS = [
    dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=gm, num_warps=w, num_stages=st)
    for (m, n, k, gm, w, st) in (
        (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
        (16, 32, 256, 1, 4, 4), (16, 64, 64, 1, 4, 5),
        (32, 64, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4),
        (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 128, 8, 8, 3),
        (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
    )
]


def sweep(names, tokens, dtype, rep):
    """Graph-replay time of fused_moe_triton with each SWEEP_CONFIGS entry whose BLOCK_SIZE_M suits the tokens."""
    from expq.kernels import moe

    dev = "cuda"
    for name in names:
        e, h, i, top_k = SHAPES[name]
        w13, w2, s13, s2, g = make_weights(e, h, i, dev)
        for t in tokens:
            x, tw, ti = make_routing(t, e, h, top_k, dtype, dev, g)
            default = moe.get_config(t, e, top_k, dev)
            per_expert = t * top_k / e
            results = []
            for cfg in SWEEP_CONFIGS:
                if cfg["BLOCK_SIZE_M"] > max(16, 2 * per_expert) or cfg["BLOCK_SIZE_M"] < min(64, per_expert / 4):
                    continue
                us = graph_time(lambda: moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg), rep)
                if us is not None:
                    results.append((us, cfg))
            us_default = graph_time(lambda: moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti), rep)
            results.sort(key=lambda r: r[0])
            print(f"SWEEP {name} T={t}: default {us_default:.1f} us {default}", flush=True)
            for us, cfg in results[:5]:
                print(f"SWEEP     {us:.1f} us {cfg}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------------


def main():
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), help=f"subset of {list(SHAPES)} (prefix ok)")
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-baseline", action="store_true", help="time only the int8 kernel")
    parser.add_argument("--no-error", action="store_true", help="skip the fp32 reference")
    parser.add_argument("--no-graph", action="store_true", help="eager timing only")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--sweep", action="store_true", help="instead: time a list of block configs (tuning aid)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernel.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    names = [n for n in SHAPES if any(n.startswith(s) for s in args.shapes)]
    if args.sweep:
        sweep(names, args.tokens, dtype, min(args.rep, 50))
        return

    baselines = []  # (name, fn, capturable), tried in order; the first that runs is kept for the whole run
    if not args.no_baseline:
        vllm_fe = _vllm_fused_experts()
        if vllm_fe is not None:
            baselines.append(("vllm-fused_experts-bf16", vllm_fe, True))
        if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            baselines.append(("torch-grouped_mm-bf16", torch_grouped_mm_bf16, True))
        baselines.append((f"torch-loop-{args.dtype}", torch_loop_bf16, False))

    gpu = torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, dtype=args.dtype,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(f"# {gpu}; torch {torch.__version__}; triton {triton.__version__}; activations {args.dtype}; "
          f"times in us (do_bench median)")
    header = (f"{'shape':<14} {'T':>5} {'int8':>9} {'int8 gr':>9} {'base':>9} {'base gr':>9} {'speedup':>7} "
              f"{'TB/s':>5} {'err int8':>9} {'err base':>9}  baseline")
    print(header)
    print("-" * len(header))
    rows = []
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for name in names:
        e, h, i, top_k = SHAPES[name]
        w13, w2, s13, s2, g = make_weights(e, h, i, dev)
        w13_bf = w2_bf = None
        if baselines:
            w13_bf = w13.to(dtype) * s13[:, :, None].to(dtype)
            w2_bf = w2.to(dtype) * s2[:, :, None].to(dtype)
        for t in args.tokens:
            x, tw, ti = make_routing(t, e, h, top_k, dtype, dev, g)

            def run_int8():
                return fused_moe_int8(x, w13, w2, s13, s2, tw, ti, backend="triton")

            out8 = run_int8()
            row = dict(shape=name, E=e, H=h, I=i, top_k=top_k, tokens=t, dtype=args.dtype)
            row["int8_us"] = eager_time(run_int8, args.rep)
            row["int8_graph_us"] = None if args.no_graph else graph_time(run_int8, args.rep)
            used = int(torch.unique(ti).numel())
            row["int8_weight_bytes"] = used * 3 * i * h
            best8 = row["int8_graph_us"] or row["int8_us"]
            row["int8_tb_s"] = row["int8_weight_bytes"] / (best8 * 1e-6) / 1e12
            row.update(baseline=None, baseline_us=None, baseline_graph_us=None)
            outb = None
            while baselines and outb is None:
                bname, bfn, capturable = baselines[0]
                try:
                    outb = bfn(x, w13_bf, w2_bf, tw, ti)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - next baseline
                    log(f"baseline {bname} failed ({type(exc).__name__}: {str(exc)[:200]}); trying the next")
                    baselines.pop(0)
                    continue
                row["baseline"] = bname
                run_base = lambda: bfn(x, w13_bf, w2_bf, tw, ti)  # noqa: E731
                row["baseline_us"] = eager_time(run_base, args.rep)
                if capturable and not args.no_graph:
                    row["baseline_graph_us"] = graph_time(run_base, args.rep)
            row["err_int8"] = row["err_baseline"] = None
            if not args.no_error:
                ref = moe_reference(x, w13, w2, s13, s2, tw, ti)
                row["err_int8"] = rel_err(out8, ref)
                if outb is not None:
                    row["err_baseline"] = rel_err(outb, ref)
                del ref
            if row["int8_graph_us"] and row["baseline_graph_us"]:
                row["speedup"] = row["baseline_graph_us"] / row["int8_graph_us"]
            elif row["baseline_us"]:
                row["speedup"] = row["baseline_us"] / row["int8_us"]
            else:
                row["speedup"] = None
            rows.append(row)
            print(f"{name:<14} {t:>5} {row['int8_us']:>9.1f} {fmt(row['int8_graph_us'], '>9.1f'):>9} "
                  f"{fmt(row['baseline_us'], '>9.1f'):>9} {fmt(row['baseline_graph_us'], '>9.1f'):>9} "
                  f"{fmt(row['speedup'], '>7.2f'):>7} {row['int8_tb_s']:>5.2f} {fmt(row['err_int8'], '>9.2e'):>9} "
                  f"{fmt(row['err_baseline'], '>9.2e'):>9}  {row['baseline'] or '-'}", flush=True)
        del w13, w2, w13_bf, w2_bf
        torch.cuda.empty_cache()
    out_path = os.environ.get("BENCH_OUT")
    if out_path:
        Path(out_path).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"# wrote {out_path}")


if __name__ == "__main__":
    main()

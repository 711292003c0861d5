"""Benchmark of expq's experts_int8 fused MoE (Triton, int8 weights) against a bf16-weight baseline, on one GPU.

Usage (repo root, CUDA machine):
    python3 bench/bench_kernel.py                  # all shapes, tokens 1 8 32 128 1024 4096
    BENCH_OUT=bench.json python3 bench/bench_kernel.py
    python3 bench/bench_kernel.py --shapes mixtral --tokens 1 32 --dtype float16
    python3 bench/bench_kernel.py --sweep --shapes qwen --tokens 1 1024      # block-config tuning aid
    PYTHONPATH=/tmp/site:. python3 bench/bench_kernel.py --compare --md cmp.md --json cmp.json   # issue 13 table
    PYTHONPATH=. python3 bench/bench_kernel.py --e2e --json e2e.json         # tokens/s, Qwen3-30B-A3B-shaped

--compare (the issue-13 table, one process): per shape and token count, expq's kernel (the GPU's tuned table entry
when expq/kernels/configs/ has one, see bench/tune_kernel.py; then expq's default as well, "expq-default"), vLLM's
fused_experts with bf16 weights, vLLM's int8_w8a16 path, and Marlin on compressed-tensors W8A16 weights repacked as
vLLM does (bench/kernel_baselines.py says exactly how each is called); each timed as the median of CUDA-graph
replays (do_bench clears L2 before each replay); "%copy" = that implementation's weight bytes of the experts with
tokens (int8: 3*I*H per expert; bf16: twice that) / time, against the device copy bandwidth measured in the same run.
A baseline whose vLLM op cannot be imported is skipped with the reason in the output. Markdown to stdout (--md:
also to a file), --json: everything. --e2e: see the docstring of e2e().

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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from expq.kernels import fused_moe_int8, moe_reference, tuned  # noqa: E402

SHAPES = {
    # name: (E, H, I, top_k)
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
}
TOKENS = (1, 8, 32, 128, 1024, 4096)


def add_point_args(parser, shapes_help=None) -> None:
    """The arguments that pick the points (shapes, token counts, activation dtype), shared by the kernel scripts."""
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES),
                        help=shapes_help or f"subset of {list(SHAPES)} (prefix ok)")
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])


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


def capture_graph(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream), or None if it cannot be captured."""
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
        return graph
    except Exception as exc:  # noqa: BLE001 - report and go on without graph timing
        log(f"graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.synchronize()
        return None


def replay_time(graph, rep):
    """Median time of one replay of a captured graph (us): triton.testing.do_bench, L2 cleared before each."""
    import triton

    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") * 1e3


def graph_time(fn, rep):
    """Median time of one replay of fn captured in a CUDA graph (us), or None if fn cannot be captured."""
    graph = capture_graph(fn)
    if graph is None:
        return None
    us = replay_time(graph, rep)
    del graph
    return us


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
            print(f"SWEEP {name} T={t}: default {us_default:.1f} us {tuned.check_config(default)}", flush=True)
            for us, cfg in results[:5]:
                print(f"SWEEP     {us:.1f} us {tuned.check_config(cfg)}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------------
# --compare: the issue-13 table, expq against vLLM bf16, vLLM int8_w8a16 and Marlin, one process.


def copy_bandwidth(rep=200):
    """Device-to-device copy of 2 GiB, bytes read + written per second (GB/s), do_bench median."""
    import triton

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=rep, return_mode="median")
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / ms / 1e6


def compare(names, tokens, dtype, rep, md_path, json_path, rounds=3):
    """One row per (shape, tokens): graph-replay median (us) of expq (its table entry if the GPU has one, else the
    default; the default too when they differ), vLLM bf16, vLLM int8_w8a16 and Marlin; %copy of each (its own weight
    bytes of the experts that have tokens / time / measured copy bandwidth); rel. error against moe_reference.
    Each implementation's graph is captured once and timed ``rounds`` times, the rounds interleaved across the
    implementations (each round in a rotated order); the time is the median of its rounds."""
    import triton

    from expq.kernels import moe
    from kernel_baselines import BASELINES, WEIGHT_BYTES_PER_ELEMENT, Unavailable, vllm_context

    dev = "cuda"
    gpu = torch.cuda.get_device_name()
    table = tuned.load_table(gpu)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw:.0f} GB/s; tuned table for {gpu}: "
        f"{'yes' if table else 'none (expq runs its default configs)'}")
    skipped = {}
    rows = []
    with vllm_context():
        for name in names:
            e, h, i, top_k = SHAPES[name]
            w13, w2, s13, s2, g = make_weights(e, h, i, dev)
            w13_bf = w13.to(dtype) * s13[:, :, None].to(dtype)
            w2_bf = w2.to(dtype) * s2[:, :, None].to(dtype)
            runs = {}
            for bname, build in BASELINES.items():
                if bname in skipped:
                    continue
                try:
                    runs[bname] = build(w13=w13, w2=w2, s13=s13, s2=s2, w13_bf=w13_bf, w2_bf=w2_bf, dtype=dtype)
                except Unavailable as exc:
                    skipped[bname] = str(exc)
                    log(f"SKIPPED {bname}: {exc}")
            for t in tokens:
                x, tw, ti = make_routing(t, e, h, top_k, dtype, dev, g)
                used = int(torch.unique(ti).numel())
                int8_bytes = used * 3 * i * h
                cfg_used = moe.get_config(t, e, top_k, dev, hidden_size=h, intermediate_size=i, dtype=dtype)
                cfg_default = moe.get_config(t, e, top_k, dev, tuned=False)  # both with all of tuned.CONFIG_KEYS
                impls = {"expq": lambda: moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg_used)}
                if cfg_used != cfg_default:
                    impls["expq-default"] = lambda: moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti,
                                                                         config=cfg_default)
                for bname, run in runs.items():
                    impls[bname] = (lambda run=run: run(x, tw, ti))
                ref = moe_reference(x, w13, w2, s13, s2, tw, ti)
                row = dict(shape=name, E=e, H=h, I=i, top_k=top_k, tokens=t, dtype=str(dtype)[6:],
                           experts_touched=used, expq_config=cfg_used,
                           expq_config_source="table" if cfg_used != cfg_default else "default", impl={})
                graphs = {}
                for iname, fn in impls.items():
                    r = dict(us=None, timing=None, rel_err=None, pct_copy=None, error=None, rounds_us=[])
                    try:
                        out = fn()
                        torch.cuda.synchronize()
                        r["rel_err"] = rel_err(out, ref)
                        del out
                        graphs[iname] = capture_graph(fn)
                        if graphs[iname] is None:
                            r["rounds_us"], r["timing"] = [eager_time(fn, rep)], "eager"
                        else:
                            r["timing"] = "graph"
                    except Exception as exc:  # noqa: BLE001 - recorded in the row
                        r["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        log(f"{name} T={t} {iname} failed: {r['error']}")
                        torch.cuda.synchronize()
                    row["impl"][iname] = r
                # Interleaved rounds, each starting at the next implementation: clock drift (a long prefill heats
                # the GPU) spreads over all of them instead of favouring whichever ran first.
                order = [k for k, g in graphs.items() if g is not None]
                for rnd in range(rounds if order else 0):
                    shift = rnd % len(order)
                    for iname in order[shift:] + order[:shift]:
                        try:
                            row["impl"][iname]["rounds_us"].append(replay_time(graphs[iname], rep))
                        except Exception as exc:  # noqa: BLE001 - recorded in the row; its other rounds still count
                            row["impl"][iname]["error"] = f"round {rnd}: {type(exc).__name__}: {str(exc)[:300]}"
                            log(f"{name} T={t} {iname} failed in round {rnd}: {row['impl'][iname]['error']}")
                            torch.cuda.synchronize()
                del graphs
                for iname, r in row["impl"].items():
                    if r["rounds_us"]:
                        r["us"] = statistics.median(r["rounds_us"])
                        nbytes = int8_bytes * WEIGHT_BYTES_PER_ELEMENT.get(iname, 1)
                        r["pct_copy"] = 100 * nbytes / (r["us"] * 1e-6) / 1e9 / bw
                del ref
                base = {k: v["us"] for k, v in row["impl"].items() if k in BASELINES and v["us"]}
                best = min(base, key=base.get) if base else None
                ex = row["impl"]["expq"]["us"]
                row.update(best_baseline=best, best_baseline_us=base.get(best),
                           speedup_vs_best=(base[best] / ex) if best and ex else None,
                           beats_all=bool(ex and base and len(base) == len(BASELINES) and ex < min(base.values())),
                           copy_ok=None if t > 128 else bool(ex and row["impl"]["expq"]["pct_copy"] >= 85))
                rows.append(row)
                cells = "  ".join(f"{k} {v['us']:.1f}" if v["us"] else f"{k} -" for k, v in row["impl"].items())
                log(f"{name} T={t}: {cells}; best baseline {best}; x{row['speedup_vs_best'] or float('nan'):.2f}")
            del w13, w2, w13_bf, w2_bf, runs
            torch.cuda.empty_cache()

    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, dtype=str(dtype)[6:], copy_GBps=bw,
                tuned_table=bool(table), skipped=skipped, rep_ms=rep, rounds=rounds, time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                timing=f"triton.testing.do_bench median of CUDA-graph replays (L2 cleared before each), median of "
                       f"{rounds} interleaved rounds, us")
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001
        meta["vllm"] = None
    md = compare_markdown(rows, meta)
    print(md)
    if md_path:
        Path(md_path).write_text(md)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        log(f"wrote {json_path}")


def compare_markdown(rows, meta):
    from kernel_baselines import BASELINES

    cols = ["expq"] + (["expq-default"] if any("expq-default" in r["impl"] for r in rows) else []) + list(BASELINES)
    out = [f"{meta['gpu']}; torch {meta['torch']}; triton {meta['triton']}; vLLM {meta['vllm']}; {meta['dtype']} "
           f"activations; copy bandwidth {meta['copy_GBps']:.0f} GB/s; expq table: "
           f"{'yes' if meta['tuned_table'] else 'none'}; {meta['timing']}.", ""]
    for k, why in meta["skipped"].items():
        out.append(f"**{k} skipped**: {why}")
    if meta["skipped"]:
        out.append("")
    out.append("| shape | T | " + " | ".join(f"{c} us (%copy)" for c in cols) +
               " | best baseline | expq speedup | beats all | >=85% copy |")
    out.append("|" + "---|" * (len(cols) + 6))
    for r in rows:
        cells = []
        for c in cols:
            v = r["impl"].get(c)
            if v is None or v["us"] is None:
                cells.append("-" if v is None or not v["error"] else "error")
            else:
                cells.append(f"{v['us']:.1f} ({v['pct_copy']:.0f}%)" + ("" if v["timing"] == "graph" else " eager"))
        sp = "-" if r["speedup_vs_best"] is None else f"{r['speedup_vs_best']:.2f}x"
        ok = "-" if r["copy_ok"] is None else ("yes" if r["copy_ok"] else "no")
        out.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells) +
                   f" | {r['best_baseline'] or '-'} | {sp} | {'yes' if r['beats_all'] else 'no'} | {ok} |")
    beats = sum(r["beats_all"] for r in rows)
    copy_rows = [r for r in rows if r["copy_ok"] is not None]
    out += ["", f"expq beats every baseline at {beats} of {len(rows)} points; >= 85% of copy bandwidth at "
                f"{sum(r['copy_ok'] for r in copy_rows)} of {len(copy_rows)} points with T <= 128.",
            "Relative errors against the fp32 reference: " + "; ".join(
                f"{c} max {max(r['impl'][c]['rel_err'] for r in rows if r['impl'].get(c, {}).get('rel_err') is not None):.1e}"
                for c in cols if any(r["impl"].get(c, {}).get("rel_err") is not None for r in rows)), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------------
# --e2e: tokens/s of a Qwen3-30B-A3B-shaped model, int8 experts through expq.load_model against the bf16 model.

E2E_CONFIG = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=4096,
                  max_position_embeddings=8192, tie_word_embeddings=False)


def host_profile(model, ids, rows=25):
    """The ``rows`` ops with the most host (self CPU) time in one eager forward, as torch.profiler's table text: where
    an eager forward spends host time or waits for the GPU (cudaStreamSynchronize, cudaMemcpy, cudaFree lines)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def e2e(layers, decode_batch, prefill_len, work, reps, json_path, profile_host=False):
    """Build a Qwen3-30B-A3B-shaped checkpoint (random N(0, 0.02) bf16 weights, ``layers`` decoder layers, small
    vocabulary), convert it with expq (experts_int8 format), and time full forwards (``use_cache=False``, eager,
    CUDA events, median of ``reps``; also the host time of issuing each eager forward, and the forward replayed as
    a CUDA graph where it can be captured) of the bf16 model (transformers' own experts) and of expq.load_model's model
    (int8 experts through expq's kernel): a decode-shaped batch (``decode_batch`` sequences of 1 token) and one
    prefill (1 sequence of ``prefill_len`` tokens). Reports tokens/s (tokens per forward / time) and int8 / bf16;
    with ``profile_host``, also the host-time table of one eager forward each (``host_profile``)."""
    import statistics

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import expq
    from expq.runtime import load_model

    work = Path(work)
    src, out = work / "src", work / "int8"
    cfg = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **E2E_CONFIG)
    t0 = time.perf_counter()
    if not (src / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.02)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(src, max_shard_size="4GB")
        del model
        torch.cuda.empty_cache()
    if not (out / "config.json").exists():
        expq.convert(src, out, device="cuda", format="experts-int8", overwrite=True, fsync=False)
    log(f"e2e: checkpoint built and converted in {time.perf_counter() - t0:.1f}s ({layers} layers)")

    def bench(model, ids):
        """(eager seconds, host seconds to issue the eager forward, CUDA-graph seconds or None) per forward."""
        with torch.inference_mode():
            for _ in range(2):
                model(input_ids=ids, use_cache=False)
            ts, host = [], []
            for _ in range(reps):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                h0 = time.perf_counter()
                a.record()
                model(input_ids=ids, use_cache=False)
                b.record()
                host.append(time.perf_counter() - h0)
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            graph_us = graph_time(lambda: model(input_ids=ids, use_cache=False), 200)
        return statistics.median(ts), statistics.median(host), None if graph_us is None else graph_us / 1e6

    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = {"decode": torch.randint(0, cfg.vocab_size, (decode_batch, 1), device="cuda", generator=g),
              "prefill": torch.randint(0, cfg.vocab_size, (1, prefill_len), device="cuda", generator=g)}
    results = {}
    for which in ("bf16", "int8"):
        if which == "bf16":
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda")
        else:
            model = load_model(out, device="cuda", dtype=torch.bfloat16)
        model.eval()
        impl = getattr(model.config, "_experts_implementation", None)
        for kind, ids in inputs.items():
            sec, host, graph = bench(model, ids)
            results[(which, kind)] = dict(tokens_per_s=ids.numel() / sec, seconds=sec, host_seconds=host,
                                          graph_seconds=graph,
                                          graph_tokens_per_s=None if graph is None else ids.numel() / graph,
                                          tokens=ids.numel(), experts_impl=impl)
            log(f"e2e {which} {kind}: {ids.numel() / sec:.0f} tokens/s eager ({sec * 1e3:.2f} ms per forward of "
                f"{ids.numel()} tokens, {host * 1e3:.2f} ms of it issuing on the host); CUDA graph: "
                + ("not capturable" if graph is None else f"{graph * 1e3:.2f} ms"))
            if profile_host:
                table = host_profile(model, ids)
                results[(which, kind)]["host_profile"] = table
                log(f"e2e {which} {kind}: host profile of one eager forward\n{table}")
        del model
        torch.cuda.empty_cache()
    lines = [f"e2e: Qwen3-30B-A3B-shaped, {layers} layers, bf16 activations; "
             f"transformers {transformers.__version__}; forward without KV cache, median of {reps}", "",
             "| forward | tokens | mode | bf16 tokens/s | int8 (expq) tokens/s | int8 / bf16 | host ms bf16 / int8 |",
             "|---|---|---|---|---|---|---|"]
    for kind, ids in inputs.items():
        b, i8 = results[("bf16", kind)], results[("int8", kind)]
        label = f"decode batch {decode_batch}" if kind == "decode" else f"prefill {prefill_len}"
        lines.append(f"| {label} | {ids.numel()} | eager | {b['tokens_per_s']:.0f} | {i8['tokens_per_s']:.0f} | "
                     f"{i8['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
                     f"{b['host_seconds'] * 1e3:.2f} / {i8['host_seconds'] * 1e3:.2f} |")
        bg, ig = b["graph_tokens_per_s"], i8["graph_tokens_per_s"]
        lines.append(f"| {label} | {ids.numel()} | CUDA graph | {'-' if bg is None else f'{bg:.0f}'} | "
                     f"{'-' if ig is None else f'{ig:.0f}'} | {'-' if None in (bg, ig) else f'{ig / bg:.2f}x'} | |")
    print("\n".join(lines))
    if json_path:
        Path(json_path).write_text(json.dumps(dict(
            meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                      layers=layers, config=E2E_CONFIG, reps=reps),
            rows=[dict(model=w, forward=k, **v) for (w, k), v in results.items()]), indent=1))


# ------------------------------------------------------------------------------------------------------------------


def main():
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_point_args(parser)
    parser.add_argument("--no-baseline", action="store_true", help="time only the int8 kernel")
    parser.add_argument("--no-error", action="store_true", help="skip the fp32 reference")
    parser.add_argument("--no-graph", action="store_true", help="eager timing only")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--compare: interleaved timing rounds per implementation (median of them)")
    parser.add_argument("--sweep", action="store_true", help="instead: time a list of block configs (tuning aid)")
    parser.add_argument("--compare", action="store_true",
                        help="instead: expq vs vLLM bf16, vLLM int8_w8a16 and Marlin, same run (issue 13)")
    parser.add_argument("--md", default=None, help="--compare: also write the markdown table here")
    parser.add_argument("--json", default=None, help="--compare / --e2e: write the results here")
    parser.add_argument("--e2e", action="store_true",
                        help="instead: tokens/s of a Qwen3-30B-A3B-shaped model, expq int8 experts vs bf16")
    parser.add_argument("--e2e-layers", type=int, default=4)
    parser.add_argument("--e2e-decode-batch", type=int, default=64)
    parser.add_argument("--e2e-prefill", type=int, default=4096)
    parser.add_argument("--e2e-work", default="build/e2e", help="where the e2e checkpoints are written")
    parser.add_argument("--e2e-reps", type=int, default=10)
    parser.add_argument("--e2e-profile-host", action="store_true",
                        help="--e2e: also torch.profiler's host-time table of one eager forward per model and shape")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_kernel.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    names = [n for n in SHAPES if any(n.startswith(s) for s in args.shapes)]
    if args.sweep:
        sweep(names, args.tokens, dtype, min(args.rep, 50))
        return
    if args.compare:
        compare(names, args.tokens, dtype, args.rep, args.md, args.json, args.rounds)
        return
    if args.e2e:
        e2e(args.e2e_layers, args.e2e_decode_batch, args.e2e_prefill, args.e2e_work, args.e2e_reps, args.json,
            args.e2e_profile_host)
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

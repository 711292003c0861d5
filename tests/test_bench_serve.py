"""bench/serve.py's parts that run without a GPU: the shapes it builds (transformers models on the meta device), the
per-decode-step profile summary from torch-profiler (Chrome trace) files, vLLM's log figures, and the report."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("serve_under_test", BENCH / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape,gib,layers", [("qwen3", 15.09, 12), ("mixtral", 11.30, 4), ("deepseek_v3", 24.89, 1)])
def test_shapes_have_the_declared_experts(serve, shape, gib, layers):
    """Each shape's transformers model has E experts of [2I, H] / [H, I] in every layer, top_k per token, and the
    bf16 size the issue's table lists for it (Qwen3 15.09 GiB, Mixtral 11.3 GiB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    s = serve.SHAPES[shape]
    cfg = AutoConfig.for_model(s["model_type"], **s["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    up = [p for n, p in params.items() if n.endswith("mlp.experts.gate_up_proj")]
    down = [p for n, p in params.items() if n.endswith("mlp.experts.down_proj")]
    assert len(up) == len(down) == layers
    assert all(tuple(p.shape) == (s["E"], 2 * s["I"], s["H"]) for p in up)
    assert all(tuple(p.shape) == (s["E"], s["H"], s["I"]) for p in down)
    assert cfg.num_experts_per_tok == s["top_k"]
    assert round(sum(p.numel() for p in params.values()) * 2 / 2**30, 2) == gib


def chrome_trace(path: Path, kernels: dict, api: dict, gz=False) -> None:
    """A torch-profiler trace file: kernels {name: [(dur us), ...]} one after the other on one stream (no overlap, no
    gap: the GPU's busy time is their sum), host API calls {name: count}."""
    events, t = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}], 0.0
    for name, durs in kernels.items():
        for d in durs:
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": d, "args": {"stream": 7}})
            t += d
    for name, n in api.items():
        events += [{"ph": "X", "cat": "cuda_driver" if name.startswith("cu") and not name.startswith("cuda")
                    else "cuda_runtime", "name": name, "dur": 1}] * n
    text = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)


def test_decode_step_is_the_difference_over_steps(serve, tmp_path):
    """Prefill-only run a, run b with 4 more decode steps: per step = (b - a) / 4, by kernel kind and host call."""
    gemm, sort, attn = "fused_moe_kernel_0d1d2d", "moe_align_block_size_kernel", "flash_fwd_splitkv_kernel"
    chrome_trace(tmp_path / "a.pt.trace.json", {gemm: [100.0] * 2, attn: [50.0], "elementwise": [3.0]},
                 {"cudaLaunchKernel": 10, "cudaStreamSynchronize": 1})
    chrome_trace(tmp_path / "b.pt.trace.json.gz",
                 {gemm: [100.0] * 2 + [20.0] * 8, sort: [5.0] * 4, attn: [50.0] + [10.0] * 4, "elementwise": [3.0]},
                 {"cudaLaunchKernel": 10, "cudaStreamSynchronize": 5, "cudaGraphLaunch": 4, "cuLaunchKernel": 8},
                 gz=True)
    a = serve.trace_totals([tmp_path / "a.pt.trace.json"])
    b = serve.trace_totals([tmp_path / "b.pt.trace.json.gz"])
    assert a["kernels"][gemm] == [2, 200.0] and b["api"]["cudaGraphLaunch"] == 4
    step = serve.decode_step(1.0, 1.2, a, b, steps=4)
    assert step["wall_ms"] == 50.0 and step["gpu_ms"] == step["busy_ms"] == 0.055 and step["idle_ms"] == 49.945
    assert step["overlap_ms"] == 0.0
    assert step["kinds_us"] == {"moe_gemm": 40.0, "moe_sort": 5.0, "attention": 10.0, "other": 0.0}
    assert step["api_per_step"] == {"kernel_launches": 2.0, "syncs": 1.0, "graph_launches": 1.0}
    assert step["top"][0] == {"name": gemm, "calls": 2.0, "us": 40.0}


def gpu_trace(path: Path, events: list, base_ns: int | None = None) -> None:
    """A torch-profiler trace file of the given events (cat, name, ts us, dur us, stream), plain or gzip by suffix;
    with ``baseTimeNanoseconds`` when given, a CPU op and a runtime call around them (neither is GPU activity)."""
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -100, "dur": 10_000},
                             {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": -50, "dur": 3}]
             + [{"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d, "args": {"stream": st}}
                for c, n, ts, d, st in events]}
    if base_ns is not None:
        trace["baseTimeNanoseconds"] = base_ns
    text = json.dumps(trace)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)


# Two processes' files: the worker's (plain) with two overlapping kernels on streams 7 and 13, a memcpy touching them,
# a 14 us gap, a kernel with a memset inside it; the other's (gzip) 50 us later by its base time, a kernel holding a
# second one. Busy: [0, 16] + [30, 35] + [50.25, 54.25] = 25 us in 3 intervals, longest gap 50.25 - 35 = 15.25 us.
TRACE_1 = [("kernel", "fused_moe_kernel", 0, 10, 7), ("kernel", "flash_fwd_kernel", 4, 10, 13),
           ("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 14, 2, 7), ("kernel", "elementwise", 30, 5, 7),
           ("gpu_memset", "Memset (Device)", 33.5, 0.5, 13)]
TRACE_2 = [("kernel", "nvjet_gemm", 0.25, 4, 7), ("kernel", "silu_and_mul", 2, 1, 13)]


def write_two_files(tmp_path: Path, extra: list = ()) -> list[Path]:
    gpu_trace(tmp_path / "worker.pt.trace.json", TRACE_1 + list(extra), base_ns=1_000_000_000)
    gpu_trace(tmp_path / "front.pt.trace.json.gz", TRACE_2, base_ns=1_000_050_000)
    return [tmp_path / "worker.pt.trace.json", tmp_path / "front.pt.trace.json.gz"]


def test_trace_totals_busy_is_the_union_over_files_and_streams(serve, tmp_path):
    """Busy time: the union of kernel, memcpy and memset intervals over both files (each shifted by its base time)
    and all streams; the kernel sum counts the overlapping kernels twice."""
    t = serve.trace_totals(write_two_files(tmp_path))
    assert t["busy_us"] == 25.0 and t["busy_intervals"] == 3 and t["longest_gap_us"] == 15.25
    assert t["gpu_events"] == 7
    assert sum(us for _, us in t["kernels"].values()) == 30.0  # 10 + 10 + 5 + 4 + 1
    assert t["kernel_busy_us"] == 23.0  # [0, 14] + [30, 35] + [50.25, 54.25]: no memcpy, no memset
    assert t["api"] == {"cudaGraphLaunch": 2}
    # One file alone, without a base time: its own union (the memset within the kernel adds nothing)
    gpu_trace(tmp_path / "alone.json.gz", TRACE_1)
    one = serve.trace_totals([tmp_path / "alone.json.gz"])
    assert (one["busy_us"], one["busy_intervals"], one["longest_gap_us"], one["kernel_busy_us"]) == (21.0, 2, 14.0, 19.0)
    empty = serve.trace_totals([])
    assert (empty["busy_us"], empty["busy_intervals"], empty["longest_gap_us"]) == (0.0, 0, 0.0)


def decode_steps(start: float, steps: int) -> list:
    """``steps`` decode steps 50 us apart from ``start``: a 20 us kernel on stream 7, a 10 us one inside it on stream
    13, a 2 us memcpy after them: per step busy 22 us, kernel sum 30 us, kernels' union 20 us, one busy interval."""
    ev = []
    for j in range(steps):
        t0 = start + 50 * j
        ev += [("kernel", "fused_moe_kernel", t0, 20, 7), ("kernel", "flash_fwd_kernel", t0 + 5, 10, 13),
               ("gpu_memcpy", "Memcpy HtoD", t0 + 20, 2, 7)]
    return ev


def test_decode_step_busy_idle_overlap(serve, tmp_path):
    """Run b = run a + 4 decode steps. Per step: busy 22 us, kernel sum 30 us > the wall's 25 us (the over-count
    the sum-based idle made negative), idle = wall - busy = 3 us, overlap = kernel sum - kernels' union = 10 us."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = serve.trace_totals(write_two_files(tmp_path / "a"))
    b = serve.trace_totals(write_two_files(tmp_path / "b", decode_steps(100.25, 4)))
    assert (b["busy_us"], b["busy_intervals"], b["longest_gap_us"]) == (113.0, 7, 46.0)
    step = serve.decode_step(1.0, 1.0001, a, b, steps=4)
    assert step["wall_ms"] == 0.025 and step["gpu_ms"] == 0.03 and step["busy_ms"] == 0.022
    assert step["idle_ms"] == 0.003 and step["overlap_ms"] == 0.01
    assert step["busy_intervals_per_step"] == 1.0 and step["longest_gap_us_b"] == 46.0
    assert step["kinds_us"] == {"moe_gemm": 20.0, "attention": 10.0, "dense_gemm": 0.0, "moe_sum_act": 0.0,
                                "other": 0.0}


def test_profile_requests_option_and_prompt_lengths(serve):
    assert serve.parse_args(["out"]).profile_requests == [16]
    assert serve.parse_args(["out", "--profile-requests", "1", "16", "1"]).profile_requests == [1, 16]
    # the decode workloads' prompt lengths; the prefill workload (256 x 1536, one output token) is not one
    assert [serve.profile_prompt_len(n) for n in (1, 16, 512, 256, 64)] == [128, 512, 512, 512, 512]
    for bad in (["--profile-requests", "0"], ["--profile-requests", "16", "--profile-steps", "1600"]):
        with pytest.raises(SystemExit):
            serve.parse_args(["out", *bad])


def test_profile_decode_at_a_request_count(serve, tmp_path, monkeypatch):
    """profile_decode with a fake engine: every generate at the given requests and prompt length with new prompts,
    the profiled ones' traces read and deleted, the result the decode step of those traces."""
    calls, state = [], {"on": False}

    def fake_prompts(n, length, vocab, seed):
        return (n, length, seed)

    def fake_generate(llm, batch, max_tokens):
        calls.append((*batch, max_tokens, state["on"]))
        if state["on"]:  # the prefill as one more step
            gpu_trace(tmp_path / f"t{len(calls)}.pt.trace.json", decode_steps(0, max_tokens))
        return 1.0 + 0.0001 * (max_tokens - 1) / 4

    class Engine:
        def start_profile(self):
            state["on"] = True

        def stop_profile(self):
            state["on"] = False

    monkeypatch.setattr(serve, "prompts", fake_prompts)
    monkeypatch.setattr(serve, "generate", fake_generate)
    pr = serve.profile_decode(Engine(), 32000, 4, tmp_path, requests=1, prompt_len=128, seed=77)
    assert [c[:2] for c in calls] == [(1, 128)] * 5
    assert len({c[2] for c in calls}) == 5  # five seeds: no prefix-cache hits
    assert [(c[3], c[4]) for c in calls] == [(8, False), (1, False), (5, False), (1, True), (5, True)]
    assert list(tmp_path.iterdir()) == []
    assert pr["requests"] == 1 and pr["prompt_len"] == 128 and pr["steps"] == 4
    assert (pr["wall_ms"], pr["busy_ms"], pr["idle_ms"], pr["gpu_ms"], pr["overlap_ms"]) == (
        0.025, 0.022, 0.003, 0.03, 0.01)


def test_log_figures_and_errors(serve, tmp_path):
    log = ("INFO 12-02 [default_loader.py:291] Loading weights took 3.21 seconds\n"
           "(EngineCore pid=7) INFO [gpu_model_runner.py:3012] Model loading took 8.3600 GiB memory and 5.1 seconds\n"
           "WARNING [fused_moe.py:1071] Using default MoE config. Performance might be sub-optimal! Config file not "
           "found at /x/configs/E=128,N=768,device_name=NVIDIA_H200,dtype=int8_w8a16.json\n"
           "WARNING [fused_moe.py:1071] Using default MoE config. Performance might be sub-optimal! Config file not "
           "found at /x/configs/E=128,N=768,device_name=NVIDIA_H200,dtype=int8_w8a16.json\n"
           "INFO [backends.py:1] torch.compile takes 21.5 s in total\n"
           "ValueError: something broke\nINFO done\n")
    found = serve.log_figures(log)
    assert found["weights_s"] == 3.21 and found["model_gib"] == 8.36 and found["compile_s"] == 21.5
    assert found["graph_capture_s"] is None
    assert found["moe_config_missing"] == ["/x/configs/E=128,N=768,device_name=NVIDIA_H200,dtype=int8_w8a16.json"]
    (tmp_path / "log").write_text(log)
    assert serve.last_error(tmp_path / "log") == "ValueError: something broke"


def test_report(serve, tmp_path):
    runs = {"bf16": {"1": [500, 580, 491]}, "online": {"1": [630]}, "int8-vllm": {"1": [700, 690, 719]},
            "int8-expq": {"1": [760, 740, 750]}, "ct-marlin": {"1": [640]}}
    results = {p: {"status": "ok", "runs": r, "load_s": 40.0, "model_gib": 8.36} for p, r in runs.items()}
    results["ct-marlin"] = {"status": "skipped: budget (150 s needed)"}
    state = {"machine": {"gpu": "NVIDIA H200", "cpus": 16}, "args": {}, "results": {"qwen3": results}}
    serve.write_report(tmp_path, state)
    md = (tmp_path / "serve.md").read_text()
    assert json.loads((tmp_path / "serve.json").read_text()) == state
    assert "| expq experts-int8, expq's kernel | 750 (740-760) | 40.0 | 8.36 | - | ok |" in md
    assert "| expq compressed-tensors (Marlin) | - | - | - | - | skipped: budget (150 s needed) |" in md
    assert "| 1 request (128 in, 256 out) | 750 | 700 (int8-vllm) | 1.07x | 1.07x |" in md


def test_report_profiles_per_request_count_and_old_single_profile(serve, tmp_path):
    """A new serve.json: one row per (path, request count), busy/idle/kernel sum from the profile; an older one's
    single profile (at 16 requests, its idle_ms wall - kernel sum) renders as the 16-request row without busy or
    idle; an older error profile too."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = serve.trace_totals(write_two_files(tmp_path / "a"))
    b = serve.trace_totals(write_two_files(tmp_path / "b", decode_steps(100.25, 4)))
    new = {n: {"requests": int(n), "prompt_len": serve.profile_prompt_len(int(n)),
               **serve.decode_step(1.0, 1.0 + w, a, b, steps=4)} for n, w in (("16", 0.0002), ("1", 0.0001))}
    old = {"steps": 32, "wall_ms": 2.16, "gpu_ms": 2.39, "idle_ms": -0.23, "kinds_us": {"moe_gemm": 1200.0},
           "api_per_step": {"graph_launches": 1.0}, "top": [{"name": "fused_moe_kernel", "calls": 24.0, "us": 1200.0}]}
    results = {"int8-expq": {"status": "ok", "profile": new}, "int8-vllm": {"status": "ok", "profile": old},
               "bf16": {"status": "ok", "profile": {"error": "the profiler wrote no trace under /x"}}}
    assert list(serve.profiles(results["int8-expq"])) == ["1", "16"]
    assert serve.profiles(results["int8-vllm"]) == {"16": old}
    serve.write_report(tmp_path, {"machine": {}, "args": {}, "results": {"qwen3": results}})
    md = (tmp_path / "serve.md").read_text()
    assert "| path | requests | wall ms | GPU busy ms | GPU idle ms | kernel sum ms | moe_gemm us |" in md
    assert "| int8-expq | 1 (128 in) | 0.025 | 0.022 | 0.003 | 0.03 | 20.0 | 0 | 0.0 | 0 | 10.0 | 0.0 | 0.0 |" in md
    assert "| int8-expq | 16 (512 in) | 0.05 | 0.022 | 0.028 | 0.03 | 20.0 |" in md
    assert "| int8-vllm | 16 | 2.16 | - | - | 2.39 | 1200.0 | 0 | 0 | 0 | 0 | 0 | 0 | 1.0 | 0 | 0 | 0 | 0 |" in md
    assert "| bf16 | 16 | the profiler wrote no trace under /x |" in md
    assert md.index("| int8-expq | 1 (128 in) |") < md.index("| int8-expq | 16 (512 in) |")
    assert "int8-vllm, 16 requests: top kernels per decode step (calls, us)" in md
    assert "- 1200.0 us, 24.0 calls: `fused_moe_kernel`" in md


def test_budget_and_resume(serve, tmp_path):
    """No time for a serve: nothing is built or started, every path says why; --resume keeps a finished serve."""
    out = tmp_path / "out"
    assert serve.main([str(out), "--shapes", "qwen3", "--budget", "0"]) == 0
    state = json.loads((out / "serve.json").read_text())
    assert {p: r["status"] for p, r in state["results"]["qwen3"].items()} == {
        p: "skipped: budget (150 s needed)" for p in serve.PATHS}
    assert not (out / "work").exists()
    state["results"]["qwen3"]["int8-expq"] = {"status": "ok", "runs": {"16": [5000.0]}}
    (out / "serve.json").write_text(json.dumps(state))
    serve.main([str(out), "--shapes", "qwen3", "--budget", "0", "--resume", "--serve-estimate", "90"])
    results = json.loads((out / "serve.json").read_text())["results"]["qwen3"]
    assert results["int8-expq"]["runs"] == {"16": [5000.0]}
    assert results["bf16"]["status"] == "skipped: budget (90 s needed)"
    assert "| expq experts-int8, expq's kernel | 5,000 |" in (out / "serve.md").read_text()


def test_jit_compiles_counted_per_timed_run(serve):
    """Compiles logged by vLLM's jit_monitor are attributed to the timed run they fall in (none outside a run, none
    for a run without any), and the report shows them per workload."""
    mon = "(EngineCore pid=7) WARNING 12-02 14:00:37 [jit_monitor.py:106] Triton kernel JIT compilation during " \
          "inference: moe_align_kernel (key=abc)."
    text = "\n".join([mon, f"{serve.RUN_MARK} start 1 0", f"{serve.RUN_MARK} end 1 0",
                      f"{serve.RUN_MARK} start 16 0", mon, mon, f"{serve.RUN_MARK} end 16 0", mon,
                      f"{serve.RUN_MARK} start 16 1", "INFO nothing", f"{serve.RUN_MARK} end 16 1",
                      f"{serve.RUN_MARK} start 16 2", mon, f"{serve.RUN_MARK} end 16 2"])
    assert serve.jit_compiles(text) == {"1": [0], "16": [2, 0, 1]}
    res = {"int8-expq": {"runs": {"1": [600.0], "16": [2000.0, 7000.0, 6000.0]}, "status": "ok",
                         "jit_compiles": serve.jit_compiles(text)}}
    row = [x for x in serve.shape_table("mixtral", res) if x.startswith("| expq experts-int8, expq")]
    assert row and "| 1: 0, 16: 2/0/1 |" in row[0]

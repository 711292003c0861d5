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
    """A torch-profiler trace file: kernels {name: [(dur us), ...]}, host API calls {name: count}."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5}]
    for name, durs in kernels.items():
        events += [{"ph": "X", "cat": "kernel", "name": name, "dur": d} for d in durs]
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
    assert step["wall_ms"] == 50.0 and step["gpu_ms"] == 0.055 and step["idle_ms"] == 49.945
    assert step["kinds_us"] == {"moe_gemm": 40.0, "moe_sort": 5.0, "attention": 10.0, "other": 0.0}
    assert step["api_per_step"] == {"kernel_launches": 2.0, "syncs": 1.0, "graph_launches": 1.0}
    assert step["top"][0] == {"name": gemm, "calls": 2.0, "us": 40.0}


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

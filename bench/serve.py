"""End-to-end serving throughput in real vLLM, every serving path of the same weights side by side (issue 26).

One invocation, on one GPU with vLLM importable (the device machine: ``bash bench/device.sh install`` first), per
shape (``--shapes``):

  1. build   a random checkpoint of the shape (``SHAPES``: a real model's dims, fewer layers; bf16 weights
             N(0, 0.02), norms 1) with transformers on the GPU, into WORK/<shape>/src;
  2. convert it with expq on the GPU to experts-int8 (WORK/<shape>/int8) and compressed-tensors (WORK/<shape>/ct);
  3. serve   each path (``PATHS``) in its own process, one at a time: bf16 (the source), online (``--quantization
             experts_int8`` on the source), int8-vllm and int8-expq (the experts-int8 checkpoint through expq's
             plugin, ``EXPQ_VLLM_KERNEL=vllm`` / ``expq``), ct-marlin (compressed-tensors, vLLM's Marlin MoE);
             ``vllm.LLM`` with CUDA graphs on (vLLM's defaults), ``gpu_memory_utilization`` 0.85, ``max_model_len``
             2048, ``skip_tokenizer_init``, random token-id prompts (new ones for every run: no prefix-cache hits),
             greedy, ``ignore_eos``. A short warm-up of every workload, then ``--runs`` timed runs of each
             (``WORKLOADS``: 1 request 128 in / 256 out, 16 requests 512 / 256, 512 requests 512 / 256, prefill
             256 x 1536 with one output token); output tokens/s (prefill: prompt tokens/s) = tokens / wall time of
             ``generate``;
  4. report  OUT/serve.json (everything, written after each serve: a cut-short invocation leaves what it measured)
             and OUT/serve.md (per shape: the median of the runs, min-max beside it; ``LLM()`` load seconds;
             vLLM's "Model loading took" GiB; the Triton compiles vLLM's jit_monitor logged inside each timed run
             (``jit_monitor_verbose``: a compile there is a latency spike in that run's figure); expq's kernel
             against the best other path and against vLLM's kernel
             per workload; the MoE config vLLM's Triton paths pick per batch size, from vLLM's own functions, and
             what its log said it looked up).

``--profile`` (in the same engines, after the timed runs): per serving path and per request count of
``--profile-requests`` (default 16), where a decode step's time goes. The prompts are as long as those of the decode
workload with that many requests in ``WORKLOADS`` (1: 128 tokens; 16 and 512: 512), else 512 tokens. At each count:
a warm-up generate of a few tokens, then two generates with 1 and 1 + ``--profile-steps`` output tokens, timed
without the profiler and then under vLLM's torch profiler (``profiler_config``); the difference divided by the steps
is one decode step: wall ms (the unprofiled runs); GPU busy ms (the profiled runs: the length of the union of the
[ts, ts + dur] intervals of every kernel, memcpy and memset in the traces, all streams and trace files together,
each file's ``baseTimeNanoseconds`` added: the time at least one of them ran); GPU idle ms = wall - busy (the GPU
ran nothing: host time, launches, syncs); kernel sum ms (the kernels' durations added up, which exceeds the busy
time when kernels run at once on several streams) and overlap ms (kernel sum - the union of the kernels' intervals
alone); the busy intervals (the union's pieces) per step; kernel time by kind (MoE GEMMs, the MoE sort, MoE
sum/activation, attention, dense GEMMs, other), host API calls per step (``cudaGraphLaunch``; kernel launches
outside a graph; synchronisations; copies), and the top kernels. Also, from the 1 + steps run's trace as a whole
(prefill included, not per step): the longest gap between two consecutive busy intervals. serve.json keeps one
profile per request count (``"profile": {"1": {...}, "16": {...}}``); an older serve.json's single profile is
reported as the one at 16 requests.

Budget: ``--budget`` seconds for the whole invocation; a serve is not started unless the time left covers the
longest serve so far (``--serve-estimate`` before the first); what is skipped says so in the report. The serves
run in ``SERVE_ORDER`` (vLLM's kernel, expq's, Marlin, online, bf16) unless ``--paths`` says otherwise. ``--resume``
keeps OUT/serve.json's finished serves and WORK's checkpoints and does the rest (a second device call on the same
warm machine). A shape's checkpoints are deleted once all its serves are done (disk: Qwen3 15 + 8 + 8 GiB, Mixtral
11 + 6 + 6 GiB), unless ``--keep``.

On the device (repo root; vLLM 0.24 in /tmp/site from ``bench/device.sh install``):

  export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/stub:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
  python3 bench/serve.py $OUT/serve --shapes qwen3 --runs 3 --profile --budget 560
  python3 bench/serve.py $OUT/serve --shapes qwen3 mixtral --runs 3 --resume --budget 560   # the next call
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    "qwen3": dict(title="Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, I 768; 12 of 48 layers)",
                  model_type="qwen3_moe", E=128, H=2048, I=768, top_k=8,
                  config=dict(num_hidden_layers=12, hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                              head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                              rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mixtral": dict(title="Mixtral-8x7B shape (hidden 4096, 8 experts, top-2, I 14336; 4 of 32 layers)",
                    model_type="mixtral", E=8, H=4096, I=14336, top_k=2,
                    config=dict(num_hidden_layers=4, hidden_size=4096, num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                vocab_size=32000, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5,
                                tie_word_embeddings=False)),
    # One MoE layer of 61: 22.5 GB of bf16 experts, ~54 GB of disk for the three checkpoints.
    "deepseek_v3": dict(title="DeepSeek-V3 shape (hidden 7168, 256 experts, top-8, I 2048; 1 of 61 layers)",
                        model_type="deepseek_v3", E=256, H=7168, I=2048, top_k=8,
                        config=dict(num_hidden_layers=1, first_k_dense_replace=0, hidden_size=7168,
                                    n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                                    intermediate_size=18432, n_shared_experts=1, n_group=8, topk_group=4,
                                    topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
                                    norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128,
                                    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                    v_head_dim=128, head_dim=64, vocab_size=129280, max_position_embeddings=163840,
                                    rope_theta=10000.0, tie_word_embeddings=False)),
}

# path -> (checkpoint: src/int8/ct, --quantization, EXPQ_VLLM_KERNEL, the row's label)
PATHS = {
    "bf16": ("src", None, None, "bf16"),
    "online": ("src", "experts_int8", None, "online `--quantization experts_int8`"),
    "int8-vllm": ("int8", None, "vllm", "expq experts-int8, vLLM's kernel"),
    "int8-expq": ("int8", None, "expq", "expq experts-int8, expq's kernel"),
    "ct-marlin": ("ct", None, None, "expq compressed-tensors (Marlin)"),
}
SERVE_ORDER = ("int8-vllm", "int8-expq", "ct-marlin", "online", "bf16")
"""The default order of the serves: the paths the issue's open questions need first, should the budget run out."""
FORMATS = {"int8": "experts-int8", "ct": "compressed-tensors"}

# workload -> (requests, prompt tokens, output tokens, the column's label); figure: output tokens/s, or prompt
# tokens/s when one token is generated (prefill)
WORKLOADS = {
    "1": (1, 128, 256, "1 request (128 in, 256 out)"),
    "16": (16, 512, 256, "16 requests (512 in, 256 out)"),
    "512": (512, 512, 256, "512 requests (512 in, 256 out)"),
    "prefill": (256, 1536, 1, "prefill (256 x 1536)"),
}
GPU_UTIL, MAX_MODEL_LEN = 0.85, 2048
MOE_BATCHES = (1, 16, 256, 512, 16384)  # batch sizes (tokens per step) whose MoE config is reported

LOG_FIGURES = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_gib": r"Model loading took ([\d.]+) ?GiB",
    "compile_s": r"torch\.compile takes ([\d.]+) ?s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) ?GiB",
}
LOG_LISTS = {
    "moe_config_files": r"Using configuration from (\S+) for MoE layer",
    "moe_config_missing": r"Using default MoE config\. Performance might be sub-optimal! Config file not found at "
                          r"(\S+)",
    "expq_kernel": r"(EXPQ_VLLM_KERNEL=expq: .*|expq's kernel cannot serve .*)",
}


def log(msg: str) -> None:
    print(f"[serve] {msg}", flush=True)


# --- the parent: plan, build, convert, serve one path at a time, write the report --------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget
    out, work = args.out, args.work or args.out / "work"
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out / "serve.json") if args.resume else {}
    state.setdefault("results", {})
    state["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    state["machine"] = state.get("machine") or machine()
    measured: list[float] = []  # seconds of each serve so far: the longest is the next one's estimate
    for shape in args.shapes:
        results = state["results"].setdefault(shape, {})
        todo = [p for p in args.paths if results.get(p, {}).get("status") != "ok"]
        if not todo:
            log(f"{shape}: every path done")
            continue
        need = max(measured, default=args.serve_estimate)
        if time.monotonic() + need > deadline:
            results.update({p: {"status": f"skipped: budget ({need:.0f} s needed)"} for p in todo})
            continue
        if not prepare_shape(shape, work / shape, todo, deadline, results):
            write_report(out, state)
            continue
        for path in todo:
            need = max(measured, default=args.serve_estimate)
            if time.monotonic() + need > deadline:
                results[path] = {"status": f"skipped: budget ({need:.0f} s needed)"}
                continue
            t0 = time.monotonic()
            results[path] = serve_path(shape, path, work / shape, out, args, deadline)
            measured.append(time.monotonic() - t0)
            write_report(out, state)
        if all(results.get(p, {}).get("status") == "ok" for p in args.paths) and not args.keep:
            shutil.rmtree(work / shape, ignore_errors=True)
            log(f"{shape}: all paths served; its checkpoints deleted")
    write_report(out, state)
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="serve.json, serve.md, logs/ (and work/ unless --work)")
    ap.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral"], choices=list(SHAPES))
    ap.add_argument("--paths", nargs="+", default=list(SERVE_ORDER), choices=list(PATHS),
                    help="which serves, in this order (the table lists them in its own order)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--runs", type=int, default=3, help="timed runs per workload (the table shows the median)")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole invocation")
    ap.add_argument("--serve-estimate", type=float, default=150, help="seconds one serve is assumed to take")
    ap.add_argument("--serve-timeout", type=float, default=420, help="seconds one serve may take")
    ap.add_argument("--profile", action="store_true",
                    help="per-decode-step profile at each --profile-requests count (see above)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--profile-requests", type=int, nargs="+", default=[16], metavar="N",
                    help="request counts the decode step is profiled at (default 16)")
    ap.add_argument("--work", type=Path, help="where the checkpoints go (default OUT/work)")
    ap.add_argument("--resume", action="store_true", help="keep OUT/serve.json's finished serves")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints after a shape is done")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.profile_steps < 1 or min(args.profile_requests) < 1:
        ap.error("--runs, --profile-steps and --profile-requests must be >= 1")
    args.profile_requests = list(dict.fromkeys(args.profile_requests))
    too_long = [n for n in args.profile_requests if profile_prompt_len(n) + 1 + args.profile_steps > MAX_MODEL_LEN]
    if too_long:
        ap.error(f"--profile-steps {args.profile_steps}: the requests of {too_long} would pass max_model_len "
                 f"{MAX_MODEL_LEN}")
    return args


def load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def machine() -> dict:
    """GPU, driver and CPU of this machine (versions of torch, Triton and vLLM come from the serves)."""
    info = {"cpus": os.cpu_count()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["gpu"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    return info


def child(step: str, spec: dict, log_path: Path, timeout: float) -> tuple[int | None, float]:
    """Run this file's ``step`` in a new process (spec as JSON in argv); its output to log_path. (exit, seconds)"""
    t0 = time.monotonic()
    with open(log_path, "w") as fh:
        p = subprocess.Popen([sys.executable, __file__, step, json.dumps(spec)], stdout=fh, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            p.wait(timeout=max(1.0, timeout))
            code = p.returncode
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(p.pid, 9)  # its whole process group: an engine core it started that outlived it too
        except ProcessLookupError:
            pass
        p.wait()
    wait_gpu_free()
    return code, time.monotonic() - t0


def wait_gpu_free(limit: float = 60.0) -> None:
    """Until no process holds the GPU (nvidia-smi lists no compute application), at most ``limit`` seconds: the
    next serve must find the memory free (vLLM checks that ``gpu_memory_utilization`` of it is)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return
        if q.returncode != 0 or not q.stdout.strip():
            return
        time.sleep(1.0)


def prepare_shape(shape: str, work: Path, todo: list[str], deadline: float, results: dict) -> bool:
    """Build the source and convert it to the formats ``todo`` needs, each unless already there. False (and the
    error recorded on every path of the shape) when a step fails."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    needed = ["src"] + sorted({PATHS[p][0] for p in todo} - {"src"})
    for name in needed:
        if (work / name / "config.json").exists():
            continue
        step, spec = ("_build", {"shape": shape, "dst": str(work / "src")}) if name == "src" else \
            ("_convert", {"src": str(work / "src"), "dst": str(work / name), "format": FORMATS[name]})
        code, secs = child(step, spec, logs / f"{name}.log", deadline - time.monotonic())
        log(f"{shape}: {step[1:]} {name}: exit {code} in {secs:.0f} s")
        if code != 0:
            err = f"{step[1:]} {name} failed (exit {code}): {last_error(logs / f'{name}.log')}"
            for p in todo:
                results[p] = {"status": err}
            return False
        results.setdefault("_prepare", {})[name + "_s"] = round(secs, 1)
    return True


def serve_path(shape: str, path: str, work: Path, out: Path, args, deadline: float) -> dict:
    ckpt, quant, kernel, _ = PATHS[path]
    spec = {"model": str(work / ckpt), "quantization": quant, "kernel": kernel, "shape": shape, "path": path,
            "workloads": args.workloads, "runs": args.runs, "profile": args.profile,
            "profile_steps": args.profile_steps,
            "profile_requests": args.profile_requests, "result": str(out / "runs" / f"{shape}-{path}.json"),
            "trace_dir": str(work / "traces" / path)}
    (out / "runs").mkdir(exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    Path(spec["result"]).unlink(missing_ok=True)
    log_path = out / "logs" / f"{shape}-{path}.log"
    log(f"{shape}: serving {path}")
    code, secs = child("_serve", spec, log_path, min(args.serve_timeout, deadline - time.monotonic()))
    res = load_state(Path(spec["result"]))
    text = log_path.read_text(errors="replace")
    res.update(log_figures(text), wall_s=round(secs, 1), jit_compiles=jit_compiles(text))
    if code == 0 and res.get("done"):
        res["status"] = "ok"
    else:
        res["status"] = "timeout" if code is None else f"failed (exit {code})"
        res["error"] = last_error(log_path)
    log(f"{shape}: {path}: {res['status']} in {secs:.0f} s")
    return res


def log_figures(text: str) -> dict:
    """vLLM's own figures from a serve's log (first match each), and the lines saying which MoE config or kernel
    ran (distinct, in order)."""
    found = {}
    for key, rx in LOG_FIGURES.items():
        m = re.search(rx, text)
        found[key] = float(m.group(1)) if m else None
    for key, rx in LOG_LISTS.items():
        found[key] = list(dict.fromkeys(m.group(1) for m in re.finditer(rx, text)))
    return found


def last_error(log_path: Path) -> str:
    try:
        lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    errs = [x for x in lines if re.search(r"\b\w*(Error|Exception)\b", x) and not x.startswith(("INFO", "DEBUG"))]
    return (errs[-1] if errs else lines[-1] if lines else "(empty log)")[:400]


# --- child steps ----------------------------------------------------------------------------------------------------
def build(spec: dict) -> None:
    """The shape's random bf16 checkpoint: transformers' model on the GPU, N(0, 0.02) weights, 1-D ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[spec["shape"]]
    cfg = AutoConfig.for_model(shape["model_type"], **shape["config"])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=gen, device="cuda",
                                                                        dtype=p.dtype) * 0.02)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(spec["dst"], max_shard_size="4GB")


def convert(spec: dict) -> None:
    import expq

    expq.convert(spec["src"], spec["dst"], format=spec["format"], device="cuda", overwrite=True, fsync=False)


def serve(spec: dict) -> None:
    """One engine: load, warm up, the timed runs, the MoE configs, then the profile; the result JSON is rewritten
    after each step."""
    if spec["kernel"]:
        os.environ["EXPQ_VLLM_KERNEL"] = spec["kernel"]
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    import vllm
    from vllm import LLM

    res = {"versions": {"vllm": vllm.__version__, "torch": torch.__version__, "triton": _triton_version()},
           "kernel_env": spec["kernel"], "runs": {}}
    save = lambda: Path(spec["result"]).write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    kw = {"quantization": spec["quantization"]} if spec["quantization"] else {}
    if spec["profile"]:
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": spec["trace_dir"],
                                 "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                                 "torch_profiler_dump_cuda_time_total": False}
    if _engine_arg("jit_monitor_verbose"):  # every Triton compile after vLLM's warm-up, logged (jit_compiles)
        kw["jit_monitor_verbose"] = True
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=GPU_UTIL,
              max_model_len=MAX_MODEL_LEN, seed=0, **kw)
    res["load_s"] = round(time.perf_counter() - t0, 2)
    save()
    shape = SHAPES[spec["shape"]]
    vocab = shape["config"]["vocab_size"]
    for w in spec["workloads"]:  # warm-up: every workload's batch shapes, few output tokens
        n, p_len, _, _ = WORKLOADS[w]
        generate(llm, prompts(n, p_len, vocab, seed=999), min(8, WORKLOADS[w][2]))
    for r in range(spec["runs"]):
        for w in spec["workloads"]:
            n, p_len, o_len, _ = WORKLOADS[w]
            print(f"{RUN_MARK} start {w} {r}", file=sys.stderr, flush=True)
            secs = generate(llm, prompts(n, p_len, vocab, seed=1000 * r + list(WORKLOADS).index(w)), o_len)
            print(f"{RUN_MARK} end {w} {r}", file=sys.stderr, flush=True)
            res["runs"].setdefault(w, []).append(round(n * (o_len if o_len > 1 else p_len) / secs, 1))
            save()
    res["moe_configs"] = moe_configs(shape, spec)
    save()
    if spec["profile"]:
        res["profile"] = {}
        for k, n in enumerate(spec.get("profile_requests") or [16]):
            res["profile"][str(n)] = profile_decode(llm, vocab, spec["profile_steps"], Path(spec["trace_dir"]), n,
                                                    profile_prompt_len(n), seed=1_000_000 + 100 * k)
            save()
    res["done"] = True
    save()


RUN_MARK = "[serve-run]"
JIT_LINE = "JIT compilation during inference"


def _engine_arg(name: str) -> bool:
    try:
        from vllm.engine.arg_utils import EngineArgs

        return name in EngineArgs.__dataclass_fields__
    except (ImportError, AttributeError):
        return False


def jit_compiles(text: str) -> dict:
    """{workload: [Triton compiles logged inside each timed run]} from a serve's log: vLLM's jit_monitor lines
    (``jit_monitor_verbose``: one per compile) between the run's start and end marks. A compile inside a timed run
    is a latency spike in that run's figure."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith(RUN_MARK):
            _, what, w, _r = line.split()
            current = w if what == "start" else None
            if what == "start":
                found.setdefault(w, []).append(0)
        elif current is not None and JIT_LINE in line:
            found[current][-1] += 1
    return found


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def prompts(n: int, length: int, vocab: int, seed: int):
    """``n`` prompts of ``length`` random token ids (a new seed gives new prompts: no prefix-cache hits)."""
    import torch
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab - 100, (n, length), generator=g).tolist()
    return [TokensPrompt(prompt_token_ids=x) for x in ids]


def generate(llm, batch, max_tokens: int) -> float:
    """Wall seconds of one greedy ``generate`` of ``batch`` to exactly ``max_tokens`` tokens each."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outs):
        raise RuntimeError(f"a request did not generate {max_tokens} tokens")
    return secs


def moe_configs(shape: dict, spec: dict) -> dict:
    """The Triton MoE config per batch size (tokens per step) of this path, from the code that picks it: vLLM's
    ``try_get_optimal_moe_config`` (and the tuned file name it looks for) for bf16 and the int8 paths on vLLM's
    kernel, expq's ``get_config`` for expq's kernel; Marlin has no such config."""
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["top_k"]
    path = spec["path"]
    try:
        if path == "int8-expq":
            import torch

            from expq.kernels.moe import get_config

            return {"picker": "expq.kernels.moe.get_config",
                    "by_batch": {m: get_config(m, E, k, "cuda", hidden_size=H, intermediate_size=I,
                                               dtype=torch.bfloat16) for m in MOE_BATCHES}}
        if path == "ct-marlin":
            return {"picker": "Marlin (no Triton config)"}
        from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name, try_get_optimal_moe_config

        dtype = None if path == "bf16" else "int8_w8a16"
        return {"picker": "vllm try_get_optimal_moe_config", "dtype": dtype,
                "file": get_config_file_name(E, I, dtype),
                "by_batch": {m: try_get_optimal_moe_config((E, 2 * I, H), (E, H, I), k, dtype, m)
                             for m in MOE_BATCHES}}
    except Exception as e:  # noqa: BLE001 - report, do not fail the serve
        return {"error": f"{type(e).__name__}: {e}"}


# --- --profile: one decode step at each --profile-requests count --------------------------------------------------
KERNEL_KINDS = (  # (kind, regex on the kernel name), first match wins
    ("moe_gemm", r"fused_moe_kernel|fused_moe_w8a16|[Mm]arlin|moe_wna16|grouped_gemm"),
    ("moe_sort", r"moe_align|count_and_sort|sort_tokens|moe_align_count"),
    ("moe_sum_act", r"moe_sum|act_and_mul|silu_and_mul|swiglu|gelu_and_mul|topk_weight|reduce_kernel"),
    ("router_topk", r"topk|softmax|gating"),
    ("attention", r"flash|attn|attention|fmha|mla|paged"),
    ("dense_gemm", r"gemm|cutlass|nvjet|sm90_xmma|ampere|cublas|wgmma|matmul"),
)
API_KINDS = (  # host API calls per step
    ("graph_launches", r"^cu(da)?GraphLaunch"),
    ("kernel_launches", r"^cu(da)?LaunchKernel|^cuLaunchKernelEx|^cudaLaunchKernelExC"),
    ("syncs", r"Synchronize"),
    ("copies", r"^cu(da)?Memcpy"),
    ("mallocs_frees", r"^cu(da)?(Malloc|Free|MemAlloc|MemFree)"),
)


def profile_prompt_len(requests: int) -> int:
    """The prompt tokens of the decode workload in ``WORKLOADS`` with this many requests (the prefill workload, of
    one output token, is not one), else 512."""
    return next((p_len for n, p_len, o_len, _ in WORKLOADS.values() if n == requests and o_len > 1), 512)


def profile_decode(llm, vocab: int, steps: int, trace_dir: Path, requests: int = 16, prompt_len: int = 512,
                   seed: int = 5000) -> dict:
    """One decode step at ``requests`` requests of ``prompt_len`` prompt tokens: (generate to 1 + steps tokens) minus
    (to 1 token), over ``steps``; wall time without the profiler, GPU activity and host calls from vLLM's torch
    profiler traces. A warm-up generate of this batch first (its shapes may be new to the engine); every generate
    gets new prompts (seed, seed + 1, ...: no prefix-cache hits)."""
    generate(llm, prompts(requests, prompt_len, vocab, seed=seed), 8)
    walls, traces = {}, {}
    for i, n in enumerate((1, 1 + steps)):
        walls[n] = generate(llm, prompts(requests, prompt_len, vocab, seed=seed + 1 + i), n)
    for i, n in enumerate((1, 1 + steps)):
        trace_dir.mkdir(parents=True, exist_ok=True)
        before = set(trace_dir.iterdir())
        llm.start_profile()
        generate(llm, prompts(requests, prompt_len, vocab, seed=seed + 3 + i), n)
        llm.stop_profile()
        new = sorted(f for f in set(trace_dir.iterdir()) - before if f.name.endswith((".json", ".json.gz")))
        if not new:
            return {"requests": requests, "prompt_len": prompt_len,
                    "error": f"the profiler wrote no trace under {trace_dir}"}
        traces[n] = trace_totals(new)
        for f in new:
            f.unlink()
    return {"requests": requests, "prompt_len": prompt_len,
            **decode_step(walls[1], walls[1 + steps], traces[1], traces[1 + steps], steps)}


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")
"""The Chrome-trace categories of work on the GPU: its busy time is the union of their intervals."""


def union_ns(intervals) -> list[tuple[int, int]]:
    """The union of [start, end] intervals, as sorted disjoint pieces (touching ones joined)."""
    pieces: list[list[int]] = []
    for start, end in sorted(intervals):
        if pieces and start <= pieces[-1][1]:
            pieces[-1][1] = max(pieces[-1][1], end)
        else:
            pieces.append([start, end])
    return [(a, b) for a, b in pieces]


def trace_totals(files) -> dict:
    """Totals over torch profiler (Chrome trace) files: per kernel name [count, total us]; per host API name count;
    and the GPU's activity (kernels, memcpys, memsets: ``GPU_ACTIVITY``) over all files and streams together: the
    number of events, ``busy_us`` the length of the union of their [ts, ts + dur] intervals, ``kernel_busy_us`` that
    of the kernels' alone, ``busy_intervals`` the union's pieces and ``longest_gap_us`` the longest time between two
    consecutive pieces. Times are taken in integer ns, each file's ts (us) shifted by its ``baseTimeNanoseconds``
    (the files of two processes have different bases)."""
    import gzip

    kernels: dict[str, list] = {}
    api: dict[str, int] = {}
    activity: list[tuple[int, int]] = []
    kernel_spans: list[tuple[int, int]] = []
    for f in files:
        raw = gzip.open(f, "rt") if str(f).endswith(".gz") else open(f)
        with raw as fh:
            trace = json.load(fh)
        base_ns = int(trace.get("baseTimeNanoseconds", 0) or 0)
        for ev in trace.get("traceEvents", []):
            cat = ev.get("cat", "")
            if cat in GPU_ACTIVITY:
                start = base_ns + round(float(ev.get("ts", 0)) * 1000)
                span = (start, start + round(float(ev.get("dur", 0)) * 1000))
                activity.append(span)
                if cat == "kernel":
                    kernel_spans.append(span)
            if cat == "kernel":
                k = kernels.setdefault(ev.get("name", "?"), [0, 0.0])
                k[0] += 1
                k[1] += float(ev.get("dur", 0))
            elif cat in ("cuda_runtime", "cuda_driver"):
                api[ev.get("name", "?")] = api.get(ev.get("name", "?"), 0) + 1
    busy = union_ns(activity)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    return {"kernels": kernels, "api": api, "gpu_events": len(activity),
            "busy_us": sum(b - a for a, b in busy) / 1e3,
            "kernel_busy_us": sum(b - a for a, b in union_ns(kernel_spans)) / 1e3,
            "busy_intervals": len(busy), "longest_gap_us": max(gaps, default=0) / 1e3}


def kind_of(name: str, table) -> str:
    return next((kind for kind, rx in table if re.search(rx, name)), "other")


def decode_step(wall_a: float, wall_b: float, a: dict, b: dict, steps: int, top: int = 10) -> dict:
    """Per decode step: the difference of two runs (``b`` has ``steps`` more decode steps than ``a``) / steps.
    ``gpu_ms`` the kernel sum (durations added up, over-counting kernels that run at once), ``busy_ms`` the GPU's busy
    time (the union of its activity intervals), ``idle_ms`` = wall - busy, ``overlap_ms`` = kernel sum - the union of
    the kernels' intervals (the time kernels ran at once), ``busy_intervals_per_step``; ``longest_gap_us_b`` is the
    longest gap between busy intervals in ``b``'s whole trace, not per step."""
    names = set(a["kernels"]) | set(b["kernels"])
    per = {}
    for n in names:
        ca, ta = a["kernels"].get(n, [0, 0.0])
        cb, tb = b["kernels"].get(n, [0, 0.0])
        per[n] = ((cb - ca) / steps, (tb - ta) / steps)
    gpu_us = sum(t for _, t in per.values())
    kinds: dict[str, float] = {}
    for n, (_, t) in per.items():
        kinds[kind_of(n, KERNEL_KINDS)] = kinds.get(kind_of(n, KERNEL_KINDS), 0.0) + t
    api: dict[str, float] = {}
    for n in set(a["api"]) | set(b["api"]):
        k = kind_of(n, API_KINDS)
        api[k] = api.get(k, 0.0) + (b["api"].get(n, 0) - a["api"].get(n, 0)) / steps
    wall_ms = (wall_b - wall_a) / steps * 1e3
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    busy_ms = (b["busy_us"] - a["busy_us"]) / steps / 1e3
    kernel_busy_ms = (b["kernel_busy_us"] - a["kernel_busy_us"]) / steps / 1e3
    return {"steps": steps, "wall_ms": round(wall_ms, 3), "busy_ms": round(busy_ms, 3),
            "idle_ms": round(wall_ms - busy_ms, 3), "gpu_ms": round(gpu_us / 1e3, 3),
            "overlap_ms": round(gpu_us / 1e3 - kernel_busy_ms, 3),
            "busy_intervals_per_step": round((b["busy_intervals"] - a["busy_intervals"]) / steps, 2),
            "longest_gap_us_b": round(b["longest_gap_us"], 1), "kinds_us": {k: round(v, 1) for k, v in kinds.items()},
            "api_per_step": {k: round(v, 2) for k, v in api.items()},
            "top": [{"name": n, "calls": round(c, 2), "us": round(t, 1)} for n, (c, t) in ranked]}


# --- the report -------------------------------------------------------------------------------------------------------
def write_report(out: Path, state: dict) -> None:
    (out / "serve.json").write_text(json.dumps(state, indent=1, default=str))
    (out / "serve.md").write_text(markdown(state))


def fmt_runs(values) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:,.0f}" if len(values) == 1 else f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def median(res: dict, w: str):
    v = (res.get("runs") or {}).get(w)
    return statistics.median(v) if v else None


def markdown(state: dict) -> str:
    m = state.get("machine", {})
    lines = ["# bench/serve.py", "", f"Machine: {m.get('gpu')}, {m.get('cpus')} CPUs; " + versions(state) + ".",
             f"Arguments: {state.get('args')}.", ""]
    for shape, results in state.get("results", {}).items():
        lines += shape_table(shape, results) + targets(results) + configs_table(results) + profile_table(results)
    return "\n".join(lines) + "\n"


def versions(state: dict) -> str:
    for results in state.get("results", {}).values():
        for res in results.values():
            if isinstance(res, dict) and res.get("versions"):
                return ", ".join(f"{k} {v}" for k, v in res["versions"].items())
    return "versions unknown"


def shape_table(shape: str, results: dict) -> list[str]:
    ws = [w for w in WORKLOADS if any((r.get("runs") or {}).get(w) for r in results.values() if isinstance(r, dict))]
    head = [SHAPES[shape]["title"]] + [WORKLOADS[w][3] for w in ws] + ["`LLM()` load s", "weights GiB",
                                                                       "Triton compiles in timed runs", "status"]
    lines = [f"## {SHAPES[shape]['title']}", "", "Output tokens/s (prefill: prompt tokens/s); median of the runs, "
             "min-max in brackets.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in PATHS:
        res = results.get(p)
        if not isinstance(res, dict):
            continue
        cells = [PATHS[p][3]] + [fmt_runs((res.get("runs") or {}).get(w)) for w in ws]
        jit = res.get("jit_compiles") or {}
        cells += [str(res.get("load_s", "-")), str(res.get("model_gib", "-")),
                  ", ".join(f"{w}: {'/'.join(map(str, jit[w]))}" for w in ws if w in jit) or "-",
                  res.get("status", "?") + (f": {res['error']}" if res.get("error") else "")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines + [""]


def targets(results: dict) -> list[str]:
    """expq's kernel per workload against the best other path, and against vLLM's kernel (the default's switch)."""
    mine = results.get("int8-expq")
    if not isinstance(mine, dict) or not mine.get("runs"):
        return []
    lines = ["| workload | int8-expq | best other (path) | int8-expq / best | int8-expq / int8-vllm |",
             "|---|---|---|---|---|"]
    for w in WORKLOADS:
        v = median(mine, w)
        if v is None:
            continue
        others = {p: median(r, w) for p, r in results.items() if p in PATHS and p != "int8-expq"
                  and isinstance(r, dict)}
        others = {p: x for p, x in others.items() if x}
        best = max(others, key=others.get) if others else None
        vv = others.get("int8-vllm")
        lines.append(f"| {WORKLOADS[w][3]} | {v:,.0f} | " + (f"{others[best]:,.0f} ({best}) | {v / others[best]:.2f}x"
                                                          if best else "- | -")
                     + f" | {f'{v / vv:.2f}x' if vv else '-'} |")
    return lines + [""]


def configs_table(results: dict) -> list[str]:
    lines = []
    for p, res in results.items():
        mc = res.get("moe_configs") if isinstance(res, dict) else None
        if not mc:
            continue
        cfg = mc.get("by_batch") or {}
        desc = "; ".join(f"{b}: " + "x".join(str(c.get(k)) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
                         + f" G{c.get('GROUP_SIZE_M')} w{c.get('num_warps')} s{c.get('num_stages')}"
                         for b, c in cfg.items())
        looked = res.get("moe_config_files") or res.get("moe_config_missing")
        lines.append(f"- {p}: {mc.get('picker')} {mc.get('file') or ''} {mc.get('error') or ''} {desc}".rstrip()
                     + (f"; vLLM's log: {'used' if res.get('moe_config_files') else 'not found'} {looked}"
                        if looked else ""))
    return (["MoE config per batch size (tokens per step): M x N x K tiles, group, warps, stages", ""] + lines + [""]
            if lines else [])


def profiles(res: dict) -> dict[str, dict]:
    """A serve's decode-step profiles by request count ({"16": {...}}). An older serve.json holds one profile dict
    (``steps``, ``wall_ms``, ... or ``error``), always taken at 16 requests: it is returned as the one at "16"."""
    pr = res.get("profile")
    if not isinstance(pr, dict):
        return {}
    if any(k in pr for k in ("steps", "wall_ms", "error")):
        return {"16": pr}
    return {k: v for k, v in sorted(pr.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
            if isinstance(v, dict)}


def profile_table(results: dict) -> list[str]:
    rows = [(p, n, pr) for p, r in results.items() if isinstance(r, dict) for n, pr in profiles(r).items()]
    if not rows:
        return []
    kinds = [k for k, _ in KERNEL_KINDS] + ["other"]
    apis = [k for k, _ in API_KINDS]
    head = (["path", "requests", "wall ms", "GPU busy ms", "GPU idle ms", "kernel sum ms"] + [f"{k} us" for k in kinds]
            + [f"{k}/step" for k in apis])
    lines = ["One decode step per request count, from the profile (`--profile`): GPU busy = the union of the "
             "kernel/memcpy/memset intervals, GPU idle = wall - busy, kernel sum = the kernels' durations added up "
             "(above busy when kernels overlap); a profile from before busy time was measured has none (-)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, n, pr in rows:
        req = f"{n} ({pr['prompt_len']} in)" if "prompt_len" in pr else n
        if "error" in pr:
            lines.append(f"| {p} | {req} | {pr['error']} |")
            continue
        busy = "busy_ms" in pr  # an older profile's idle_ms is wall - kernel sum: not shown as the GPU's idle
        cells = [p, req, pr.get("wall_ms", "-"), pr["busy_ms"] if busy else "-", pr["idle_ms"] if busy else "-",
                 pr.get("gpu_ms", "-")]
        cells += [(pr.get("kinds_us") or {}).get(k, 0) for k in kinds]
        cells += [(pr.get("api_per_step") or {}).get(k, 0) for k in apis]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for p, n, pr in rows:
        if "top" in pr:
            lines += ["", f"{p}, {n} request{'' if n == '1' else 's'}: top kernels per decode step (calls, us)", ""]
            lines += [f"- {t['us']} us, {t['calls']} calls: `{t['name'][:110]}`" for t in pr["top"]]
    return lines + [""]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("_build", "_convert", "_serve"):
        sys.path.insert(0, str(REPO))
        {"_build": build, "_convert": convert, "_serve": serve}[sys.argv[1]](json.loads(sys.argv[2]))
    else:
        sys.exit(main())

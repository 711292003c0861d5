"""Real vLLM 0.24 on one GPU: does expq's converted checkpoint compute what vLLM's own online experts_int8 computes?

One invocation (about 9 minutes at most, ``--budget``), per family:

  1. fixture  ``expq.examples.build_example(family, DIR/family/src, preset="serve", init_std=0.02)``: hidden 256,
              8 experts, top-2 (Llama-4 top-1), 4 layers, bf16, max_position_embeddings 1024, weights N(0, 0.02),
              lm_head N(0, 0.2) (see ``SERVE_FAMILIES`` in expq/examples.py for each family's settings and why);
  2. convert  ``python -m expq.cli convert SRC OUT --format FORMAT`` (``--format``, default experts-int8);
  3. serve    each in its own process (vLLM does not free the GPU within one), up to ``--parallel`` at once with
              ``gpu_memory_utilization`` 0.28; none creates its engine or ends while another is in vLLM's
              memory profiling (a neighbour's memory change there fails it; vLLM's imports overlap freely): online ``LLM(SRC, quantization="experts_int8")``, converted
              ``LLM(OUT)`` (its quantization_config picks the method: expq's plugin for experts-int8, vLLM's
              compressed-tensors otherwise; ``EXPQ_VLLM_KERNEL=vllm``), ``expq`` = the same with
              ``EXPQ_VLLM_KERNEL=expq`` (expq's kernel in the plugin), ``marlin`` = ``LLM`` of a compressed-tensors
              conversion of the same source (vLLM's Marlin on the same int8 codes: how far two of vLLM's own
              kernels are apart), and unquantized ``LLM(SRC)`` (``--runs``). Each: enforce_eager (``--graphs``:
              CUDA graphs and torch.compile, vLLM's defaults),
              skip_tokenizer_init, max_model_len 512, ``--prompts`` fixed 32-token prompts of token ids (8;
              prompt 0 is serve_check.py's) in one generate, prompt_logprobs=1, greedy decoding of ``--tokens``
              tokens (ignore_eos) with logprobs=1;
  4. compare  the converted and unquantized runs against online experts_int8.

Figures (RESULTS/vllm_compare.json, RESULTS/vllm_compare.md; logs per serve under RESULTS/logs/):
  max |Δ prompt lp|   max over prompt positions 1..31 of |log p(prompt token)| difference vs online, over every
                      prompt (in brackets: the median over the prompts of each prompt's maximum);
  max |Δ gen lp|      max over the generated positions before the first differing token (the common prefix) of
                      |Δ log p(sampled token)|, over every prompt (the median likewise);
  greedy equal        on how many prompts all generated token ids are identical; first div: the earliest index of
                      a differing generated token;
  expq vs Marlin      (when both ran) issue 26's bound: expq's kernel and Marlin each against online on the same
                      positions (the generated ones: those both share with online), max and median over the
                      prompts, and on how many prompts expq's distance is at most Marlin's;
  load s              wall seconds from ``LLM(...)`` called to returned (includes engine start, profiling, KV alloc);
  weights s / GiB     vLLM's own log lines "Loading weights took S seconds" and "Model loading took X GiB memory";
  load peak GiB       vLLM's debug line "Peak GPU memory after loading weights: X GiB" (torch max_memory_allocated in
                      the engine process right after loading, before post-processing; the online-quantization peak);
  torch peak GiB      "torch peak memory increase" of vLLM's memory profiling (a dummy forward's activations);
  error               for a serve that failed: its first error line and the last exception line of its log.
torch.cuda.max_memory_allocated of this process would see nothing (vLLM's engine runs in a child process) and
nvidia-smi cannot attribute memory between concurrent serves: the memory figures are vLLM's own log lines
(VLLM_LOGGING_LEVEL=DEBUG is set for each serve).

On the device (checkout as cwd; vLLM and its dependencies, typer and rich, in /tmp/site; nothing big is carried: the
fixtures are built there):

  export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
  python bench/vllm_compare.py $OUT/vc                                # every family, experts-int8
  python bench/vllm_compare.py $OUT/vc --format compressed-tensors --families mixtral,qwen3_moe
  python bench/vllm_compare.py $OUT/vc --families gpt_oss,dbrx,phimoe --runs online,bf16 --parallel 3
  python bench/vllm_compare.py $OUT/vc --runs online,converted,expq,marlin --graphs   # expq's kernel vs vLLM's

Here (CPU, no vLLM): ``--dry-run`` stops after steps 1-2 (``--format compressed-tensors`` until experts-int8 lands).
Other options: ``--skip-convert`` (reuse DIR/family/out), ``--serve-timeout`` (seconds per serve), ``--set
family.key=json`` (override one fixture config field, e.g. ``--set deepseek_v3.kv_lora_rank=512``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT_LEN, MAX_MODEL_LEN = 32, 512
GPU_UTIL = float(os.environ.get("EXPQ_VC_GPU_UTIL", "0.28"))  # per serve; raise it for a serve that runs alone
RUNS = {"online": "experts_int8", "converted": None, "expq": None, "marlin": None, "bf16": None}  # -> --quantization
RUN_KERNEL = {"converted": "vllm", "expq": "expq"}  # run name -> EXPQ_VLLM_KERNEL
EAGER = os.environ.get("EXPQ_VC_EAGER", "1") != "0"  # --graphs sets 0 for the serves


def prompt_ids(vocab: int, index: int = 0) -> list[int]:
    """Fixed prompt number ``index`` of ``PROMPT_LEN`` token ids below ``vocab`` (prompt 0: serve_check.py's
    formula; the others change its step and offset, so that every prompt is a different sequence)."""
    return [((7919 + 6 * index) * i + 13 + 101 * index) % vocab for i in range(1, PROMPT_LEN + 1)]


# --- step 0: which families -----------------------------------------------------------------------------------------
def default_families() -> list[str]:
    """expq.examples.FAMILIES, then, for each other layout file, its first model type transformers instantiates
    (a ``*_text`` one first: the composite multimodal configs ignore top-level sizes and build full-size models)."""
    from transformers import AutoConfig

    from expq.examples import FAMILIES
    from expq.layouts import builtin_layouts

    out = list(FAMILIES)
    for layout in builtin_layouts():
        if any(mt in out for mt in layout.model_types):
            continue
        for mt in sorted(layout.model_types, key=lambda m: not m.endswith("_text")):
            try:
                AutoConfig.for_model(mt)
            except Exception:  # noqa: BLE001 - transformers does not know this model type
                continue
            out.append(mt)
            break
    return out


# --- steps 1-2: fixture and conversion (in worker processes, CPU) ------------------------------------------------------
def prepare(family: str, work: str, fmt: str, skip_convert: bool, sets: dict, ct: bool = False) -> dict:
    """Build DIR/family/src, convert it to DIR/family/out (``ct``: also to DIR/family/out-ct in compressed-tensors);
    return what happened (errors as text, never raised)."""
    import torch

    torch.set_num_threads(2)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # expq from this checkout when run as a script
    from expq.examples import build_example

    d = Path(work) / family
    src, out = d / "src", d / "out"
    rec: dict = {"family": family, "src": str(src), "out": str(out), "out_ct": str(d / "out-ct")}
    t = time.perf_counter()
    try:
        if not (src / "config.json").exists():
            build_example(family, src, preset="serve", init_std=0.02, max_shard_size="50MB", **sets)
        rec["config"] = json.loads((src / "config.json").read_text())
        rec["build_s"] = round(time.perf_counter() - t, 2)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"fixture: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return rec
    for dst, f in [(out, fmt)] + ([(d / "out-ct", "compressed-tensors")] if ct else []):
        if skip_convert and (dst / "config.json").exists():
            continue
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "expq.cli", "convert", str(src), str(dst), "--format", f,
                            "--allow-random-experts-in-transformers",  # vLLM is measured here, never stock transformers
                            "--overwrite"], capture_output=True, text=True)
        rec.setdefault("convert_s", round(time.perf_counter() - t, 2))
        if p.returncode != 0:
            rec.setdefault("convert_error", f"{f}: " + (error_lines(p.stdout + p.stderr) or f"exit {p.returncode}"))
    return rec


# --- step 3: one serve (this file re-invoked as `_serve` in its own process) ----------------------------------------
def serve_one(model: str, out: str, quantization: str | None, tokens: int, prompts: int = 1) -> None:
    """One serve: ``prompts`` fixed prompts in one ``generate``; writes OUT (JSON: per prompt its ids, the prompt
    tokens' log-probabilities, the generated ids and their log-probabilities). Files the scheduler creates (each
    waited for at most 300 s; unset: no wait): EXPQ_VC_GO, after vLLM's import and before the engine, and
    EXPQ_VC_HOLD, after the results, before the process frees its GPU memory (see ``serve_all``)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wait_for_file(os.environ.get("EXPQ_VC_GO"))  # the scheduler's turn to create the engine (see serve_all)
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size", 1000)
    ids = [prompt_ids(vocab, i) for i in range(prompts)]
    kw = {"quantization": quantization} if quantization else {}
    t1 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=EAGER, gpu_memory_utilization=GPU_UTIL,
              max_model_len=MAX_MODEL_LEN, seed=0, **kw)
    t2 = time.perf_counter()
    params = SamplingParams(max_tokens=tokens, temperature=0, prompt_logprobs=1, logprobs=1, ignore_eos=True,
                            detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params)
    t3 = time.perf_counter()
    per_prompt = []
    for prompt, res in zip(ids, results):
        gen = res.outputs[0]
        per_prompt.append({
            "prompt": prompt,
            "prompt_logprobs": [d[t].logprob for d, t in zip(res.prompt_logprobs[1:], prompt[1:])],
            "tokens": list(gen.token_ids),
            "token_logprobs": [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)]})
    Path(out).write_text(json.dumps({
        "model": model, "quantization": quantization, "prompts": per_prompt,
        "import_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2), "generate_s": round(t3 - t2, 2)}))
    print("ran", model, quantization or "", len(ids), "prompts", tokens, "tokens each", flush=True)
    wait_for_file(os.environ.get("EXPQ_VC_HOLD"))  # keep the GPU memory until no neighbour is profiling


def wait_for_file(path: str | None, limit_s: float = 300) -> None:
    """Wait until PATH exists (at most ``limit_s`` seconds; at once when PATH is None: run by hand)."""
    deadline = time.monotonic() + limit_s
    while path and not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


LOG_FIGURES = {  # figure -> regex on vLLM's log (first match)
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_gib": r"Model loading took ([\d.]+) ?GiB memory",
    "load_peak_gib": r"Peak GPU memory after loading weights: ([\d.]+) ?GiB",
    "torch_peak_gib": r"torch peak memory increase: ([\d.]+) ?GiB",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) ?GiB",
}


def error_lines(log: str) -> str:
    """The first error line and the last exception line of a log ('' when neither is there)."""
    # vLLM's engine process prefixes its lines with "(EngineCore pid=N) "; DEBUG/INFO/WARNING lines are not errors
    lines = [re.sub(r"^\(EngineCore[^)]*\)\s*", "", x.strip()) for x in log.splitlines() if x.strip()]
    lines = [x for x in lines if not re.match(r"^(DEBUG|INFO|WARNING)\b", x)]
    first = next((x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b", x)), "")
    last = next((x for x in reversed(lines) if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", x)
                 and "Engine core initialization failed" not in x), "")
    if not first and not last:
        return lines[-1] if lines else ""
    return first if not last or last == first else f"{first} ... {last}"


# --- step 3: the scheduler: up to --parallel serves at once, each under a timeout, all under the budget -------------
PROFILED = "Available KV cache memory"  # vLLM's line once its memory profiling is over


def in_memory_profiling(job: dict) -> bool:
    """Whether a serve may be in vLLM's memory profiling: allowed to create its engine (``go``), still running, and
    its log does not yet show the line that ends the profiling. vLLM reads the GPU's free memory when its worker
    starts and again after the profile run; a neighbour that allocates or frees memory in between makes the serve
    fail ("Error in memory profiling", "No available memory for the cache blocks"), which is how two serves of three
    failed in past sessions."""
    if not job.get("go") or job["proc"].poll() is not None:
        return False
    return PROFILED not in Path(job["log"]).read_text(errors="replace")


def serve_all(jobs: list[dict], results: Path, parallel: int, timeout: float, deadline: float, tokens: int,
              prompts: int = 1) -> None:
    """Run the serves, up to ``parallel`` processes at once, so that no serve's memory profiling sees a neighbour's
    memory change: each imports vLLM at once, then waits (EXPQ_VC_GO) to create its engine until no other one is
    profiling or ending; one that is done keeps its memory (EXPQ_VC_HOLD) until none is profiling. Each serve runs
    under ``timeout`` seconds and all before ``deadline`` (time.monotonic())."""
    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG", VLLM_USE_FLASHINFER_SAMPLER="0")
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            if time.monotonic() + 60 > deadline:  # no time for a start: say so rather than overrun
                job["status"] = "skipped: budget"
                continue
            stem = results / "runs" / f"{job['family']}-{job['run']}"
            job["json"], job["log"] = f"{stem}.json", str(logs / f"{job['family']}-{job['run']}.log")
            job["go_file"], job["hold_file"] = f"{stem}.go", f"{stem}.release"
            stem.parent.mkdir(exist_ok=True)
            for f in (job["json"], job["go_file"], job["hold_file"]):
                Path(f).unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "_serve", job["model"], job["json"], "--tokens", str(tokens),
                   "--prompts", str(prompts)]
            if job["quantization"]:
                cmd += ["--quantization", job["quantization"]]
            fh = open(job["log"], "w")  # noqa: SIM115 - closed when the process ends
            serve_env = dict(env, EXPQ_VC_GO=job["go_file"], EXPQ_VC_HOLD=job["hold_file"], **job.get("env", {}))
            job["proc"] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=serve_env,
                                           start_new_session=True)
            job["fh"], job["t0"] = fh, time.monotonic()
            running.append(job)
            print(f"start {job['family']} {job['run']}", flush=True)
        time.sleep(0.5)
        if not any(in_memory_profiling(j) for j in running):
            for job in running:  # done: it may free its memory now
                if not job.get("released") and Path(job["json"]).exists():
                    Path(job["hold_file"]).touch()
                    job["released"] = True
            if not any(j.get("released") and j["proc"].poll() is None for j in running):  # none is freeing memory
                job = next((j for j in running if not j.get("go") and j["proc"].poll() is None), None)
                if job:
                    Path(job["go_file"]).touch()
                    job["go"] = True
        for job in list(running):
            p, waited = job["proc"], time.monotonic() - job["t0"]
            if p.poll() is None and waited < timeout and time.monotonic() < deadline:
                continue
            if p.poll() is None:  # over its own timeout or the budget: end its process group (it started it)
                os.killpg(p.pid, 9)
                p.wait()
                job["status"] = f"timeout after {waited:.0f} s"
            job["fh"].close()
            running.remove(job)
            job["wall_s"] = round(waited, 1)
            log = Path(job["log"]).read_text(errors="replace")
            for k, rx in LOG_FIGURES.items():
                m = re.search(rx, log)
                job[k] = float(m.group(1)) if m else None
            if p.returncode == 0 and Path(job["json"]).exists():
                job["status"] = "ok"
                job["data"] = json.loads(Path(job["json"]).read_text())
            else:
                job.setdefault("status", f"failed (exit {p.returncode})")
                job["error"] = error_lines(log) or "(no error line; see the log)"
            print(f"done  {job['family']} {job['run']}: {job['status']} in {waited:.0f} s", flush=True)


# --- step 4: compare against online experts_int8 -----------------------------------------------------------------------
def prompt_records(data: dict) -> list[dict]:
    """A serve's per-prompt records (a result of one prompt, written before ``--prompts``, is one record)."""
    return data.get("prompts") or [data]


def compare_prompt(a: dict, b: dict) -> dict:
    """Serve B against serve A on one prompt: max |Δ log p| over the prompt positions 1..31, the first differing
    generated token and max |Δ log p| of the generated tokens before it (the common prefix)."""
    n = min(len(a["tokens"]), len(b["tokens"]))
    div = next((i for i in range(n) if a["tokens"][i] != b["tokens"][i]), None)
    common = n if div is None else div
    d_gen = [abs(x - y) for x, y in zip(a["token_logprobs"][:common], b["token_logprobs"][:common])]
    return {"d_prompt_lp": max(abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])),
            "d_gen_lp": d_gen, "first_divergence": div, "common_prefix": common,
            "greedy_equal": a["tokens"] == b["tokens"]}


def compare(base: dict, other: dict) -> dict:
    """Serve OTHER against BASE (online experts_int8) over every prompt: the maxima over all prompts, the median of
    the per-prompt maxima, and per prompt the figures of ``compare_prompt``. JSON-ready."""
    per = [compare_prompt(a, b) for a, b in zip(prompt_records(base["data"]), prompt_records(other["data"]))]
    gen_max = [max(p["d_gen_lp"], default=None) for p in per]
    known = sorted(g for g in gen_max if g is not None)
    return {"prompts": len(per), "max_d_prompt_lp": max(p["d_prompt_lp"] for p in per),
            "median_d_prompt_lp": statistics.median(p["d_prompt_lp"] for p in per),
            "max_d_gen_lp": known[-1] if known else None,
            "median_d_gen_lp": statistics.median(known) if known else None,
            "greedy_equal": all(p["greedy_equal"] for p in per),
            "first_divergence": min((p["first_divergence"] for p in per if p["first_divergence"] is not None),
                                    default=None),
            "prompts_equal": sum(p["greedy_equal"] for p in per),
            "generated": len(prompt_records(other["data"])[0]["tokens"]),
            "per_prompt": [dict(p, d_gen_lp=g) for p, g in zip(per, gen_max)]}


def side_by_side(base: dict, a: dict, b: dict) -> dict:
    """Issue 26's bound for one family: serves A (expq's kernel) and B (Marlin), each against BASE (online
    experts_int8), on the same positions. Per prompt: the prompt distance, and the generated distance over the
    tokens both A and B share with BASE (the shorter of the two common prefixes, so that neither is measured over
    more tokens than the other). Returns each run's maximum and median over the prompts, and on how many prompts A's
    distance is at most B's."""
    pa = [compare_prompt(x, y) for x, y in zip(prompt_records(base["data"]), prompt_records(a["data"]))]
    pb = [compare_prompt(x, y) for x, y in zip(prompt_records(base["data"]), prompt_records(b["data"]))]
    gen_a, gen_b = [], []
    for x, y in zip(pa, pb):
        k = min(x["common_prefix"], y["common_prefix"])
        gen_a.append(max(x["d_gen_lp"][:k], default=0.0))
        gen_b.append(max(y["d_gen_lp"][:k], default=0.0))
    prompt_a, prompt_b = [x["d_prompt_lp"] for x in pa], [y["d_prompt_lp"] for y in pb]
    return {"prompts": len(pa),
            "prompt_lp": {"a_max": max(prompt_a), "b_max": max(prompt_b), "a_median": statistics.median(prompt_a),
                          "b_median": statistics.median(prompt_b),
                          "a_within_b": sum(x <= y for x, y in zip(prompt_a, prompt_b))},
            "gen_lp_shared": {"a_max": max(gen_a), "b_max": max(gen_b), "a_median": statistics.median(gen_a),
                              "b_median": statistics.median(gen_b),
                              "a_within_b": sum(x <= y for x, y in zip(gen_a, gen_b)),
                              "tokens": [min(x["common_prefix"], y["common_prefix"]) for x, y in zip(pa, pb)]}}


def spread(r: dict, figure: str) -> str:
    """A distance column: the maximum over the prompts, and the median of the per-prompt maxima when there are
    several prompts."""
    top = fmt(r.get(f"max_{figure}"))
    return top if r.get("prompts", 1) == 1 or top == "-" else f"{top} ({fmt(r.get(f'median_{figure}'))})"


def fmt(v, spec=".4f") -> str:
    return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def report(families: list[dict], jobs: list[dict], results: Path, args) -> None:
    by = {(j["family"], j["run"]): j for j in jobs}
    summary = {"args": {k: v for k, v in vars(args).items()}, "families": {}}
    rows = ["| family | run | status | max \\|Δ prompt lp\\| | max \\|Δ gen lp\\| | greedy equal | first div | load s |"
            " weights s | model GiB | load peak GiB | torch peak GiB | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bound = ["| family | prompts | expq: max \\|Δ prompt lp\\| (median) | Marlin: the same | expq within Marlin |"
             " expq: max \\|Δ gen lp\\| on shared tokens (median) | Marlin: the same | expq within Marlin |",
             "|---|---|---|---|---|---|---|---|"]
    for fam in families:
        f = fam["family"]
        entry = {k: fam.get(k) for k in ("build_s", "convert_s", "error", "convert_error")}
        entry["runs"] = {}
        base = by.get((f, "online"))
        if fam.get("error") or fam.get("convert_error"):
            rows.append(f"| {f} | (prepare) | failed | | | | | | | | | | {fam.get('error') or fam.get('convert_error')} |")
        for run in args.runs:
            j = by.get((f, run))
            if j is None:
                continue
            r = {k: j.get(k) for k in ("status", "wall_s", "error", "log", *LOG_FIGURES)}
            r["load_s"] = j.get("data", {}).get("load_s")
            if run != "online" and base and base.get("status") == "ok" and j.get("status") == "ok":
                r.update(compare(base, j))
            if run == "online" and j.get("status") != "ok":
                r["note"] = "online experts_int8 cannot serve this fixture: " + (j.get("error") or j["status"])
            entry["runs"][run] = r
            rows.append(" | ".join([f"| {f}", run, r["status"], spread(r, "d_prompt_lp"), spread(r, "d_gen_lp"),
                                    fmt(r.get("greedy_equal")) if r.get("prompts", 1) == 1 else
                                    f"{r.get('prompts_equal')} of {r.get('prompts')}",
                                    fmt(r.get("first_divergence")), fmt(r.get("load_s"), ".1f"),
                                    fmt(r.get("weights_s"), ".2f"), fmt(r.get("model_gib"), ".3f"),
                                    fmt(r.get("load_peak_gib"), ".3f"), fmt(r.get("torch_peak_gib"), ".3f"),
                                    (r.get("error") or "").replace("|", "/")[:300]]) + " |")
        a, b = by.get((f, "expq")), by.get((f, "marlin"))
        if base and all(j and j.get("status") == "ok" for j in (base, a, b)):
            sbs = entry["expq_vs_marlin"] = side_by_side(base, a, b)
            bound.append(" | ".join([f"| {f}", str(sbs["prompts"])] + [
                f"{d['a_max']:.4f} ({d['a_median']:.4f}) | {d['b_max']:.4f} ({d['b_median']:.4f}) | "
                f"{d['a_within_b']} of {sbs['prompts']}" for d in (sbs["prompt_lp"], sbs["gen_lp_shared"])]) + " |")
        summary["families"][f] = entry
    results.mkdir(parents=True, exist_ok=True)
    (results / "vllm_compare.json").write_text(json.dumps(summary, indent=1, default=str))
    head = (f"vLLM comparison: format {args.format}, {args.tokens} greedy tokens after each of {args.prompts} "
            f"{PROMPT_LEN}-token prompts; Δ columns against online experts_int8 of the same source: the maximum over "
            f"the prompts (in brackets the median of the per-prompt maxima).\n\n")
    if len(bound) > 2:
        head_b = ("\n\nIssue 26's bound, expq's kernel against Marlin (each against online experts_int8, on the same "
                  "positions: the prompt, and the generated tokens both share with online; 'within': on how many "
                  "prompts expq's distance is at most Marlin's):\n\n")
        rows += [head_b.strip("\n"), ""] + bound
    (results / "vllm_compare.md").write_text(head + "\n".join(rows) + "\n")
    print(head + "\n".join(rows), flush=True)


# --- main -------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="results and fixtures go here (fixtures under DIR/fixtures)")
    ap.add_argument("--families", help="comma-separated model types (default: every family, see the docstring)")
    ap.add_argument("--format", default="experts-int8", help="expq convert --format (default experts-int8)")
    ap.add_argument("--runs", default="online,converted,bf16",
                    help="which serves, of online,converted,expq,marlin,bf16")
    ap.add_argument("--graphs", action="store_true", help="serve with CUDA graphs and torch.compile (not eager)")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens to generate (default 256)")
    ap.add_argument("--prompts", type=int, default=8, help="fixed prompts per serve, in one generate (default 8)")
    ap.add_argument("--parallel", type=int, default=3, help="serves at once (default 3)")
    ap.add_argument("--serve-timeout", type=float, default=240, help="seconds per serve (default 240)")
    ap.add_argument("--prepare-timeout", type=float, default=150, help="seconds per fixture + conversion")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole invocation (default 540)")
    ap.add_argument("--skip-convert", action="store_true", help="reuse DIR/fixtures/FAMILY/out where it exists")
    ap.add_argument("--dry-run", action="store_true", help="stop after fixtures and conversion (no vLLM)")
    ap.add_argument("--set", action="append", default=[], metavar="FAMILY.KEY=JSON", help="fixture config override")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget
    if args.graphs:
        os.environ["EXPQ_VC_EAGER"] = "0"  # read by each serve
    args.runs = [r for r in args.runs.split(",") if r]
    assert set(args.runs) <= set(RUNS), f"--runs takes {','.join(RUNS)}"
    assert args.tokens + PROMPT_LEN <= MAX_MODEL_LEN, f"--tokens at most {MAX_MODEL_LEN - PROMPT_LEN}"
    names = args.families.split(",") if args.families else default_families()
    sets: dict[str, dict] = {}
    for s in args.set:
        key, _, val = s.partition("=")
        fam, _, field = key.partition(".")
        sets.setdefault(fam, {})[field] = json.loads(val)

    # steps 1-2: fixtures and conversions, several families at once on the CPU, each in its own process (a family
    # whose transformers model crashes the interpreter, or hangs, costs only itself)
    work = args.dir / "fixtures"
    print(f"preparing {len(names)} families: {', '.join(names)}", flush=True)

    def prepare_in_child(name: str) -> dict:
        rec_file = work / name / "prepare.json"
        rec_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "_prepare", name, str(work), args.format, str(int(args.skip_convert)),
               str(int("marlin" in args.runs)),
               json.dumps(sets.get(name, {}))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.prepare_timeout)
        except subprocess.TimeoutExpired:
            return {"family": name, "error": f"fixture/convert: timeout after {args.prepare_timeout:.0f} s"}
        if rec_file.exists():
            return json.loads(rec_file.read_text())
        return {"family": name, "error": f"fixture: exit {p.returncode}: {error_lines(p.stdout + p.stderr)}"}

    with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        families = list(pool.map(prepare_in_child, names))
    for fam in families:
        print(f"  {fam['family']}: build {fam.get('build_s')} s, convert {fam.get('convert_s')} s"
              + (f"; {fam.get('error') or fam.get('convert_error')}" if fam.get("error") or fam.get("convert_error")
                 else ""), flush=True)
    if args.dry_run:
        report(families, [], args.dir, args)
        return

    # step 3: serves. Families whose architecture vLLM does not register are reported without a serve.
    from vllm.model_executor.models import ModelRegistry

    archs = set(ModelRegistry.get_supported_archs())
    jobs = []
    for run in args.runs:  # every online and converted serve before any bf16 one: the budget goes to those first
        for fam in families:
            if fam.get("error"):
                continue
            arch = (fam["config"].get("architectures") or ["?"])[0]
            job = {"family": fam["family"], "run": run, "quantization": RUNS[run],
                   "model": {"converted": fam["out"], "expq": fam["out"], "marlin": fam["out_ct"]}.get(run, fam["src"]),
                   "env": {"EXPQ_VLLM_KERNEL": RUN_KERNEL[run]} if run in RUN_KERNEL else {}}
            if arch not in archs:
                job.update(status="not served", error=f"vLLM {_vllm_version()} registers no {arch}")
            elif run in ("converted", "expq", "marlin") and fam.get("convert_error"):
                job.update(status="not served", error="conversion failed")
            jobs.append(job)
    serve_all([j for j in jobs if "status" not in j], args.dir, args.parallel, args.serve_timeout, deadline,
              args.tokens, args.prompts)

    # step 4: compare and write the JSON and the table
    for j in jobs:
        j.pop("proc", None), j.pop("fh", None)
    report(families, jobs, args.dir, args)


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_prepare":  # family work format skip_convert ct sets_json
        fam_, work_, fmt_, skip_, ct_, sets_ = sys.argv[2:8]
        rec_ = prepare(fam_, work_, fmt_, skip_ == "1", json.loads(sets_), ct_ == "1")
        (Path(work_) / fam_).mkdir(parents=True, exist_ok=True)
        (Path(work_) / fam_ / "prepare.json").write_text(json.dumps(rec_))
    elif len(sys.argv) > 1 and sys.argv[1] == "_serve":
        a = argparse.ArgumentParser()
        a.add_argument("model"), a.add_argument("out"), a.add_argument("--quantization")
        a.add_argument("--tokens", type=int), a.add_argument("--prompts", type=int, default=1)
        ns = a.parse_args(sys.argv[2:])
        serve_one(ns.model, ns.out, ns.quantization, ns.tokens, ns.prompts)
    else:
        main()

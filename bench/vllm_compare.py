"""Real vLLM on a GPU: serve expq-converted checkpoints and compare them with vLLM's own online experts_int8.

    python bench/vllm_compare.py build WORK                 # small real-format sources (hidden 256) + expq convert
    python bench/vllm_compare.py serve WORK RESULTS SERVE   # SERVE: path of serve_check.py; needs vLLM importable

For each family (mixtral, qwen3_moe, granitemoe: per-expert w1/w3/w2, per-expert gate/up/down, stacked), two or
three runs, each in its own process (vLLM does not free the GPU within one): the converted checkpoint (compressed-tensors,
served through vLLM's WNA16 MoE path), the bf16 source with ``--quantization experts_int8`` (vLLM quantizes at load:
the same codes and scales, by the scheme), and, for mixtral, the bf16 source unquantized. ``serve_check.py`` (the offline-vllm
tool) greedy-decodes 8 tokens after a fixed 32-token prompt and records the prompt log-probabilities; this script
collects max |delta logprob| and whether the greedy tokens agree into RESULTS/vllm_compare.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = {
    "mixtral": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, mlp_only_layers=[], decoder_sparse_step=1),
    "granitemoe": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
}


def build(work: Path) -> None:
    import torch

    import expq
    from expq.examples import build_example

    for fam, cfg in FAMILIES.items():
        src, out = work / f"{fam}-src", work / f"{fam}-int8"
        if not src.exists():
            build_example(fam, src, dtype=torch.bfloat16, max_shard_size="20MB", **cfg)
        t = time.perf_counter()
        r = expq.convert(src, out, overwrite=True, max_shard_size="20MB")
        v = expq.verify(out, source=src, tokens=64)
        print(f"{fam}: converted on {r.devices} in {time.perf_counter() - t:.1f} s; verify: {v.verdict}", flush=True)


def serve(work: Path, results: Path, serve_check: str) -> None:
    results.mkdir(parents=True, exist_ok=True)
    summary = {}
    for fam in FAMILIES:
        runs = {"converted": (work / f"{fam}-int8", None), "online_experts_int8": (work / f"{fam}-src", "experts_int8")}
        if fam == "mixtral":  # context: how far int8 itself moves the model
            runs["bf16"] = (work / f"{fam}-src", None)
        files = {}
        for name, (model, quant) in runs.items():
            f = results / f"{fam}-{name}.json"
            cmd = [sys.executable, serve_check, "run", str(model), str(f)] + (["--quantization", quant] if quant else [])
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            ok = p.returncode == 0 and f.exists()
            print(f"{fam} {name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t:.0f} s", flush=True)
            if not ok:
                tail = (p.stdout + p.stderr).strip().splitlines()[-12:]
                print("\n".join("    " + x for x in tail), flush=True)
                (results / f"{fam}-{name}.log").write_text(p.stdout[-20000:] + p.stderr[-20000:])
            files[name] = f if ok else None
        s = {}
        base = files.get("online_experts_int8")
        for other in ("converted", "bf16"):
            if base and files.get(other):
                a, b = json.loads(base.read_text()), json.loads(files[other].read_text())
                s[f"{other}_vs_online"] = {
                    "max_abs_dlogprob": max(abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])),
                    "greedy_equal": a["tokens"] == b["tokens"], "tokens": b["tokens"], "online_tokens": a["tokens"]}
        s["runs_ok"] = {k: v is not None for k, v in files.items()}
        summary[fam] = s
        print(fam, json.dumps(s), flush=True)
    (results / "vllm_compare.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    elif sys.argv[1] == "serve":
        serve(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(__doc__)

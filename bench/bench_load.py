"""Loading memory: expq.load_model (experts int8 in memory) against stock transformers (experts dequantized), side by
side, each in a fresh process, on the CPU.

    python bench/bench_load.py [--work DIR] [--runs 3] [--json OUT.json]

Builds (once) a Mixtral checkpoint with transformers (bf16; hidden 1024, 8 experts of I=2816, 8 layers: about
0.9 GB) and converts it. For each loader reports the median load time, the process's peak RSS during the load
(``VmHWM``) minus its RSS before it, the parameter and buffer bytes of the loaded model (experts and the rest), and
the ratio peak / final: how close loading stays to the final size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=320)

LOAD = r"""
import json, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch, transformers, expq.runtime  # imports are not part of the load
before = status("VmRSS:")
t = time.perf_counter()
if sys.argv[2] == "expq":
    model = expq.runtime.load_model(sys.argv[1], device="cpu")
else:
    from transformers.utils import logging
    logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
seconds = time.perf_counter() - t
experts = other = 0
for name, t_ in list(model.named_parameters()) + list(model.named_buffers()):
    n = t_.numel() * t_.element_size()
    if ".experts." in name:
        experts += n
    else:
        other += n
print(json.dumps({"seconds": seconds, "peak_minus_before": status("VmHWM:") - before, "experts_bytes": experts,
                  "other_bytes": other}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="build/bench-load")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    src, out = work / "src", work / "int8"
    if not (out / "config.json").exists():
        import torch

        import expq
        from expq.examples import build_example

        build_example("mixtral", src, dtype=torch.bfloat16, max_shard_size="500MB", **CONFIG)
        expq.convert(src, out, device="cpu", overwrite=True)
    rows = {}
    for loader in ("expq", "transformers"):
        rs = []
        for _ in range(a.runs):
            p = subprocess.run([sys.executable, "-c", LOAD, str(out), loader], capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(p.stderr[-2000:])
            rs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        final = rs[0]["experts_bytes"] + rs[0]["other_bytes"]
        peak = statistics.median(r["peak_minus_before"] for r in rs)
        rows[loader] = {"seconds": statistics.median(r["seconds"] for r in rs), "peak_bytes": peak,
                        "final_bytes": final, "experts_bytes": rs[0]["experts_bytes"],
                        "other_bytes": rs[0]["other_bytes"], "peak_over_final": peak / final}
    print(f"{'loader':13s} {'load s':>7s} {'experts MB':>11s} {'other MB':>9s} {'final MB':>9s} {'peak MB':>8s} "
          f"{'peak/final':>10s}")
    for k, r in rows.items():
        print(f"{k:13s} {r['seconds']:7.2f} {r['experts_bytes'] / 1e6:11.1f} {r['other_bytes'] / 1e6:9.1f} "
              f"{r['final_bytes'] / 1e6:9.1f} {r['peak_bytes'] / 1e6:8.1f} {r['peak_over_final']:10.2f}")
    print(f"experts: expq/transformers = {rows['expq']['experts_bytes'] / rows['transformers']['experts_bytes']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

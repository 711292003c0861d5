"""What a config's first conversion waits for: the layer-marker check's child process
(``python -m expq.formats.stock_model``, ``plan.ModelCheck``), timed from outside, and where its start-up goes.

    python bench/model_check_cost.py [--family mixtral] [--layers 4] [--runs 3] [--importtime FILE]

Builds the family's config with transformers (``AutoConfig.for_model``, the layer count given), asks the child the
question a conversion asks (every parameter name of one layer's routed experts and a few others), and prints the
child's wall seconds per run (median), then the same for ``python -c "import torch"`` and for the child's imports
alone (torch, then transformers' model classes), so that the check's cost reads as start-up against answer. With
``--importtime`` the child's ``-X importtime`` report is written to FILE (the largest cumulative entries are
printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], stdin: bytes = b"", env: dict | None = None) -> tuple[float, bytes, bytes]:
    t = time.perf_counter()
    p = subprocess.run(cmd, input=stdin, capture_output=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.decode(errors='replace')[-400:]}")
    return time.perf_counter() - t, p.stdout, p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="mixtral")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--importtime", default=None)
    a = ap.parse_args()
    from transformers import AutoConfig

    config = AutoConfig.for_model(a.family, num_hidden_layers=a.layers).to_dict()
    names = sorted(["model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.embed_tokens.weight",
                    "lm_head.weight", "model.norm.weight"])
    question = json.dumps({"config": config, "names": names}).encode()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    py = sys.executable
    rows = {
        "child (python -m expq.formats.stock_model)": ([py, "-m", "expq.formats.stock_model"], question),
        "python -c 'import torch'": ([py, "-c", "import torch"], b""),
        "python -c 'import torch, transformers' + model classes": (
            [py, "-c", "import torch; from transformers import AutoModelForCausalLM, PretrainedConfig"], b""),
    }
    print(f"{a.family}, {a.layers} layers; {a.runs} runs each, median (min-max) seconds")
    for label, (cmd, stdin) in rows.items():
        secs = []
        for _ in range(a.runs):
            dt, out, _ = timed(cmd, stdin, env)
            secs.append(dt)
        print(f"  {label}: {statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f})")
        if label.startswith("child"):
            print(f"    answer: {out.decode()[:200]}")
    if a.importtime:
        _, _, err = timed([py, "-X", "importtime", "-m", "expq.formats.stock_model"], question, env)
        Path(a.importtime).write_bytes(err)
        entries = []
        for line in err.decode(errors="replace").splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                entries.append((int(parts[1]), parts[2].rstrip()))
        print("  largest cumulative imports (ms):")
        for us, name in sorted(entries, reverse=True)[:25]:
            print(f"    {us / 1000:8.0f}  {name}")


if __name__ == "__main__":
    main()

"""The sort-free decode path of expq's fused-MoE pipeline against the sorted one, same config (issue 13).

Usage (repo root, CUDA machine):
    PYTHONPATH=. python3 bench/bench_sort_free.py --json sort_free.json

For each shape of bench/bench_kernel.py and each token count where ``expq.kernels.moe.sorts_pairs`` says no sort
(by default T=1), the whole pipeline (same weights, routing and config as bench_kernel.py, the config from
``get_config``: the GPU's tuned table when there is one) is timed as a CUDA-graph replay (``do_bench`` median,
L2 cleared before each replay) twice, side by side in the same run: as shipped (no sort launch: a block per pair)
and with the sort forced (``sorts_pairs`` replaced by one that always says yes). The two outputs must be equal bit
for bit. Prints a markdown table: us sorted, us sort-free, ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernel import SHAPES, add_point_args, graph_time, make_routing, make_weights  # noqa: E402

from expq.kernels import moe  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_point_args(ap)
    ap.set_defaults(tokens=[1])
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sort_free.py needs a CUDA GPU")
    dtype = getattr(torch, a.dtype)
    original = moe.sorts_pairs
    rows = []
    for name in [n for n in SHAPES if any(n.startswith(s) for s in a.shapes)]:
        e, h, i, top_k = SHAPES[name]
        w13, w2, s13, s2, _ = make_weights(e, h, i, "cuda")
        for t in a.tokens:
            if original(t, top_k, e):
                continue
            gen = torch.Generator(device="cuda").manual_seed(1000 + t)
            x, tw, ti = make_routing(t, e, h, top_k, dtype, "cuda", gen)
            cfg = moe.get_config(t, e, top_k, "cuda", hidden_size=h, intermediate_size=i, dtype=dtype)

            def run():
                return moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg)

            us, out = {}, {}
            for mode, rule in (("sorted", lambda *args: True), ("sort-free", original)):
                moe.sorts_pairs = rule
                out[mode] = run()
                us[mode] = graph_time(run, a.rep)
            moe.sorts_pairs = original
            rows.append(dict(shape=name, tokens=t, config=cfg, us=us,
                             equal=bool(torch.equal(out["sorted"], out["sort-free"]))))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"{torch.cuda.get_device_name()}; CUDA-graph replay, do_bench median (L2 cleared), us", "",
             "| shape | T | sorted | sort-free | sort-free / sorted | outputs equal |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['us']['sorted']:.1f} | {r['us']['sort-free']:.1f} | "
              f"{r['us']['sort-free'] / r['us']['sorted']:.3f} | {r['equal']} |" for r in rows]
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

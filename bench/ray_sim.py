"""Scheduling simulation of a Ray scale-out conversion on one machine (docs/scale.md), with Ray's public API only.

Each stand-in shard is one Ray task requesting 1 CPU; ``ray.init(num_cpus=N)`` makes N slots, each standing for one
node (one conversion at a time per node). A task sleeps for its shard's modelled time on a node (download, convert,
upload, from docs/scale.md's rates: ``shard_seconds``) times ``--scale``, and returns a record shaped like the
``CommitOperationAdd`` a worker hands the driver after ``preupload_lfs_files`` (path in repo, size, sha256). The
driver submits every task (in index order, or largest first), collects the records as they finish (``ray.wait``),
then "commits" them in batches of at most ``--commit-files`` (the Hub recommends < 100 files a commit), each commit
costing ``--commit-seconds`` of modelled time. Reported per run: the makespan (first submit to last commit), the
ideal (max(total work / N, largest task) + the commits), their ratio, and Ray's overhead per task.

    python bench/ray_sim.py --out docs/results/ray_sim.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import time

# Modelled per-node rates (docs/scale.md "Assumptions"): an H200 node (16 cores + one H200).
DOWNLOAD_GBPS = 1.5  # Hub -> node
UPLOAD_GBPS = 0.5  # node -> Hub (LFS/Xet), per node
CONVERT_BF16_GBPS = 1.0  # measured: expq convert --device cuda, OLMoE 13.84 GB bf16 (docs/benchmarks.md)
FP8_FACTOR = 1.44  # measured: an FP8 source takes 1.44x the bf16 twin's time (2-core runner, docs/benchmarks.md)


def shard_seconds(fp8_gb: float, out_gb: float, overlap: bool = True) -> float:
    """Modelled seconds for one FP8 shard on one node: download, convert (logical bf16 bytes = 2x FP8 bytes), upload;
    with ``overlap`` the three stages of consecutive shards run at once (the slowest one sets the pace)."""
    stages = (fp8_gb / DOWNLOAD_GBPS, 2 * fp8_gb * FP8_FACTOR / CONVERT_BF16_GBPS, out_gb / UPLOAD_GBPS)
    return max(stages) if overlap else sum(stages)


def stand_in_shards(n: int, total_gb: float, seed: int = 0) -> list[float]:
    """n shard sizes (GB) summing to total_gb: uniform 3.6-4.6 GB-like spread, the last one a third of the rest."""
    rng = random.Random(seed)
    raw = [rng.uniform(0.85, 1.07) for _ in range(n - 1)] + [0.33]
    k = total_gb / sum(raw)
    return [r * k for r in raw]


# The time and cost model of docs/scale.md (``--model``): per node type, the per-shard stage rates and an assumed
# on-demand price; fixed costs of a run. Every figure is an assumption stated in docs/scale.md except where marked.
NODE_TYPES = {  # name: (convert GB/s of FP8 source, download GB/s, upload GB/s, USD per node-hour)
    "h200": (CONVERT_BF16_GBPS / (2 * FP8_FACTOR), DOWNLOAD_GBPS, UPLOAD_GBPS, 4.00),
    "cpu16": (0.740 / (2 * FP8_FACTOR), DOWNLOAD_GBPS, UPLOAD_GBPS, 0.70),  # measured 0.740 GB/s bf16, 16 cores
    "cpu2": (1.98 / 12.94, 0.5, 0.2, 0.085),  # measured: FP8 twin 1.98 GB in 12.94 s on the 2-core runner
}
MODELS = {  # name: (source GB (FP8), output GB, source shards)
    "DeepSeek-V3": (688.0, 716.0, 163),
    "Kimi-K2": (1030.0, 1070.0, 62),
}
BOOT_S = 180.0  # start a node, pull the image / install expq
PLAN_S = 10.0  # the driver's plan from the shard headers (two range reads per shard)
COMMIT_S = 20.0  # one create_commit of up to 100 files (the Hub verifies the LFS objects it names)
OUT_SHARD_GB = 5.0  # --max-shard-size 5GB
HUB_UPLOAD_CAP_GBPS = 10.0  # what one repo's uploads may get from the Hub in all (not published: a guess)


def lpt_makespan(tasks: list[float], nodes: int) -> float:
    """Longest-processing-time-first list scheduling (what submitting largest first gives)."""
    import heapq

    loads = [0.0] * min(nodes, len(tasks))
    heapq.heapify(loads)
    for t in sorted(tasks, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + t)
    return max(loads)


def model_rows() -> list[dict]:
    rows = []
    for model, (src_gb, out_gb, n_shards) in MODELS.items():
        sizes = stand_in_shards(n_shards, src_gb)
        ratio = out_gb / src_gb
        commits = math.ceil((out_gb / OUT_SHARD_GB + 10) / 100)
        for node, (conv, dl, ul, price) in NODE_TYPES.items():
            # the plain recipe on one node: download, convert, verify --source (~ a conversion), push (hash + upload)
            plain = src_gb / dl + src_gb / conv + src_gb / conv + out_gb / 1.0 + out_gb / ul
            rows.append({"model": model, "node": node, "nodes": 1, "variant": "plain", "seconds": round(plain),
                         "usd": round(plain / 3600 * price, 2)})
            for n in (1, 8, 64):
                per = [max(s / dl, s / conv, s * ratio / ul) for s in sizes]
                fill = sizes[0] / dl + sizes[-1] * ratio / ul  # first download, last upload: not overlapped
                tasks = max(lpt_makespan(per, n), out_gb / HUB_UPLOAD_CAP_GBPS)
                total = BOOT_S + PLAN_S + tasks + fill + commits * COMMIT_S
                rows.append({"model": model, "node": node, "nodes": n, "variant": "ray", "seconds": round(total),
                             "tasks_s": round(tasks), "busy_nodes": min(n, n_shards),
                             "usd": round(n * total / 3600 * price, 2)})
    return rows


def simulate(nodes: int, sizes: list[float], out_ratio: float, *, order: str, scale: float, commit_files: int,
             commit_seconds: float) -> dict:
    import ray

    @ray.remote(num_cpus=1)
    def convert_shard(i: int, fp8_gb: float, modelled: float, scale: float) -> dict:
        start = time.time()
        time.sleep(modelled * scale)
        out_bytes = int(fp8_gb * out_ratio * 1e9)
        return {"path_in_repo": f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors", "size": out_bytes,
                "sha256": hashlib.sha256(str(i).encode()).hexdigest(), "pid": os.getpid(), "start": start,
                "end": time.time()}

    ray.init(num_cpus=nodes, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        # warm-up: one worker process per slot, all started before the clock runs (Ray starts only a few worker
        # processes at a time on a small machine: rounds of N concurrent 2 s tasks until N distinct ones ran)
        for _ in range(60):
            if len({r["pid"] for r in ray.get([convert_shard.remote(-1, 0.0, 2.0, 1.0) for _ in range(nodes)])}) == nodes:
                break
        modelled = [shard_seconds(s, s * out_ratio) for s in sizes]
        idx = list(range(len(sizes)))
        if order == "largest-first":
            idx.sort(key=lambda i: -modelled[i])
        t0 = time.time()
        pending = [convert_shard.remote(i, sizes[i], modelled[i], scale) for i in idx]
        ops = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ops += ray.get(done)
        t_tasks = time.time() - t0
        commits = math.ceil((len(ops) + 4) / commit_files)  # + index, config, expq.json, card
        for _ in range(commits):
            time.sleep(commit_seconds * scale)  # the driver's create_commit calls, one after the other
        makespan = (time.time() - t0) / scale
    finally:
        ray.shutdown()
    work = sum(modelled)
    ideal_tasks = max(work / nodes, max(modelled))
    ideal = ideal_tasks + commits * commit_seconds
    return {"nodes": nodes, "shards": len(sizes), "order": order, "modelled_shard_s": [min(modelled), max(modelled)],
            "total_work_s": round(work, 1), "makespan_s": round(makespan, 1), "tasks_s": round(t_tasks / scale, 1),
            "ideal_s": round(ideal, 1), "ratio": round(makespan / ideal, 3), "commits": commits,
            "overhead_per_task_ms": round(1000 * (t_tasks - ideal_tasks * scale) / math.ceil(len(sizes) / nodes), 2),
            "distinct_workers": len({o["pid"] for o in ops})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,8,64")
    ap.add_argument("--shards", default="163,400")
    ap.add_argument("--orders", default="index,largest-first")
    ap.add_argument("--scale", type=float, default=0.01, help="wall seconds per modelled second")
    ap.add_argument("--commit-files", type=int, default=100)
    ap.add_argument("--commit-seconds", type=float, default=20.0, help="modelled seconds per create_commit")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", action="store_true", help="print docs/scale.md's time and cost model and exit")
    a = ap.parse_args()
    if a.model:
        for r in model_rows():
            print(json.dumps(r))
        return
    # 163 shards: DeepSeek-V3 (688 GB FP8, output ~716 GB); 400 shards: the same bytes cut finer (a scheduler test)
    results = []
    for n_shards in map(int, a.shards.split(",")):
        sizes = stand_in_shards(n_shards, 688.0)
        for nodes in map(int, a.nodes.split(",")):
            for order in a.orders.split(","):
                r = simulate(nodes, sizes, 716 / 688, order=order, scale=a.scale, commit_files=a.commit_files,
                             commit_seconds=a.commit_seconds)
                print(json.dumps(r), flush=True)
                results.append(r)
    import ray

    meta = {"command": "python bench/ray_sim.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                            vars(a).items() if v is not None),
            "ray": ray.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "scale": a.scale,
            "rates": {"download_GBps": DOWNLOAD_GBPS, "upload_GBps": UPLOAD_GBPS,
                      "convert_bf16_GBps": CONVERT_BF16_GBPS, "fp8_factor": FP8_FACTOR}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

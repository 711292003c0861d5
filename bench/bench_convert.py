"""Convert speed and peak memory, against the I/O floor and a naive converter, side by side.

    python bench/bench_convert.py [--size-gb 2.2] [--runs 3] [--devices cpu[,cuda]] [--work DIR] [--json OUT.json]

Builds (once) a Mixtral-format bf16 checkpoint of about ``--size-gb`` written directly with safetensors (random
weights, 8 experts, several 2 GB-class shards), then times, each in a fresh process, from the page cache
(files read once beforehand), median of ``--runs``:

* ``floor``: start Python, import torch, read every source byte, write as many bytes as expq's output has, fsync:
  what no converter can beat;
* ``naive``: the obvious converter: each whole shard loaded with safetensors, every expert quantized with the seed
  formula in torch ops, packed with compressed-tensors, saved with ``safetensors.save_file``;
* ``expq``: ``expq convert`` (the real CLI) on each device asked for.

Reports seconds, GB/s of source, ratio to the floor, and peak RSS of the process (``VmHWM``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HWM = r"""
def hwm():  # peak resident set of this process (VmHWM: per address space, so a parent's peak does not leak in)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
"""

FLOOR = HWM + r"""
import os, sys, json, time
t = time.perf_counter()
import torch  # noqa: F401 - every converter pays for it; so does the floor
src, out, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = bytearray(64 << 20)
for f in sorted(os.listdir(src)):
    if f.endswith(".safetensors"):
        with open(os.path.join(src, f), "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "blob"), "wb", buffering=0) as fh:
    left = nbytes
    while left:
        n = fh.write(memoryview(buf)[: min(len(buf), left)])
        left -= n
    os.fsync(fh.fileno())
print(json.dumps({"seconds": time.perf_counter() - t, "rss_gb": hwm()}))
"""

NAIVE = HWM + r"""
import os, sys, json, time, re
t = time.perf_counter()
import torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
expert = re.compile(r"experts\.\d+\.w[123]\.weight$")
for f in sorted(os.listdir(src)):
    if not f.endswith(".safetensors"):
        continue
    sd = load_file(os.path.join(src, f))
    res = {}
    for k, w in sd.items():
        if not expert.search(k):
            res[k] = w
            continue
        s = w.abs().amax(dim=1, keepdim=True) / 127
        q = (w / s).round_().clamp_(-127, 127).to(torch.int8)
        m = k[: -len(".weight")]
        res[m + ".weight_packed"] = pack_to_int32(q, 8)
        res[m + ".weight_scale"] = s
        res[m + ".weight_shape"] = torch.tensor(list(w.shape))
    save_file(res, os.path.join(out, f))
    del sd, res
print(json.dumps({"seconds": time.perf_counter() - t, "rss_gb": hwm()}))
"""

EXPQ = HWM + r"""
import sys, json, time
t = time.perf_counter()
import expq
r = expq.convert(sys.argv[1], sys.argv[2], device=sys.argv[3], overwrite=True)
print(json.dumps({"seconds": time.perf_counter() - t, "rss_gb": hwm(),
                  "bytes_out": r.bytes_out}))
"""


def make_checkpoint(path: Path, size_gb: float) -> None:
    """A Mixtral-format bf16 checkpoint of about ``size_gb``: H=2048, I=5632 (scaled layers), 8 experts."""
    import torch
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    H, I, E, V = 2048, 5632, 8, 32000
    per_layer = E * 3 * H * I * 2 + 4 * H * H * 2
    layers = max(1, round((size_gb * 1e9 - 2 * V * H * 2) / per_layer))
    g = torch.Generator().manual_seed(0)
    shards, cur, size = [], {}, 0

    def flush():
        nonlocal cur, size
        if cur:
            shards.append(cur)
            cur, size = {}, 0

    def add(name, shape):
        nonlocal size
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if size + t.numel() * 2 > 2e9:
            flush()
        cur[name] = t
        size += t.numel() * 2

    add("model.embed_tokens.weight", (V, H))
    for L in range(layers):
        p = f"model.layers.{L}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add(p + f"self_attn.{n}.weight", (H, H))
        add(p + "block_sparse_moe.gate.weight", (E, H))
        for e in range(E):
            for n, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                add(p + f"block_sparse_moe.experts.{e}.{n}.weight", shape)
        add(p + "input_layernorm.weight", (H,))
        add(p + "post_attention_layernorm.weight", (H,))
    add("model.norm.weight", (H,))
    add("lm_head.weight", (V, H))
    flush()
    n = len(shards)
    weight_map = {}
    for k, sd in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(sd, path / name, metadata={"format": "pt"})
        weight_map.update({t: name for t in sd})
    total = sum(t.numel() * 2 for sd in shards for t in sd.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16, "num_local_experts": E,
        "num_experts_per_tok": 2, "vocab_size": V, "dtype": "bfloat16", "rms_norm_eps": 1e-5}))


def run(code: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--work", default="build/bench-convert")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.work)
    src = work / "src"
    make_checkpoint(src, a.size_gb)
    bytes_in = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    for p in src.glob("*.safetensors"):  # into the page cache
        with open(p, "rb") as f:
            while f.read(1 << 26):
                pass
    first = run(EXPQ, str(src), str(work / "out-expq"), a.devices.split(",")[0])
    nbytes_out = first["bytes_out"]
    variants = [("floor", FLOOR, [str(src), str(work / "out-floor"), str(nbytes_out)]),
                ("naive", NAIVE, [str(src), str(work / "out-naive")])]
    variants += [(f"expq-{d}", EXPQ, [str(src), str(work / f"out-expq-{d}"), d]) for d in a.devices.split(",")]
    rows = {}
    for name, code, args in variants:
        rs = [run(code, *args) for _ in range(a.runs)]
        rows[name] = {"seconds": statistics.median(r["seconds"] for r in rs),
                      "rss_gb": max(r["rss_gb"] for r in rs), "runs": [round(r["seconds"], 3) for r in rs]}
    floor = rows["floor"]["seconds"]
    print(f"source {bytes_in / 1e9:.2f} GB, output {nbytes_out / 1e9:.2f} GB, median of {a.runs} runs")
    print(f"{'variant':12s} {'seconds':>8s} {'GB/s':>6s} {'x floor':>8s} {'peak RSS GB':>12s}")
    for name, r in rows.items():
        print(f"{name:12s} {r['seconds']:8.2f} {bytes_in / 1e9 / r['seconds']:6.2f} {r['seconds'] / floor:8.2f} "
              f"{r['rss_gb']:12.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"bytes_in": bytes_in, "bytes_out": nbytes_out, "rows": rows,
                                            "nproc": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()

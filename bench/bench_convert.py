"""Convert speed and peak memory, against the I/O floor and a naive converter, side by side.

    python bench/bench_convert.py [--size-gb 2.2] [--runs 3] [--devices cpu[,cuda]] [--work DIR] [--json OUT.json]
                                  [--source-format bf16|fp8|both]

Builds (once) a Mixtral-format bf16 checkpoint of about ``--size-gb`` written directly with safetensors (random
weights, 8 experts, several 2 GB-class shards), then times, each in a fresh process, from the page cache
(files read once beforehand), median of ``--runs``:

* ``floor``: start Python, import torch, read every source byte, write as many bytes as expq's output has, fsync:
  what no converter can beat;
* ``naive``: the obvious converter: each whole shard loaded with safetensors, every expert quantized with the seed
  formula in torch ops, packed with compressed-tensors, saved with ``safetensors.save_file`` (bf16 sources only, and
  only with ``--source-format bf16``);
* ``expq``: ``expq.convert`` (what the CLI runs) on each device asked for.

``--source-format fp8`` (or ``both``: bf16 and fp8 of the same shape side by side in one run) also builds, from the
bf16 checkpoint, its FP8 twin the way DeepSeek ships FP8 (``tests/fp8_fixture.py``'s ``vendor_quant``, vectorized):
every 2-D projection (attention ``*_proj`` and routed experts ``w1``/``w2``/``w3``) stored F8_E4M3 with an F32
``weight_scale_inv`` per 128x128 block (``s = amax / 448``, ``q = fp8(x / s)``, in fp32), embeddings, norms, the
router and ``lm_head`` unchanged, ``quantization_config = {activation_scheme: dynamic, fmt: e4m3, quant_method: fp8,
weight_block_size: [128, 128]}``; the same shard files. For FP8 sources ``decode`` also times expq's decoder alone
(read every FP8 weight and its scale, ``Fp8BlockDecoder.decode`` to bf16, nothing written), split into read and
decode seconds.

Reports seconds, GB/s of (its own) source, ratio to the floor of the same source, peak RSS of the process
(``VmHWM``), and with ``both`` the ratio fp8 / bf16 of expq's seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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

DECODE = HWM + r"""
import sys, json, time
t = time.perf_counter()
import torch  # noqa: F401
from expq.source import open_source
src = open_source(sys.argv[1])
t_read = t_dec = 0.0
n = 0
for lt in src.logical.values():
    if not lt.decoded:
        continue
    t0 = time.perf_counter()
    parts = {p.name: src.read(p) for p in lt.parts}
    t1 = time.perf_counter()
    out = src.decoder.decode(lt, lambda info: parts[info.name])
    t_dec += time.perf_counter() - t1
    t_read += t1 - t0
    n += out.numel()
    del parts, out
print(json.dumps({"seconds": time.perf_counter() - t, "rss_gb": hwm(), "read_s": t_read, "decode_s": t_dec,
                  "elements": n}))
"""

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)
FP8_QUANTIZED = re.compile(r"(_proj|experts\.\d+\.w[123])\.weight$")
"""Mixtral's 2-D projections: attention q/k/v/o_proj and the routed experts (not the router ``gate``)."""


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


def block_quant(w, br: int, bc: int):
    """``tests/fp8_fixture.vendor_quant`` (DeepSeek-V3 ``weight_quant``) vectorized: per ``br x bc`` block, in fp32,
    ``s = amax(|x|) / 448`` (1 for an all-zero block), ``q = fp8_e4m3(x / s)``; edge blocks cut at the matrix edge.
    Returns (F8_E4M3 codes [rows, cols], F32 scales [ceil(rows/br), ceil(cols/bc)])."""
    import torch

    rows, cols = w.shape
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    x = torch.nn.functional.pad(w.to(torch.float32), (0, nc * bc - cols, 0, nr * br - rows))
    x = x.view(nr, br, nc, bc)
    amax = x.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return q, s.contiguous()


def make_fp8_checkpoint(bf16: Path, path: Path) -> None:
    """The FP8 block-scale twin of the bf16 checkpoint ``bf16`` (same shapes, same shard files): see the module
    docstring. One shard in memory at a time."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    weight_map, total = {}, 0
    for f in sorted(set(index["weight_map"].values())):
        sd = {}
        with safe_open(bf16 / f, "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if t.dim() == 2 and FP8_QUANTIZED.search(k):
                    sd[k], sd[k + "_scale_inv"] = block_quant(t, *FP8_BLOCK)
                else:
                    sd[k] = t
        save_file(sd, path / f, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, f))
        total += sum(t.numel() * t.element_size() for t in sd.values())
        del sd
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(FP8_BLOCK)}
    (path / "config.json").write_text(json.dumps(config))


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
    ap.add_argument("--source-format", choices=("bf16", "fp8", "both"), default="bf16",
                    help="bf16 source (default), its FP8 block-scale twin, or both side by side")
    a = ap.parse_args()
    work = Path(a.work)
    devices = a.devices.split(",")
    formats = ["bf16", "fp8"] if a.source_format == "both" else [a.source_format]
    srcs = {"bf16": work / "src"}
    make_checkpoint(srcs["bf16"], a.size_gb)
    if "fp8" in formats:
        srcs["fp8"] = work / "src-fp8"
        make_fp8_checkpoint(srcs["bf16"], srcs["fp8"])
    bytes_in, bytes_out, variants = {}, {}, []
    for fmt in formats:
        src = srcs[fmt]
        bytes_in[fmt] = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        for p in src.glob("*.safetensors"):  # into the page cache
            with open(p, "rb") as f:
                while f.read(1 << 26):
                    pass
        sfx = "" if a.source_format == "bf16" else f"-{fmt}"  # bf16-only runs keep their historical names
        first = run(EXPQ, str(src), str(work / f"out-expq{sfx}"), devices[0])
        bytes_out[fmt] = first["bytes_out"]
        variants.append((f"floor{sfx}", fmt, FLOOR, [str(src), str(work / f"out-floor{sfx}"), str(bytes_out[fmt])]))
        if a.source_format == "bf16":
            variants.append(("naive", fmt, NAIVE, [str(src), str(work / "out-naive")]))
        if fmt == "fp8":
            variants.append(("decode-fp8", fmt, DECODE, [str(src)]))
        variants += [(f"expq-{d}{sfx}", fmt, EXPQ, [str(src), str(work / f"out-expq-{d}{sfx}"), d]) for d in devices]
    rows = {}
    for name, fmt, code, args in variants:
        rs = [run(code, *args) for _ in range(a.runs)]
        rows[name] = {"source": fmt, "seconds": statistics.median(r["seconds"] for r in rs),
                      "rss_gb": max(r["rss_gb"] for r in rs), "runs": [round(r["seconds"], 3) for r in rs]}
        if code is DECODE:
            rows[name].update({k: statistics.median(r[k] for r in rs) for k in ("read_s", "decode_s")},
                              elements=rs[0]["elements"])
    for fmt in formats:
        print(f"{fmt} source {bytes_in[fmt] / 1e9:.3f} GB, output {bytes_out[fmt] / 1e9:.3f} GB")
    print(f"median of {a.runs} runs, {os.cpu_count()} CPUs")
    print(f"{'variant':16s} {'seconds':>8s} {'GB/s':>6s} {'x floor':>8s} {'peak RSS GB':>12s}")
    for name, r in rows.items():
        fmt = r["source"]
        floor = rows["floor" if a.source_format == "bf16" else f"floor-{fmt}"]["seconds"]
        extra = f"   (read {r['read_s']:.2f} s, decode {r['decode_s']:.2f} s)" if "decode_s" in r else ""
        print(f"{name:16s} {r['seconds']:8.2f} {bytes_in[fmt] / 1e9 / r['seconds']:6.2f} {r['seconds'] / floor:8.2f} "
              f"{r['rss_gb']:12.2f}{extra}")
    ratios = {}
    if len(formats) == 2:
        for d in devices:
            b, f = rows[f"expq-{d}-bf16"], rows[f"expq-{d}-fp8"]
            ratios[f"expq-{d}"] = {"seconds": f["seconds"] / b["seconds"], "rss_gb": f["rss_gb"] / b["rss_gb"]}
            print(f"expq-{d} fp8 / bf16: seconds {ratios[f'expq-{d}']['seconds']:.2f}x, "
                  f"peak RSS {ratios[f'expq-{d}']['rss_gb']:.2f}x")
    if a.json:
        if a.source_format == "bf16":  # the historical shape of the file
            res = {"bytes_in": bytes_in["bf16"], "bytes_out": bytes_out["bf16"], "rows": rows}
        else:
            res = {"source_format": a.source_format, "size_gb_arg": a.size_gb, "runs_per_variant": a.runs,
                   "bytes_in": bytes_in, "bytes_out": bytes_out, "rows": rows, "ratio_fp8_over_bf16": ratios}
        res["nproc"] = os.cpu_count()
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

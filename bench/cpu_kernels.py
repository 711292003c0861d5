"""Per-core cost of the CPU paths (``EXPQ_CPU_KERNEL`` numba and torch): the scheme, the FP8 block decode, the MXFP4
decode and the shard hash's read back, each on one thread, best of ``--repeat``.

    python bench/cpu_kernels.py [--repeat 5] [--json OUT.json]

Inputs: a Mixtral-8x7B expert matrix (14336 x 4096) in bf16, fp16 and fp32 (values 0.02 N(0, 1)); its FP8 E4M3 twin
with 128x128 block scales; a GPT-OSS-120B expert's MXFP4 gate_up blocks (5760 x 90 x 16 bytes); a 1 GiB file
hashed by ``output.shards._ShardHash`` (read back from the page cache). Figures: ns per element (scheme, FP8), MB/s
of stored blocks (MXFP4), GB/s (hash). On a shared machine the best of the repeats is the machine's own speed; the
load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from expq import cpu_kernels, scheme  # noqa: E402
from expq.decoders import LogicalTensor  # noqa: E402
from expq.decoders.fp8_block import Fp8BlockDecoder  # noqa: E402
from expq.decoders.mxfp4 import dequantize  # noqa: E402
from expq.io.safetensors import TensorInfo  # noqa: E402
from expq.output import shards  # noqa: E402


def best(fn, repeat: int) -> float:
    fn()  # warm: numba's first call loads the compiled kernel
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(14336, 4096, generator=g) * 0.02
    res: dict = {"load_before": os.getloadavg()[0], "threads": 1}
    for path in ("torch", "numba"):
        os.environ[cpu_kernels.ENV] = path
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = w.to(dtype)
            s = best(lambda: scheme.quantize_matrix(x), a.repeat)
            res[f"scheme {path} {str(dtype)[6:]} ns/element"] = s / x.numel() * 1e9
        codes = (w * 448 / 0.1).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(112, 32, generator=g) * 1e-4
        wi = TensorInfo("m.weight", "f", "F8_E4M3", tuple(codes.shape), 0, codes.numel())
        si = TensorInfo("m.weight_scale_inv", "f", "F32", tuple(scales.shape), 0, scales.numel() * 4)
        lt = LogicalTensor("m.weight", "BF16", tuple(codes.shape), (wi, si), decoded=True)
        parts = {wi: codes, si: scales}
        dec = Fp8BlockDecoder((128, 128))
        s = best(lambda: dec.decode(lt, parts.__getitem__), a.repeat)
        res[f"fp8 block decode {path} ns/element"] = s / codes.numel() * 1e9
        blocks = torch.randint(0, 256, (1, 5760, 90, 16), generator=g, dtype=torch.uint8)
        mx_scales = torch.randint(118, 125, (1, 5760, 90), generator=g, dtype=torch.uint8)
        s = best(lambda: dequantize(blocks, mx_scales), a.repeat)
        res[f"mxfp4 decode {path} MB/s of blocks"] = blocks.numel() / s / 1e6
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        f.write(os.urandom(1 << 20) * 1024)
        f.flush()
        size = 1 << 30

        def hash_back() -> None:
            hs = shards._ShardHash(f.fileno(), b"", size, writeback=False)
            hs.ready = [(0, size, 0, None)]  # (start, end, arrival, bytes): all of it to read back
            hs.advance(lambda nbytes: None)

        res["shard hash read back GB/s"] = size / best(hash_back, max(1, a.repeat // 2)) / 1e9
    res["load_after"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:40s} {v:8.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

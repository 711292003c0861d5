"""Per-core cost of the CPU paths (``EXPQ_CPU_KERNEL`` numba and torch): the scheme, the FP8 block decode, the MXFP4
decode and the shard hash's read back, each on one thread, best of ``--repeat``.

    python bench/cpu_kernels.py [--repeat 5] [--json OUT.json] [--pipeline-only]

"In the pipeline" (numba path, one thread): the scheme and the FP8 decode called as a CPU conversion calls them,
``--jobs`` times in a row, each output held while the next ones are computed (codes: the 4 jobs the write queue,
the writer and the shard hasher hold; decoded weights: none, the job's own quantization consumes them), the
median call after the first 4; without a buffer pool (every output a fresh allocation: its page faults count) and
with the conversion's pool (``io.buffers``, as ``pipeline.run_plan`` sets it).

Inputs: a Mixtral-8x7B expert matrix (14336 x 4096) in bf16, fp16 and fp32 (values 0.02 N(0, 1)); its FP8 E4M3 twin
with 128x128 block scales; a GPT-OSS-120B expert's MXFP4 gate_up blocks (5760 x 90 x 16 bytes); a 1 GiB file
hashed by ``output.shards._ShardHash`` (read back from the page cache). Figures: ns per element (scheme, FP8), MB/s
of stored blocks (MXFP4), GB/s (hash). On a shared machine the best of the repeats is the machine's own speed; the
load average is printed with them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from expq import cpu_kernels, pipeline, scheme  # noqa: E402
from expq.decoders import LogicalTensor  # noqa: E402
from expq.decoders.fp8_block import Fp8BlockDecoder  # noqa: E402
from expq.decoders.mxfp4 import dequantize  # noqa: E402
from expq.io import buffers  # noqa: E402
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


def held_calls(fn, jobs: int, hold: int) -> float:
    """Median seconds of ``fn()`` over ``jobs`` calls after the first 4, each result kept for ``hold`` more calls."""
    fn()
    held: collections.deque = collections.deque()
    times = []
    for _ in range(jobs):
        t = time.perf_counter()
        held.append(fn())
        times.append(time.perf_counter() - t)
        while len(held) > hold:
            held.popleft()
    return statistics.median(times[4:])


def fp8_case(w: torch.Tensor, g: torch.Generator):
    """(decoder, logical tensor, read) of ``w``'s FP8 E4M3 twin with 128x128 block scales."""
    codes = (w * 448 / 0.1).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(112, 32, generator=g) * 1e-4
    wi = TensorInfo("m.weight", "f", "F8_E4M3", tuple(codes.shape), 0, codes.numel())
    si = TensorInfo("m.weight_scale_inv", "f", "F32", tuple(scales.shape), 0, scales.numel() * 4)
    lt = LogicalTensor("m.weight", "BF16", tuple(codes.shape), (wi, si), decoded=True)
    return Fp8BlockDecoder((128, 128)), lt, {wi: codes, si: scales}.__getitem__


def in_pipeline(w: torch.Tensor, g: torch.Generator, jobs: int) -> dict:
    """ns per element of the scheme (bf16) and the FP8 decode as the pipeline calls them, without / with the pool."""
    os.environ[cpu_kernels.ENV] = "numba"
    x = w.to(torch.bfloat16)
    dec, lt, read = fp8_case(w, g)
    res = {}
    for label, pool in (("fresh outputs", None), ("buffer pool", buffers.Pool(pipeline.BUFFER_POOL_FREE))):
        with buffers.using(pool):
            s = held_calls(lambda: scheme.quantize_matrix(x)[0], jobs, hold=4)
            res[f"in the pipeline, {label}: scheme bf16 ns/element"] = s / x.numel() * 1e9
            s = held_calls(lambda: dec.decode(lt, read), jobs, hold=0)
            res[f"in the pipeline, {label}: fp8 block decode ns/element"] = s / x.numel() * 1e9
    return res


def hash_read_back(repeat: int) -> float:
    """GB/s of ``_ShardHash`` reading a 1 GiB file back from the page cache and hashing it."""
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        f.write(os.urandom(1 << 20) * 1024)
        f.flush()
        size = 1 << 30

        def hash_back() -> None:
            hs = shards._ShardHash(f.fileno(), b"", size, writeback=False)
            hs.ready = [(0, size, 0, None)]  # (start, end, arrival, bytes): all of it to read back
            hs.advance(lambda nbytes: None)

        return size / best(hash_back, max(1, repeat // 2)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=16, help="calls per 'in the pipeline' figure (default 16)")
    ap.add_argument("--pipeline-only", action="store_true", help="only the 'in the pipeline' figures")
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(14336, 4096, generator=g) * 0.02
    res: dict = {"load_before": os.getloadavg()[0], "threads": 1}
    os.environ[cpu_kernels.ENV] = "numba"
    try:
        cpu_kernels.active()
    except cpu_kernels.KernelUnavailable as e:
        print(f"not measured in the pipeline: {e}")
    else:
        res.update(in_pipeline(w, g, a.jobs))
    for path in () if a.pipeline_only else ("torch", "numba"):
        os.environ[cpu_kernels.ENV] = path
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = w.to(dtype)
            s = best(lambda: scheme.quantize_matrix(x), a.repeat)
            res[f"scheme {path} {str(dtype)[6:]} ns/element"] = s / x.numel() * 1e9
        dec, lt, read = fp8_case(w, g)
        s = best(lambda: dec.decode(lt, read), a.repeat)
        res[f"fp8 block decode {path} ns/element"] = s / w.numel() * 1e9
        blocks = torch.randint(0, 256, (1, 5760, 90, 16), generator=g, dtype=torch.uint8)
        mx_scales = torch.randint(118, 125, (1, 5760, 90), generator=g, dtype=torch.uint8)
        s = best(lambda: dequantize(blocks, mx_scales), a.repeat)
        res[f"mxfp4 decode {path} MB/s of blocks"] = blocks.numel() / s / 1e6
    if not a.pipeline_only:
        res["shard hash read back GB/s"] = hash_read_back(a.repeat)
    res["load_after"] = os.getloadavg()[0]
    for k, v in res.items():
        print(f"{k:62s} {v:8.3f}" if isinstance(v, float) else f"{k:62s} {v}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Tune the block configs of expq's fused-MoE w8a16 kernel on this GPU; write the table get_config reads (issue 13).

Usage (repo root, CUDA machine; PYTHONPATH=. or an install of this checkout):
    python3 bench/tune_kernel.py --out build/tune --budget-s 480          # the 18 issue-13 points, resumable
    python3 bench/tune_kernel.py --out build/tune --quick                 # a smaller space (a few minutes)
    python3 bench/tune_kernel.py --out build/tune --shapes qwen --tokens 1 8 --dtype float16
    python3 bench/tune_kernel.py --out build/tune --shapes 64,2048,1408,6  # any E,H,I,top_k
    python3 bench/tune_kernel.py --plan                                   # the space's size only (no GPU)

The knobs (``expq.kernels.tuned.CONFIG_KEYS``): BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, SPLIT_K (the
split-K factor of GEMM2, the down projection; 1 = none), SWAP_AB (every tile computed transposed, both GEMMs:
the dequantized weight tile is the first MMA operand, the tokens the small N dimension) and FUSE_ACT (GEMM1 stores
act(gate) * up itself, no activation launch; BLOCK_SIZE_N columns of gate and of up per program). One config
applies to both GEMMs (the kernel's API). What it does, per shape (E, H, I, top_k) and token count T (a "point"),
with the weights and routing of bench/bench_kernel.py (random int8 codes, per-row scales, softmax top-k routing; seed 0):

1. stage A, the tiles: every BLOCK_SIZE_M in (16, 32, 64, 128, 256) that suits the pairs per expert (T * top_k / E;
   bench_kernel.py --sweep's rule) x BLOCK_SIZE_N in (64, 128), plus 256 when T >= 1024, x BLOCK_SIZE_K in (64, 128,
   256), accumulators of at most 128 x 256 elements (``BIG_ACC``), each with SWAP_AB false and true (true only below
   ``tuned.SWAP_AB_MAX_BLOCK_M`` rows); num_warps 4 (8 for a 128 x 256 accumulator), the deepest num_stages <= 4
   that fits shared memory, SPLIT_K 1, GROUP_SIZE_M 8 for BLOCK_SIZE_M >= 64 (else 1); plus today's default config
   (``get_config(..., tuned=False)``);
2. stage B: the best ``--refine`` (2) (tile, SWAP_AB) of stage A again with num_warps (4, 8) x num_stages (3, 4),
   and GROUP_SIZE_M 16 too for BLOCK_SIZE_M >= 64;
   then, for decode-sized groups (T * top_k / E <= 16), each of them at its best num_warps / num_stages with
   SPLIT_K 2, 4 and 8 (those with cdiv(I, BLOCK_SIZE_K) >= SPLIT_K: GEMM2's K is I); then the best three configs
   without SWAP_AB or FUSE_ACT with FUSE_ACT, at their BLOCK_SIZE_N and at half of it (tiles of 128 x 128 and more
   also with 8 warps and 4 down to 2 stages: two accumulators; not with ``--space``);
3. final: walking the ranking from the fastest (at most 16 configs), the first 3 whose output is within the kernel
   tests' bounds of the fp32 ``moe_reference`` (rel <= 8u, worst token <= 16u; u = 2^-8 bf16, 2^-11 fp16), and the
   default, re-timed with ``--final-rep``; the fastest of them is the point's winner. (On the H200 with Triton 3.6,
   2026-12-01, the fastest prefill configs, SWAP_AB at BLOCK_SIZE_M 256 and 8 warps, failed it with rel ~0.09, and
   ``check_config`` now refuses them: a config that is fast and wrong never wins.)

``--quick``: stage A with one BLOCK_SIZE_K per BLOCK_SIZE_M (128 below 64, else 64: the default run's winners) and N
in (64, 128), both SWAP_AB; stage B without the num_warps / num_stages sweep (SPLIT_K 2 and 4 of the best tile
only, decode-sized groups). ``--plan`` prints, without a GPU, the configs of stage A per point and upper bounds of
stage B's, of the SPLIT_K ones and of the configs compiled per shape.

Cost: the default run of the 18 points (3 shapes x T 1, 8, 32, 128, 1024, 4096, bf16) compiles ~350 configs (those
of stage A are ~240; a SPLIT_K variant compiles GEMM2 only) and makes ~680 timings (per point 22 to 75 in the
search, plus 3 or 4 final ones): one device call of at most ~480 s (``--budget-s 480``). Measured on an H200 (16
cores, 12 compile workers, Triton 3.6, empty Triton cache, 2026-12-01): 354 configs compiled (134 s of the workers'
wall time), 613 + 63 timings, 194 s in all, before FUSE_ACT was in the space; with it (second run, same day; a
cache holding only the GPU tests' kernels): 428 compiled, 792 timings, 172 s with ``--budget-s 200``. FUSE_ACT
adds per point at most 6 timings, 15 where the best tiles are 128 x 128 or larger (8 warps, 4 down to 2 stages),
compiled in the timing process; ``--quick``: ~85 compiled, ~215 timings, ~75 s. With BLOCK_SIZE_M 256, 8-warp
128 x 256 tiles and GROUP_SIZE_M 16 (third and fourth runs, same day, fresh machine): the 9 points of T 128, 1024 and
4096 in 134 s (354 compiled, 542 timings), 4 prefill points in 76 s (171 compiled, 275 timings). Compiling is the larger part;
the points of a shape share compiled kernels when their Triton specialisations agree (T * top_k divisible by 16 or
not), so its T >= 8 points compile little beyond their stage A tiles. ``--plan`` gives the
bounds for other shapes and token counts.

Each time is the median of ``triton.testing.do_bench`` replaying the whole pipeline (sort, GEMM1, activation, GEMM2,
top-k sum) captured in a CUDA graph; do_bench clears L2 before every replay, so weights are read from HBM. Kernels
are compiled ahead in ``--jobs`` worker processes (a problem with the same E, H, I, top_k, T and dtype, whose
weights are one expert's broadcast over E: the same Triton specialisations) into the Triton cache, which the timing
process then reads; set TRITON_CACHE_DIR to a folder kept between calls (e.g. build/triton-cache) to reuse it.

Outputs in ``--out``: ``<GPU>.raw.json`` (every timing, per point; the resume state) and ``<GPU>.json`` (the table
of the finished points, ``"measured": true``, the format of ``expq/kernels/tuned.py``, all eight keys per entry;
copy it to ``expq/kernels/configs/`` to ship it). Both are rewritten after every point. A second run skips finished
points and configs already timed (config ids: ``M16_N64_K128_G1_w4_s4``, with ``_sk4`` / ``_swap`` appended when
SPLIT_K > 1 / SWAP_AB; a raw file of the earlier space resumes as it is: its finished points stay finished).
``--budget-s``: stop starting work after that many seconds of wall time (from the start of the process) and save;
the last line says DONE or INCOMPLETE (run again to resume). Progress goes to stderr.

``--device cpu`` (tests only): Triton's interpreter (TRITON_INTERPRET=1, float16), wall-clock medians; no CUDA.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernel import SHAPES, TOKENS, add_point_args, graph_time, make_routing, make_weights  # noqa: E402, F401

from expq.kernels import moe, moe_reference  # noqa: E402
from expq.kernels import tuned  # noqa: E402

T0 = time.monotonic()
RAW_FORMAT = "expq-moe-tune-raw/1"
SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB of shared memory per block; keep a margin

# The search space (see the module docstring).
TILE_M = (16, 32, 64, 128, 256)
TILE_N = (64, 128)
TILE_N_LARGE = (256,)  # only for T >= LARGE_T
LARGE_T = 1024
TILE_K = (64, 128, 256)
SWAPS = (False, True)
A_WARPS = 4
BIG_ACC = 128 * 256
"""A tile of at least this many fp32 accumulator elements (BLOCK_SIZE_M x BLOCK_SIZE_N) is run with 8 warps only (at
4 its 256 accumulator registers a thread spill), and a larger one not at all (256 x 256: 256 registers a thread at
8 warps). vLLM's bf16 tables for Mixtral and Qwen3 on the H200 use 128 x 256 tiles at 8 warps from 1,024 tokens on."""
A_STAGES = (4, 3, 2)  # stage A: the first (deepest) that fits shared memory
WARPS = (4, 8)
STAGES = (3, 4)
SPLITS = (2, 4, 8)
FINALISTS = 3  # configs re-timed at the end (besides the default), the fastest that pass the accuracy check
CHECK_MAX = 16  # how far down the ranking the accuracy check walks to find them
SPLIT_MAX_PER_EXPERT = 16  # SPLIT_K is tried only for T * top_k / E <= this (decode-sized groups)
QUICK_K = {16: (128,), 32: (128,), 64: (64,), 128: (64,), 256: (64,)}  # --quick: one BLOCK_SIZE_K per BLOCK_SIZE_M
QUICK_SPLITS = (2, 4)

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def cfg_id(c) -> str:
    """``M16_N64_K128_G1_w4_s4``, plus ``_sk<SPLIT_K>`` when SPLIT_K > 1, ``_swap`` with SWAP_AB and ``_fuse`` with
    FUSE_ACT (a config without these keys has the id of SPLIT_K 1, SWAP_AB and FUSE_ACT false: the ids of the
    earlier tuner, whose raw files resume)."""
    sk, swap, fuse = c.get("SPLIT_K", 1), c.get("SWAP_AB", False), c.get("FUSE_ACT", False)
    return (f"M{c['BLOCK_SIZE_M']}_N{c['BLOCK_SIZE_N']}_K{c['BLOCK_SIZE_K']}_G{c['GROUP_SIZE_M']}"
            f"_w{c['num_warps']}_s{c['num_stages']}" + (f"_sk{sk}" if sk != 1 else "") + ("_swap" if swap else "")
            + ("_fuse" if fuse else ""))


def make_cfg(m, n, k, g, w, s, sk=1, swap=False, fuse=False) -> dict:
    return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=g, num_warps=w, num_stages=s,
                SPLIT_K=sk, SWAP_AB=bool(swap), FUSE_ACT=bool(fuse))


def tile_of(c) -> tuple:
    """(BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SWAP_AB): what stage A ranks."""
    return c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], bool(c.get("SWAP_AB", False))


def smem(m, n, k, s) -> int:
    """Shared memory of the software pipeline: per stage an A tile (16-bit) and a B tile (int8), plus one B tile
    converted to 16 bits (without SWAP_AB the converted tile is the MMA's shared-memory operand; with SWAP_AB it is
    a register operand, and the bound is kept)."""
    return s * (m * k * 2 + k * n) + k * n * 2


def tile_fits(m, n) -> bool:
    """The accumulator is at most ``BIG_ACC`` elements."""
    return m * n <= BIG_ACC


def warps_for(m, n, warps) -> tuple:
    """``warps`` without 4 for an accumulator of ``BIG_ACC`` elements (see there)."""
    return tuple(w for w in warps if not (m * n >= BIG_ACC and w < 8))


def group_m(m) -> int:
    return 8 if m >= 64 else 1


def m_allowed(m, per_expert) -> bool:
    """bench_kernel.py --sweep's rule: BLOCK_SIZE_M neither far above the pairs per expert nor far below."""
    return not (m > max(16, 2 * per_expert) or m < min(64, per_expert / 4))


def stage_a(per_expert, tokens, quick) -> list[dict]:
    """The tiles (BLOCK_SIZE_M x N x K) x SWAP_AB at num_warps 4 (8 for ``BIG_ACC`` accumulators), the deepest
    stages that fit, SPLIT_K 1."""
    out = []
    ns = TILE_N + (TILE_N_LARGE if tokens >= LARGE_T and not quick else ())
    for m in TILE_M:
        if not m_allowed(m, per_expert):
            continue
        for n in ns:
            for k in (QUICK_K[m] if quick else TILE_K):
                s = next((s for s in A_STAGES if smem(m, n, k, s) <= SMEM_BYTES), None)
                if s is None or not tile_fits(m, n):
                    continue
                for swap in SWAPS:
                    if swap and m >= tuned.SWAP_AB_MAX_BLOCK_M:  # refused by check_config (see there)
                        continue
                    out.append(make_cfg(m, n, k, group_m(m), 8 if m * n >= BIG_ACC else A_WARPS, s, 1, swap))
    return out


def stage_b(tiles, quick) -> list[dict]:
    """num_warps x num_stages of each (BLOCK_SIZE_M, N, K, SWAP_AB) in ``tiles`` (none with ``quick``); for
    BLOCK_SIZE_M >= 64 also with GROUP_SIZE_M 16 (vLLM's bf16 tables' prefill value: 16 M blocks, an expert's or
    two, walk one N tile before the next)."""
    if quick:
        return []
    out = []
    for m, n, k, swap in tiles:
        for g in (group_m(m),) + ((16,) if m >= 64 else ()):
            for w in warps_for(m, n, WARPS):
                for s in STAGES:
                    if smem(m, n, k, s) <= SMEM_BYTES:
                        out.append(make_cfg(m, n, k, g, w, s, 1, swap))
    return out


FUSE_BIG_TILE = BIG_ACC // 2
"""A fused tile of BLOCK_SIZE_M x BLOCK_SIZE_N holds two fp32 accumulators of that size: from 128 x 128 on that is
``BIG_ACC`` elements, which 4 warps cannot hold (256 registers a thread; at num_stages 4 Triton also asked for 256
KiB of shared memory, the tuner's 2026-12-01 run). Such tiles are tried with 8 warps only, at their num_stages and
each smaller one down to 2; larger ones not at all."""


def stage_fuse(best) -> list[dict]:
    """``best`` (configs with SWAP_AB false) with FUSE_ACT: at the same BLOCK_SIZE_N (gate and up tiles of N columns
    each: twice the weight rows per program) and at half of it (the same weight rows per program as unfused), where
    the doubled B tile fits shared memory; a tile of ``FUSE_BIG_TILE`` elements with num_warps 8 only (see there),
    a larger one not at all."""
    out = []
    for c in best:
        if c.get("SWAP_AB", False):
            continue
        for n in sorted({c["BLOCK_SIZE_N"], c["BLOCK_SIZE_N"] // 2}):
            tile = c["BLOCK_SIZE_M"] * n
            if n < 16 or tile > FUSE_BIG_TILE:
                continue
            fused = dict(c, BLOCK_SIZE_N=n, FUSE_ACT=True)
            if tile < FUSE_BIG_TILE:
                variants = [fused]
            else:
                variants = [dict(fused, num_warps=8, num_stages=st) for st in range(c["num_stages"], 1, -1)]
            out += [v for v in variants
                    if smem(v["BLOCK_SIZE_M"], 2 * n, v["BLOCK_SIZE_K"], v["num_stages"]) <= SMEM_BYTES
                    and v not in out]
    return out


def split_allowed(per_expert) -> bool:
    return per_expert <= SPLIT_MAX_PER_EXPERT


def stage_split(best, intermediate_size, quick) -> list[dict]:
    """``best`` (configs of SPLIT_K 1) with each SPLIT_K > 1 that GEMM2 (K = intermediate_size) can use:
    cdiv(I, BLOCK_SIZE_K) >= SPLIT_K (the kernel clamps a larger one: the same kernel again)."""
    out = []
    for c in best:
        for sk in (QUICK_SPLITS if quick else SPLITS):
            if -(-intermediate_size // c["BLOCK_SIZE_K"]) >= sk:
                out.append(dict(c, SPLIT_K=sk))
    return out


def _spec(tokens, top_k) -> tuple:
    """The Triton specialisations that differ between the points of a shape: T * top_k divisible by 16, == 1."""
    return (tokens * top_k) % 16 == 0, tokens * top_k == 1


def plan(shapes, tokens, quick, refine, default_of=None) -> dict:
    """The size of the search, without timing anything: per point the configs of stage A (exact, the default
    included), at most how many stage B and SPLIT_K add, and per shape at most how many configs are compiled (stage
    A's distinct ids per Triton specialisation, plus the stage-B / SPLIT_K bounds, which differ per point since they
    follow stage A's ranking). ``default_of(t, e, top_k)``: the default config (``get_config``'s) of a point."""
    if default_of is None:
        def default_of(t, e, top_k):
            return moe.get_config(t, e, top_k, "cuda", tuned=False)
    points, shapes_out = [], {}
    for name, (e, _h, i, top_k) in shapes:
        compiled: dict = {}
        extra_b = extra_sk = 0
        for t in tokens:
            per_expert = t * top_k / e
            a = {cfg_id(c): c for c in stage_a(per_expert, t, quick)}
            a.setdefault(cfg_id(default_of(t, e, top_k)), default_of(t, e, top_k))
            tiles = sorted({tile_of(c) for c in a.values()},
                           key=lambda tl: -len({cfg_id(c) for c in stage_b([tl], quick)} - set(a)))[:refine]
            b = len({cfg_id(c) for c in stage_b(tiles, quick)} - set(a))
            sk = 0
            if split_allowed(per_expert):
                best = [make_cfg(tl[0], tl[1], tl[2], 1, 4, 4, 1, tl[3]) for tl in tiles]
                sk = len(stage_split(best, i, quick))
            compiled.setdefault(_spec(t, top_k), set()).update(a)
            extra_b += b
            extra_sk += sk
            points.append(dict(shape=name, tokens=t, per_expert=per_expert, stage_a=len(a), stage_b_max=b,
                               split_k_max=sk, final_max=4))
        shapes_out[name] = dict(compiled_a=sum(len(v) for v in compiled.values()), compiled_b_max=extra_b,
                                compiled_split_k_max=extra_sk)
    timings = sum(p["stage_a"] + p["stage_b_max"] + p["split_k_max"] for p in points)
    return dict(points=points, shapes=shapes_out, search_timings_max=timings,
                final_timings_max=4 * len(points),
                compiled_max=sum(v["compiled_a"] + v["compiled_b_max"] for v in shapes_out.values()),
                compiled_split_k_max=sum(v["compiled_split_k_max"] for v in shapes_out.values()))


def parse_shapes(specs) -> list[tuple[str, tuple]]:
    out = []
    for s in specs:
        if "," in s:
            try:
                e, h, i, k = (int(v) for v in s.split(","))
            except ValueError:
                sys.exit(f"--shapes {s!r}: expected E,H,I,top_k (four integers)")
            if min(e, h, i, k) < 1 or k > e:
                sys.exit(f"--shapes {s!r}: expected positive sizes and top_k <= E")
            out.append((f"E{e}-H{h}-I{i}-k{k}", (e, h, i, k)))
            continue
        hits = [n for n in SHAPES if n.startswith(s)]
        if not hits:
            sys.exit(f"unknown shape {s!r}: one of {list(SHAPES)} (prefix ok) or E,H,I,top_k")
        out += [(n, SHAPES[n]) for n in hits if (n, SHAPES[n]) not in out]
    return out


def print_plan(pl) -> None:
    for q in pl["points"]:
        print(f"{q['shape']} T={q['tokens']} (pairs/expert {q['per_expert']:g}): stage A {q['stage_a']}, "
              f"stage B <= {q['stage_b_max']}, SPLIT_K <= {q['split_k_max']}, final <= {q['final_max']}")
    for name, v in pl["shapes"].items():
        print(f"{name}: compiled: stage A {v['compiled_a']}, stage B <= {v['compiled_b_max']}, "
              f"SPLIT_K (GEMM2 only) <= {v['compiled_split_k_max']}")
    print(f"total: {pl['search_timings_max']} search timings and {pl['final_timings_max']} final ones at most; "
          f"{pl['compiled_max']} configs compiled + {pl['compiled_split_k_max']} SPLIT_K variants at most")


# ------------------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation in worker processes (fills the Triton cache).


def _compile_one(e, h, i, top_k, t, dtype_name, cfg):
    """Run the pipeline once with ``cfg`` on a problem with the timing problem's E, H, I, top_k, T and dtype (the
    Triton specialisations of every kernel, the sort's included) whose weights are one expert's, broadcast over E
    (stride 0: specialised as the real stride, divisible by 16; little memory per worker). Returns (cfg id, error or
    None)."""
    try:
        dtype = getattr(torch, dtype_name)
        w13 = torch.zeros(1, 2 * i, h, dtype=torch.int8, device="cuda").expand(e, 2 * i, h)
        w2 = torch.zeros(1, h, i, dtype=torch.int8, device="cuda").expand(e, h, i)
        s13 = torch.ones(e, 2 * i, device="cuda")
        s2 = torch.ones(e, h, device="cuda")
        x = torch.zeros(t, h, dtype=dtype, device="cuda")
        ti = (torch.arange(t * top_k, device="cuda") % e).reshape(t, top_k).to(torch.int32)
        tw = torch.full((t, top_k), 1.0 / top_k, device="cuda")
        moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg)
        torch.cuda.synchronize()
        return cfg_id(cfg), None
    except Exception as exc:  # noqa: BLE001 - reported; the timing process retries and records the failure
        return cfg_id(cfg), f"{type(exc).__name__}: {str(exc)[:300]}"


class Compiler:
    def __init__(self, jobs):
        self.jobs = jobs
        self.pool = None
        self.done: set = set()
        self.compiled = 0

    def warm(self, e, h, i, top_k, t, dtype_name, cfgs, deadline):
        """Compile the configs not compiled yet for this (E, H, I, top_k, T-specialisation); stop at ``deadline``."""
        if self.jobs <= 0:
            return
        spec = _spec(t, top_k)
        todo = [c for c in cfgs if (e, h, i, top_k, spec, dtype_name, cfg_id(c)) not in self.done]
        if not todo:
            return
        if self.pool is None:
            import multiprocessing as mp

            self.pool = cf.ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn"))
        t1 = time.monotonic()
        futs = [self.pool.submit(_compile_one, e, h, i, top_k, t, dtype_name, c) for c in todo]
        failed = 0
        try:
            for f in cf.as_completed(futs, timeout=max(1.0, deadline - time.monotonic())):
                cid, err = f.result()
                self.done.add((e, h, i, top_k, spec, dtype_name, cid))
                self.compiled += 1
                failed += err is not None
        except cf.TimeoutError:
            for f in futs:
                f.cancel()
            log("compile: budget reached; the rest compiles when timed")
        except Exception as exc:  # noqa: BLE001 - e.g. a worker died (BrokenProcessPool): compile while timing
            log(f"compile workers failed ({type(exc).__name__}: {str(exc)[:200]}); compiling in the timing process "
                f"from now on")
            self.close()
            self.pool, self.jobs = None, 0
        log(f"compiled {len(todo)} configs in {time.monotonic() - t1:.1f}s with {self.jobs} workers "
            f"({failed} failed to compile or run)")

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------------------------------
# Timing and checking.


def cpu_time(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def errors(out, ref):
    diff = out.float() - ref
    ref_norm = ref.norm(dim=1)
    live = ref_norm > 0
    rel = (diff.norm() / ref.norm()).item()
    token = (diff.norm(dim=1)[live] / ref_norm[live]).max().item() if bool(live.any()) else 0.0
    return rel, token


def bounds(dtype):
    u = UNIT_ROUNDOFF.get(dtype)
    return (8 * u, 16 * u) if u else (1e-5, 2e-5)


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path)


def refused(cfg) -> str | None:
    """Why ``check_config`` refuses ``cfg`` today (a raw file may hold configs of an earlier, wider space), or None."""
    try:
        tuned.check_config(cfg)
    except ValueError as exc:
        return str(exc)
    return None


def build_table(raw, base=None) -> dict:
    """The table of ``raw``'s finished points; with ``base`` (a table of this format, e.g. the shipped one) its
    entries too, where this run has no winner (a partial re-tune gives a whole table). Buckets are written as
    integers (a base's "01" is bucket 1); a winner ``check_config`` now refuses is left out."""
    shapes: dict = {}
    for k, v in (base or {}).get("shapes", {}).items():
        shapes[k] = {str(int(t)): tuned.check_config(c) for t, c in v.items()}  # all eight keys, as this run's
    from_base = {(k, t) for k, v in shapes.items() for t in v}
    for p in raw["points"].values():
        if p.get("done") and p.get("winner") and not refused(p["winner"]):
            shapes.setdefault(p["key"], {})[str(p["tokens"])] = tuned.check_config(p["winner"])  # all eight keys
            from_base.discard((p["key"], str(p["tokens"])))
    for k in shapes:
        shapes[k] = dict(sorted(shapes[k].items(), key=lambda kv: int(kv[0])))
    meta = dict(raw["meta"], points=sum(len(v) for v in shapes.values()))
    if base is not None:
        base_meta = base.get("meta")
        meta["base"] = dict(base_meta if isinstance(base_meta, dict) else {}, entries_kept=len(from_base))
    return dict(format=tuned.FORMAT, measured=True, gpu=raw["gpu"], meta=meta, shapes=shapes)


def load_base(path, gpu) -> dict:
    """The ``--base`` table, or exit with one line naming the file and what is wrong."""
    try:
        base = json.loads(Path(path).read_text())
        tuned.parse_table(base)
    except (OSError, ValueError, RecursionError) as exc:
        sys.exit(f"{path}: {exc}")
    if base.get("gpu") != gpu:
        sys.exit(f"{path}: a table for {base.get('gpu')!r}, not {gpu!r}")
    return base


# ------------------------------------------------------------------------------------------------------------------


def main():
    import triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_point_args(ap, shapes_help=f"{list(SHAPES)} (prefix ok) or E,H,I,top_k")
    ap.add_argument("--out", default="build/tune", help="folder of the table and the raw results (resume state)")
    ap.add_argument("--budget-s", type=float, default=math.inf, help="stop starting work after this wall time")
    ap.add_argument("--quick", action="store_true",
                    help="smaller space: one BLOCK_SIZE_K per BLOCK_SIZE_M, 1 refined tile, no num_warps x num_stages")
    ap.add_argument("--refine", type=int, default=2, help="stage-A (tile, SWAP_AB) refined in stage B (quick: 1)")
    ap.add_argument("--rep", type=int, default=20, help="do_bench rep (ms) of the search")
    ap.add_argument("--final-rep", type=int, default=100, help="do_bench rep (ms) of the final re-timing")
    ap.add_argument("--jobs", type=int, default=None, help="compile workers (default: CPU cores - 2, at most 12)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--space", default=None, help=argparse.SUPPRESS)  # tests: JSON list of configs, stage A only
    ap.add_argument("--plan", action="store_true", help="print the size of the search (no GPU needed) and exit")
    ap.add_argument("--base", default=None,
                    help="a table (e.g. expq/kernels/configs/NVIDIA_H200.json) whose entries the written table keeps "
                         "where this run tuned no point: re-tune some points, ship a whole table")
    a = ap.parse_args()
    refine = 1 if a.quick and a.refine == 2 else a.refine
    if a.plan:
        print_plan(plan(parse_shapes(a.shapes), a.tokens, a.quick, refine))
        return

    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("tune_kernel.py needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1, for tests)")
    dtype = getattr(torch, a.dtype) if dev == "cuda" else torch.float16
    dtype_name = str(dtype).removeprefix("torch.")
    deadline = T0 + a.budget_s
    jobs = (min(12, max(0, (os.cpu_count() or 2) - 2)) if a.jobs is None else a.jobs) if dev == "cuda" else 0
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu-interpreter"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    norm = tuned.normalize_gpu_name(gpu)
    raw_path, table_path = out / f"{norm}.raw.json", out / f"{norm}.json"
    meta = dict(tuner="bench/tune_kernel.py", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, started=time.strftime("%Y-%m-%dT%H:%M:%S"), quick=a.quick,
                space="tiles x SWAP_AB; best (tile, SWAP_AB) x num_warps x num_stages; SPLIT_K where decode-sized",
                refine=refine, rep_ms=a.rep, final_rep_ms=a.final_rep,
                timing="do_bench median of CUDA-graph replays, L2 cleared" if dev == "cuda"
                else "wall clock, interpreter")
    try:
        raw = json.loads(raw_path.read_text()) if raw_path.exists() else dict(format=RAW_FORMAT, gpu=gpu, meta=meta,
                                                                              points={})
    except (OSError, ValueError, RecursionError) as exc:
        sys.exit(f"{raw_path}: not readable as this tuner's raw file ({exc}); use another --out")
    if not isinstance(raw, dict) or raw.get("format") != RAW_FORMAT or raw.get("gpu") != gpu:
        sys.exit(f"{raw_path}: not a raw file of this tuner for {gpu!r}; use another --out")
    space = None if a.space is None else json.loads(a.space)
    if a.base is not None:  # kept in the raw file: a resumed run writes the same whole table without --base
        raw["base"] = load_base(a.base, gpu)
    base = raw.get("base")
    if any(t < 1 for t in a.tokens):
        sys.exit(f"--tokens: expected token counts >= 1, got {a.tokens}")
    tokens = list(dict.fromkeys(a.tokens))  # each point once
    for p in raw["points"].values():  # configs of an earlier, wider space that check_config now refuses
        for store in (p.get("timings", {}), p.get("final", {})):
            why = {cid: refused(r["cfg"]) for cid, r in store.items()}
            for cid in [c for c, w in why.items() if w]:
                del store[cid]
                p.setdefault("errors", {})[cid] = f"refused: {why[cid]}"
    shapes = parse_shapes(a.shapes)
    points = [(n, s, t) for n, s in shapes for t in tokens]
    todo = [(n, s, t) for n, s, t in points
            if not raw["points"].get(f"{tuned.shape_key(*s[:3], s[3], dtype)}|T={t}", {}).get("done")]
    log(f"{gpu}; torch {torch.__version__}; triton {triton.__version__}; {dtype_name}; {len(points)} points, "
        f"{len(points) - len(todo)} already done; budget {a.budget_s:.0f}s; compile workers {jobs}")
    compiler = Compiler(jobs)
    stopped = False
    counts = dict(timed=0)

    def save():
        raw["meta"]["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(raw_path, raw)
        write_json(table_path, build_table(raw, base))

    try:
        for name, (e, h, i, top_k) in shapes:
            mine = [t for n, _, t in todo if n == name]
            if not mine or stopped:
                continue
            g = None
            w13, w2, s13, s2, g = make_weights(e, h, i, dev)
            for t in mine:
                if time.monotonic() > deadline:
                    stopped = True
                    break
                key = tuned.shape_key(e, h, i, top_k, dtype)
                pkey = f"{key}|T={t}"
                p = raw["points"].setdefault(pkey, dict(key=key, shape=name, E=e, H=h, I=i, top_k=top_k, tokens=t,
                                                        timings={}, errors={}))
                gen = torch.Generator(device=dev).manual_seed(1000 + t)
                x, tw, ti = make_routing(t, e, h, top_k, dtype, dev, gen)
                per_expert = t * top_k / e
                default = moe.get_config(t, e, top_k, "cuda", tuned=False)

                def run(cfg):
                    return moe.fused_moe_triton(x, w13, w2, s13, s2, tw, ti, config=cfg)

                def measure(cfgs, rep, store):
                    """Time the configs not in ``store`` yet; False when the budget ran out."""
                    cfgs = list({cfg_id(c): c for c in cfgs if cfg_id(c) not in store and cfg_id(c) not in p["errors"]}
                                .values())
                    compiler.warm(e, h, i, top_k, t, dtype_name, cfgs, deadline)
                    for c in cfgs:
                        if time.monotonic() > deadline:
                            return False
                        try:
                            us = graph_time(lambda: run(c), rep) if dev == "cuda" else cpu_time(lambda: run(c))
                        except Exception as exc:  # noqa: BLE001 - out of resources etc.: recorded, skipped
                            p["errors"][cfg_id(c)] = f"{type(exc).__name__}: {str(exc)[:200]}"
                            if dev == "cuda":
                                torch.cuda.synchronize()
                            continue
                        if us is None:
                            p["errors"][cfg_id(c)] = "graph capture failed"
                        else:
                            store[cfg_id(c)] = dict(cfg=c, us=us)
                        counts["timed"] += 1
                    return True

                t_point = time.monotonic()
                all_cfgs = {cfg_id(c): c for c in (space if space is not None else stage_a(per_expert, t, a.quick))}
                all_cfgs.setdefault(cfg_id(default), default)
                if not measure(list(all_cfgs.values()), a.rep, p["timings"]):
                    stopped = True
                    break
                if space is None:
                    # Stage B: the best (tile, SWAP_AB) of stage A (its configs only: the same on a resume).
                    ranked = sorted((p["timings"][k] for k in all_cfgs if k in p["timings"]), key=lambda r: r["us"])
                    tiles = []
                    for r in ranked:
                        if tile_of(r["cfg"]) not in tiles and r["cfg"].get("SPLIT_K", 1) == 1:
                            tiles.append(tile_of(r["cfg"]))
                    tiles = tiles[:refine]
                    if not measure(stage_b(tiles, a.quick), a.rep, p["timings"]):
                        stopped = True
                        break
                    if split_allowed(per_expert):
                        best = []
                        for tile in tiles:
                            rows = [r for r in p["timings"].values()
                                    if tile_of(r["cfg"]) == tile and r["cfg"].get("SPLIT_K", 1) == 1]
                            if rows:
                                best.append(tuned.check_config(min(rows, key=lambda r: r["us"])["cfg"]))
                        if not measure(stage_split(best, i, a.quick), a.rep, p["timings"]):
                            stopped = True
                            break
                    # FUSE_ACT on the best three unfused, untransposed configs so far.
                    ranked = sorted(p["timings"].values(), key=lambda r: r["us"])
                    plain = [tuned.check_config(r["cfg"]) for r in ranked
                             if not r["cfg"].get("SWAP_AB", False) and not r["cfg"].get("FUSE_ACT", False)][:3]
                    if not measure(stage_fuse(plain), a.rep, p["timings"]):
                        stopped = True
                        break
                # Final: the fastest 3 that pass the accuracy check (walking the ranking, at most CHECK_MAX
                # checked) and the default, re-timed longer; the fastest of them wins.
                ref = moe_reference(x, w13, w2, s13, s2, tw, ti)
                rel_b, tok_b = bounds(dtype)
                p.setdefault("checks", {})

                def passes(cfg):
                    cid = cfg_id(cfg)
                    if cid not in p["checks"]:
                        try:
                            rel, tok = errors(run(cfg), ref)
                        except Exception as exc:  # noqa: BLE001 - refused or failed now: not a finalist
                            p["errors"][cid] = f"{type(exc).__name__}: {str(exc)[:200]}"
                            rel = tok = math.nan
                        p["checks"][cid] = dict(rel=rel, token=tok,
                                                ok=math.isfinite(rel) and rel <= rel_b and tok <= tok_b)
                        if not p["checks"][cid]["ok"]:
                            log(f"{name} T={t}: {cid} fails the accuracy check (rel {rel:.3g}, token {tok:.3g})")
                    return p["checks"][cid]["ok"]

                ranked = sorted(p["timings"].values(), key=lambda r: r["us"])
                finalists = {}
                for r in ranked[:CHECK_MAX]:
                    if len(finalists) == FINALISTS:
                        break
                    if passes(r["cfg"]):
                        finalists[cfg_id(r["cfg"])] = r["cfg"]
                if passes(default):
                    finalists.setdefault(cfg_id(default), default)
                del ref
                p.setdefault("final", {})
                if not measure(list(finalists.values()), a.final_rep, p["final"]):
                    stopped = True
                    break
                passed = [r for k, r in p["final"].items() if p["checks"].get(k, {}).get("ok")]
                winner = min(passed, key=lambda r: r["us"]) if passed else None
                d = p["final"].get(cfg_id(default))
                p.update(done=True, winner=None if winner is None else winner["cfg"],
                         winner_us=None if winner is None else winner["us"], default=default,
                         default_us=None if d is None else d["us"], bounds=dict(rel=rel_b, token=tok_b))
                if winner is None:
                    log(f"{name} T={t}: NO config passed the check ({p['checks']}); no table entry")
                else:
                    sp = p["default_us"] / winner["us"] if p["default_us"] else float("nan")
                    log(f"{name} T={t}: {cfg_id(winner['cfg'])} {winner['us']:.1f} us; default "
                        f"{cfg_id(default)} {p['default_us'] or float('nan'):.1f} us ({sp:.2f}x); "
                        f"{len(p['timings'])} timed, {len(p['errors'])} failed; {time.monotonic() - t_point:.0f}s")
                save()
            del w13, w2, s13, s2
            if dev == "cuda":
                torch.cuda.empty_cache()
    finally:
        save()
        compiler.close()
    left = [1 for n, s, t in points
            if not raw["points"].get(f"{tuned.shape_key(*s[:3], s[3], dtype)}|T={t}", {}).get("done")]
    print(f"wrote {table_path} and {raw_path}")
    stats = (f"{compiler.compiled} configs compiled ahead, {counts['timed']} timings, "
             f"{time.monotonic() - T0:.0f}s")
    if left:
        print(f"INCOMPLETE: {len(left)} of {len(points)} points left (budget); run the same command again to resume "
              f"({stats})")
    else:
        print(f"DONE: {len(points)} points ({stats})")


if __name__ == "__main__":
    main()

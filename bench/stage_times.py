"""Where a conversion's time goes, stage by stage: wall and CPU seconds of each pipeline stage, in one process.

    python bench/stage_times.py SRC OUT [--device cpu|cuda|...] [--format auto|compressed-tensors|experts-int8]
                                        [--repeat N] [--no-buffer-pool] [--timeline]

Wraps the pipeline's stage functions (reading a tensor, the scheme on its rows, packing, positional writes, copies
of passthrough tensors, the shard hasher, fsync) with timers, runs ``expq.convert`` and prints, per stage, the
seconds spent inside it summed over calls (wall, and CPU time of the calling thread), the calls, and the process's
total wall and CPU time (start-up imports measured separately, before the conversion). Stages run concurrently in
the pipeline's threads, so the wall seconds of the stages add up to more than the run's wall time; the CPU seconds
say what each stage costs the machine. OUT is removed before each repeat.

The fused CPU kernels (numba) are timed per call too, in the pool threads that run them: CPU seconds and elements of
the scheme's row blocks (codes), the front pass's absmax blocks (no codes), the FP8 block decode's bands, the MXFP4
decode's tiles and the MXFP4 row absmax's tiles (the front pass's scales of an MXFP4 source), so that their cost
*inside the pipeline* reads as CPU ns per element (per core); and the counts of the conversion's buffer pool
(``io.buffers``: buffers mapped, reused).

``--timeline``: when each step of the run happened, in seconds from the call of ``convert``: the read threads taking
each unit (a source shard), the front pass starting each unit, each output shard opened, its last tensor written
(its fsync starting), hashed and recorded, the pipelines returning, the source's identity ready, the side files and
the commit; and every half second how far each open shard's hash has got (the critical path of a run reads off it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import shutil
import sys
import threading
import time

T0 = time.perf_counter()
import torch  # noqa: E402 - timed as start-up

T_TORCH = time.perf_counter() - T0
import expq.api  # noqa: E402
import expq.conversion as conversion  # noqa: E402
import expq.output.outdir as outdir  # noqa: E402
import expq.cpu_kernels as cpu_kernels  # noqa: E402
import expq.formats.compressed_tensors as ct  # noqa: E402
import expq.formats.experts_int8 as ei8  # noqa: E402
import expq.front_pass as front_pass  # noqa: E402
import expq.pipeline as pipeline  # noqa: E402
import expq.output.shards as shards  # noqa: E402
from expq.io import buffers  # noqa: E402

T_IMPORT = time.perf_counter() - T0
ACC: collections.Counter = collections.Counter()
LOCK = threading.Lock()


def timed(owner, name: str, stage: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            with LOCK:
                ACC[(stage, "wall")] += time.perf_counter() - t
                ACC[(stage, "cpu")] += time.thread_time() - c
                ACC[(stage, "calls")] += 1

    setattr(owner, name, wrapper)


def timed_kernel(name: str, elements) -> None:
    """Time ``cpu_kernels.<name>`` per call (CPU time of the calling pool thread) and count its elements;
    ``elements(*args)`` says how many a call computes and under which stage (None: not counted). A kernel that
    this revision of expq does not have is skipped (``PYTHONPATH`` at another revision)."""
    fn = getattr(cpu_kernels, name, None)
    if fn is None:
        return

    def wrapper(*a):
        c = time.thread_time()
        try:
            return fn(*a)
        finally:
            stage, n = elements(*a)
            with LOCK:
                ACC[(stage, "kcpu")] += time.thread_time() - c
                ACC[(stage, "elements")] += n
                ACC[(stage, "kcalls")] += 1

    setattr(cpu_kernels, name, wrapper)


POOLS: list = []
EVENTS: list[tuple[float, str]] = []
RUN_T0 = [0.0]
SHARD_SETS: list = []


def marked(owner, name: str, label, when: str = "end") -> None:
    """Record ``label(*args, result)`` (None: nothing) with the time a call of ``owner.name`` starts or ends."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        if when == "start":
            text = label(*a, None)
            if text:
                EVENTS.append((time.perf_counter() - RUN_T0[0], text))
        r = fn(*a, **k)
        if when == "end":
            text = label(*a, r)
            if text:
                EVENTS.append((time.perf_counter() - RUN_T0[0], text))
        return r

    setattr(owner, name, wrapper)


def timeline() -> None:
    marked(pipeline.Run, "unit_taken", lambda run, r: f"read threads took unit {run.units_taken}")
    marked(pipeline.Run, "wait_taken", lambda run, n, r: f"front pass: the read threads have taken {n} unit(s)")
    marked(shards.ShardSet, "_open", lambda ss, k, r: f"shard {k + 1} opened")
    marked(shards.ShardSet, "_fsync", lambda ss, k, fd, r: f"shard {k + 1}: last tensor written", when="start")
    marked(shards.ShardSet, "_close", lambda ss, k, hs, r: f"shard {k + 1} hashed, synced, recorded")
    marked(expq.api, "run_plan", lambda *a: "pipelines returned")
    marked(conversion.BackgroundIdentity, "wait", lambda *a: "source identity ready")
    marked(conversion, "write_side_files", lambda *a: "side files written")  # called by write_and_commit
    marked(outdir.OutputDir, "commit", lambda *a: "committed")
    init = shards.ShardSet.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        SHARD_SETS.append(self)

    shards.ShardSet.__init__ = keep


class HashProgress:
    """Every ``period`` seconds: how far each open shard's hash has got (percent of the file)."""

    def __init__(self, period: float = 0.5):
        self.period, self.stop = period, threading.Event()
        self.thread = threading.Thread(target=self._run, name="stage-times-hash", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            for ss in list(SHARD_SETS):
                open_ = {k: h for k, h in list(ss._hashes.items()) if k not in ss.closed}
                if open_:
                    EVENTS.append((time.perf_counter() - RUN_T0[0], "hash at " + ", ".join(
                        f"shard {k + 1} {100 * h.pos / h.size:.0f}%" for k, h in sorted(open_.items()))))

    def __enter__(self) -> "HashProgress":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class ThreadCpu:
    """CPU seconds of each thread of the process, sampled every ``period`` seconds while the conversion runs (a
    thread's last fraction of a period before it ends is not seen), summed by thread name (numbers dropped)."""

    def __init__(self, period: float = 0.1):
        self.period, self.last, self.names = period, {}, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stage-times-sampler", daemon=True)

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.ident is None or t is self.thread:
                continue
            try:
                self.last[t] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                self.names[t] = re.sub(r"[_-]?\d+$", "", t.name)
            except (OSError, ProcessLookupError):
                pass

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "ThreadCpu":
        self._sample()
        self.start = dict(self.last)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._sample()

    def by_name(self) -> dict[str, float]:
        out: collections.Counter = collections.Counter()
        for t, v in self.last.items():
            out[self.names[t]] += v - self.start.get(t, 0.0)
        return dict(out.most_common())


def counted_pool(pool_class):
    def make(*a, **k):
        POOLS.append(pool_class(*a, **k))
        return POOLS[-1]
    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--format", default="auto", help="output format (default: the family's)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-buffer-pool", action="store_true",
                    help="every large tensor a fresh allocation, as before the pool (io.buffers.MIN_BYTES unreachable)")
    ap.add_argument("--timeline", action="store_true", help="when each step of the run happened (see above)")
    args = ap.parse_args()
    if args.timeline:
        timeline()
    if args.no_buffer_pool:
        buffers.MIN_BYTES = 1 << 62
    timed(expq.api, "make_plan", "plan (make_plan)")
    timed(ei8, "stock_parameter_sizes", "layer-marker check (in the plan)")
    timed(front_pass.FrontPass, "_main", "front pass thread, start to end")
    timed(pipeline, "read_tensor", "read (readinto)")
    timed(pipeline, "quantize_matrix", "scheme (its CPU time: in 'rest')")
    timed(front_pass.FrontPass, "_job", "front pass (scales, copies)")
    timed(ct, "pack_codes", "pack")
    timed(pipeline._DevicePipeline, "_to_host", "copy back to host")
    timed(front_pass, "copy_bytes", "passthrough copy")
    timed(shards.ShardSet, "write", "positional write")
    timed(shards._ShardHash, "advance", "hash (read back + sha256)")
    timed(shards.os, "fsync", "fsync")
    timed_kernel("quantize_rows_into", lambda w, codes, amax, scales, r0, r1: (
        "kernel: scheme (codes)" if codes is not None else "kernel: absmax (front pass)", (r1 - r0) * w.shape[1]))
    timed_kernel("fp8_block_decode_into", lambda w, s, out, block, e, r0, r1: (
        "kernel: fp8 block decode", (r1 - r0) * w.shape[2]))
    timed_kernel("mxfp4_decode_into", lambda blocks, scales, values, out, e, r0, r1: (
        "kernel: mxfp4 decode", (r1 - r0) * blocks.shape[2] * 32))
    timed_kernel("mxfp4_row_absmax_into", lambda blocks, scales, mags, out, e, r0, r1: (
        "kernel: mxfp4 row absmax (front pass)", (r1 - r0) * blocks.shape[2] * 32))
    buffers.Pool = counted_pool(buffers.Pool)
    print(f"start-up: import torch {T_TORCH:.2f} s, expq {T_IMPORT - T_TORCH:.2f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for i in range(args.repeat):
        shutil.rmtree(args.out, ignore_errors=True)
        ACC.clear()
        POOLS.clear()
        EVENTS.clear()
        SHARD_SETS.clear()
        t, c = time.perf_counter(), time.process_time()
        RUN_T0[0] = t
        with ThreadCpu() as threads, HashProgress() if args.timeline else contextlib.nullcontext():
            rep = expq.api.convert(args.src, args.out, device=args.device, format=args.format)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"run {i + 1}: {rep.bytes_in / 1e9:.2f} GB in, {wall:.2f} s wall, {cpu:.2f} s CPU (process), "
              f"{rep.bytes_in / wall / 1e9:.2f} GB/s")
        print(f"  {'stage':40s} {'wall s':>8s} {'CPU s':>8s} {'calls':>7s}")
        for stage in dict.fromkeys(s for s, k in ACC if k == "calls"):
            print(f"  {stage:40s} {ACC[(stage, 'wall')]:8.2f} {ACC[(stage, 'cpu')]:8.2f} {int(ACC[(stage, 'calls')]):7d}")
        rest = cpu - sum(v for (s, k), v in ACC.items() if k == "cpu")
        print(f"  {'rest: the scheme pool threads, Python':40s} {'':8s} {rest:8.2f}")
        for stage in dict.fromkeys(s for s, k in ACC if k == "kcpu"):
            n = ACC[(stage, "elements")]
            print(f"  {stage:40s} {ACC[(stage, 'kcpu')]:8.2f} CPU s, {int(ACC[(stage, 'kcalls')])} calls, "
                  f"{n / 1e9:.2f} G elements: {ACC[(stage, 'kcpu')] / max(n, 1) * 1e9:.3f} ns/element per core")
        print("  CPU s by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in threads.by_name().items()))
        for p in POOLS:
            print(f"  buffer pool: {p.mapped} buffers mapped ({p.mapped_bytes / 1e9:.2f} GB), {p.reused} reused")
        if args.timeline:
            print("  timeline (s from the call of convert):")
            for when, text in sorted(EVENTS):
                print(f"  {when:7.2f}  {text}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The front pass of a conversion: the outputs that lie in front of a shard's codes (experts-int8: the F32 scales
of every matrix, then the copied and decoded tensors), written ahead of the device pipelines (``pipeline``), so
that the shard's hash follows its codes as they are written instead of waiting for the shard's last job.

``FrontPass`` runs on one thread beside the pipelines and shares the run's claims with them (``pipeline.Run``:
whichever claims a job first writes its front outputs); ``run_copy`` and ``check_decoded`` are the copy and decode
steps both use.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from . import cpu_kernels, parallel
from .errors import NonFiniteError, OutputError, option
from .io.safetensors import TensorInfo, copy_bytes, map_tensor, read_tensor
from .plan import Job, JobKind, OutTensor, Plan, Slice
from .scheme import CPU_BLOCK_ELEMS, canonical_nan_, matrix_scales, scales_from_absmax

if TYPE_CHECKING:
    from .output.shards import ShardSet
    from .pipeline import Run


class Halt(Exception):
    """The run is stopping (an interrupt, or another stage failed)."""


def front_outputs(plan: Plan, jobs: list[tuple[int, Job]]) -> dict[int, list[OutTensor]]:
    """The outputs written ahead of the pipelines (``FrontPass``), by job index: those that lie in front of the
    routed-expert codes of their shard and that the run can produce cheaply. In experts-int8 a shard lays out its
    4-byte tensors (the F32 scales of every matrix), then its 2-byte ones (the copied and decoded tensors), then the
    int8 codes; in compressed-tensors the packed codes come first and nothing needs to go ahead.

    * a quantize job: each matrix's outputs in front of its largest one (the scales; computed at run time);
    * a copy or decode job: its output, where it lies in front of the last codes of its shard.
    """
    bulk: dict[int, int] = {}  # shard -> offset of its last codes tensor
    for _, j in jobs:
        if j.kind is JobKind.QUANTIZE:
            for g in j.groups:
                big = max(g, key=lambda o: o.nbytes)
                bulk[big.shard] = max(bulk.get(big.shard, -1), big.offset)
    out: dict[int, list[OutTensor]] = {}
    for i, j in jobs:
        if j.kind is JobKind.QUANTIZE:
            front = [o for g in j.groups for o in g if o is not max(g, key=lambda o: o.nbytes) and o.value is None
                     and o.offset < max(g, key=lambda o: o.nbytes).offset]
        else:
            front = [o for o in j.outputs if o.offset < bulk.get(o.shard, -1)]
        if front:
            out[i] = front
    return out


LOOKAHEAD_SHARDS = 2
"""How far the front pass may run ahead of the read threads: this many output shards' worth of source bytes (at
most ``max_shard_size`` each), bounded by a quarter of the memory available (``lookahead_bytes``). A shard's hash
reads it front to back and its front (experts-int8's scales) holds every matrix of the shard: the sooner the front
is written, the sooner the hash follows the codes as they land, instead of hashing the shard after its last codes.
What the front pass reads stays in the page cache for the read threads when it is this close."""


def lookahead_bytes(plan: Plan) -> int:
    """Source bytes the front pass may read ahead of the read threads (``LOOKAHEAD_SHARDS``)."""
    return max(0, min(LOOKAHEAD_SHARDS * plan.max_shard_size, memory_available() // 4))


def memory_available() -> int:
    """Bytes of memory available to new work (``MemAvailable``: free plus what the page cache can give back), or
    the free physical memory where ``/proc/meminfo`` is not there."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def units_ahead(units: list[list[tuple[int, Job]]], ahead: int) -> list[int]:
    """For each unit ``k``: how many units the read threads must have taken before the front pass starts it: the
    fewest such that the units not yet taken, up to ``k``, hold at most ``ahead`` source bytes; ``k`` at most (the
    front pass reads unit ``k`` while the read threads are on unit ``k - 1`` or later, whatever its size)."""
    sizes = [sum(j.tensor.nbytes_stored for _, j in u) for u in units]
    out = []
    for k in range(len(units)):
        n, held = k, sizes[k]
        while n > 0 and held + sizes[n - 1] <= ahead:
            n -= 1
            held += sizes[n]
        out.append(n)
    return out


FRONT_WRITE_BYTES = 4 << 20
"""The most bytes of front outputs that lie back to back written with one system call (``FrontPass._put``). Each
positional write into a shard the pipelines are writing too takes the file's lock: on the 2-core runner the front
pass's 384 scale writes of a Qwen3 layer (3 KB each) took 2.4 s of its 8.3, one at a time."""

OWN_POOL_MIN_ELEMS = 16 * CPU_BLOCK_ELEMS
"""The smallest slice whose scales a GPU run's front pass spreads over its own pool by row blocks
(``scheme.CPU_BLOCK_ELEMS``, one per thread of a 16-core host). Below it, handing one matrix's blocks to the pool and
waiting for them costs more than computing them on one thread (measured on the 2-core runner: 0.26 against 0.48 ms
for a Qwen3 expert matrix, 768 x 2048, and 0.58 against 1.00 ms for 2048 x 2048): smaller slices go to the pool
whole, many at a time (``FRONT_BATCH_ELEMS``). Per-expert families, whose matrices are small, run this way, and
their front pass goes through thousands of them."""

FRONT_BATCH_ELEMS = 64 * CPU_BLOCK_ELEMS
"""The most elements of small slices (under ``OWN_POOL_MIN_ELEMS``, of a float source) whose scales a GPU run's
front pass hands to its own pool at once, one slice per task, before it writes their outputs in order. One at a
time, the front pass of a per-expert family ran at about the speed of the pipelines (the H200, Qwen3 shape: 8.2 s
for 4,608 matrices beside pipelines of 11 s, 6.2 CPU s of it on the one thread), so that a shard's hash could not
start until 4.5 s into the run; over the pool it keeps the lead that lets the hash follow the codes. Not on a CPU
run: there the pool is the pipelines' own, and batches taken first (``parallel.first``) held both cores of the
2-core runner for the front pass while the pipelines waited (OLMoE: the first unit's codes 49 s in)."""


FRONT_POOL_THREADS = 4
"""The most threads of a GPU run's front-pass pool (``FrontPass._own``; fewer on a host with fewer cores). The front
pass only has to keep ahead of the pipelines, and its threads share the cores, the GIL and the page cache with them.
With one thread per core (16 on the H200 host) the pipelines' first unit of a Qwen3 shape took 6.3 s against 3.7 s
with the front pass on one thread. Measured on the H200 in one call (Qwen3 shape, 12 layers, experts-int8, median
of 3): 4 threads, reading its slices (``_read_small``), 19.06 s for the process and 13.95 s inside the conversion,
against 20.28 s and 14.70 s with 16 threads mapping them; 2 threads 18.53 s against 18.72 s for 4, level."""

_front_reads = threading.local()  # per pool thread: the buffers its small slices are read into (``_read_small``)


def _read_small(root, infos: list[TensorInfo]) -> dict[TensorInfo, torch.Tensor]:
    """The stored tensors of a small slice, read (``read_tensor``) into this thread's buffers, one per part, kept for
    its next slice: no mapping set up and torn down per tensor by several threads at once (a ``munmap`` takes the
    process's memory-map lock, which every thread's page faults take too, and flushes the mapping from the other
    cores)."""
    bufs = getattr(_front_reads, "bufs", None)
    if bufs is None:
        bufs = _front_reads.bufs = []
    out = {}
    for k, info in enumerate(infos):
        if k == len(bufs):
            bufs.append(torch.empty(0, dtype=torch.uint8))
        if bufs[k].numel() < info.nbytes:
            bufs[k] = torch.empty(info.nbytes, dtype=torch.uint8)
        out[info] = read_tensor(root, info, into=bufs[k])
    return out


class FrontPass:
    """Writes the front of every shard (``front_outputs``: the scales, the copied and the decoded tensors of an
    experts-int8 shard) ahead of the pipelines, so that each shard's hash follows its codes from memory as they are
    written, instead of waiting for the shard's last job and reading the whole shard back at the end.

    One thread for the run; what it computes goes to the front of the pool's queue (``parallel.first``: the shards'
    hashes wait for it, and it is small: one read of each value); on a GPU run, which has no CPU pool, the CPU
    scales of a slice of ``OWN_POOL_MIN_ELEMS`` or more go over a pool of its own (up to ``FRONT_POOL_THREADS``,
    ``parallel.local``), and so do its small slices, many at a time (``_run_batch``). It goes through the units in the order the pipelines take them (within a unit, in the order
    the outputs lie in the shards), ahead of the read threads by at most ``lookahead_bytes`` of source (so that what
    it maps is still in the page cache when they read it), and by one unit at least. For each job it claims first
    (``Run.claim``: a pipeline that claims a job first writes all of it itself; where the front pass claimed it,
    the pipeline skips these outputs):

    * a copy job: copied (``copy_bytes``); a decode job: decoded and written;
    * a quantize job, slice by slice (``plan.Slice``: a stacked tensor's runs of experts): its stored tensors mapped
      (``io.safetensors.map_tensor``: no copy), decoded if stored quantized, the row absmax and the scales taken
      (``scheme.matrix_scales``: the bits ``quantize_matrix`` gives), and the format's encoding of those scales
      written.

    Where it computes: on the CPU for tensors stored in a float dtype when the fused kernels are there (a single
    read of the values) and for quantized ones whose decoder offers the row absmax (``Decoder.row_absmax``: the FP8
    block and MXFP4 decoders, one read of the bytes), else on the first GPU of the run if there is one, else the
    CPU. Not used with a source feeder (``--stream``: files arrive one window at a time).
    """

    def __init__(self, run: Run, units: list[list[tuple[int, Job]]], devices: list[torch.device]):
        self.run, self.units = run, units
        self.gpu = next((d for d in devices if d.type == "cuda"), None)
        self._ahead = units_ahead(units, lookahead_bytes(run.plan))
        self._own: parallel.Pool | None = None  # a GPU run's pool for the front pass's CPU scales (``_main``)
        self._pending: list[tuple[OutTensor, torch.Tensor]] = []  # back to back in a shard, not yet written (``_put``)
        self._batch: list[tuple[Job, Slice, set[str]]] = []  # small slices claimed, not yet computed (``_run_batch``)
        self._batch_elems = 0
        self.thread = threading.Thread(target=self._main, name="expq-front", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        while self.thread.is_alive():
            self.thread.join(0.1)

    def _main(self) -> None:
        # a GPU run has no CPU pool (``pipeline.cpu_threads``): the scales this pass takes on the CPU (the fused
        # absmax of a float source, a quantized source's row absmax) get one of their own, this thread's only
        own = self._own = parallel.Pool(min(parallel.usable_cores(), FRONT_POOL_THREADS), "expq-front") \
            if self.gpu is not None and parallel.pool() is None else None
        try:
            if self.gpu is not None:
                torch.cuda.set_device(self.gpu)
            with torch.cuda.stream(torch.cuda.Stream(self.gpu)) if self.gpu is not None else nullcontext(), \
                    own or nullcontext(), parallel.local(own), parallel.first():
                for k, unit in enumerate(self.units):
                    if self._ahead[k] > self.run.units_taken:  # about to wait: what is done goes out first
                        self._run_batch()
                        self._flush()
                    self.run.wait_taken(self._ahead[k])
                    front = self.run.front
                    # in the order the outputs lie in the shards: the hashes pass them in that order
                    for index, job in sorted((ij for ij in unit if ij[0] in front),
                                             key=lambda ij: min((o.shard, o.offset) for o in front[ij[0]])):
                        if self.run.halted():
                            raise Halt
                        if index in self.run.front and self.run.claim(index, "front"):
                            self._job(index, job)
                self._run_batch()
                self._flush()
        except Halt:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.run.fail(e)

    def _device(self, job: Job) -> torch.device:
        if self.gpu is None or (not job.tensor.decoded and cpu_kernels.active() == "numba"):
            return torch.device("cpu")
        return self.gpu

    def _job(self, index: int, job: Job) -> None:
        run, plan, src = self.run, self.run.plan, job.tensor
        device = self._device(job)
        front = {o.name for o in run.front[index]}
        if self._own is not None and job.kind is JobKind.QUANTIZE and device.type == "cpu" and not src.decoded and \
                all(math.prod(p.tensor.shape) < OWN_POOL_MIN_ELEMS for p in job.slices):
            for piece in job.slices:  # computed with others over the pool, written in order (``_run_batch``)
                self._batch.append((job, piece, front))
                self._batch_elems += math.prod(piece.tensor.shape)
            if self._batch_elems >= FRONT_BATCH_ELEMS:
                self._run_batch()
            return
        self._run_batch()  # what lies before this job's outputs goes out first
        if job.kind is not JobKind.QUANTIZE:  # written at once, in the order the outputs lie: the run before first
            self._flush()
        if job.kind is JobKind.COPY:
            run_copy(plan, job, run.shards)
            return
        if job.kind is JobKind.DECODE:
            parts = {p: map_tensor(plan.source.root, p) for p in src.parts}
            t = plan.source.decoder.decode(src, parts.__getitem__, device=None if device.type == "cpu" else device) \
                if src.decoded else parts[src.stored]
            parts.clear()
            check_decoded(job, t, run.allow_nonfinite)
            run.shards.write(job.outputs[0], t.cpu())
            return
        for piece in job.slices:  # a stacked tensor slice by slice: what is mapped and computed stays bounded
            if self.run.halted():
                raise Halt
            # a slice of fewer than OWN_POOL_MIN_ELEMS: on this thread (its own pool costs more than it gives)
            small = self._own is not None and math.prod(piece.tensor.shape) < OWN_POOL_MIN_ELEMS
            with parallel.local(None) if small else nullcontext():
                for o, x in self._slice(job, piece, device, front):
                    self._put(o, x)

    def _run_batch(self) -> None:
        """Compute the scales of the small slices gathered in ``_batch`` over the front pass's own pool (a GPU
        run's), one slice per task (each computed whole on its worker: ``whole``), then write their front outputs in
        the order they lie."""
        batch, self._batch, self._batch_elems = self._batch, [], 0
        if not batch:
            return
        if self.run.halted():
            raise Halt
        cpu = torch.device("cpu")
        done: list = [None] * len(batch)

        def task(i: int) -> None:
            job, piece, front = batch[i]
            done[i] = self._slice(job, piece, cpu, front, whole=True)

        parallel.each(task, range(len(batch)))
        for outputs in done:
            for o, x in outputs:
                self._put(o, x)

    def _slice(self, job: Job, piece: Slice, device: torch.device, front: set[str],
               whole: bool = False) -> list[tuple[OutTensor, torch.Tensor]]:
        """The front outputs of one slice of a quantize job, in the order they lie: its matrices' scales, encoded
        by the format (CPU tensors). ``whole``: the scales of a float slice on this thread, not by row blocks over
        the pool (a task of ``_run_batch``), its stored tensors read into the thread's buffers (``_read_small``)."""
        plan, src = self.run.plan, piece.tensor
        parts = _read_small(plan.source.root, list(src.parts)) if whole else \
            {p: map_tensor(plan.source.root, p) for p in src.parts}
        # a quantized source's scales from the decoder's row absmax wherever it offers it (one read on the CPU's
        # fused kernels: cheaper than moving and decoding the tensor on a GPU that the pipelines decode it on again)
        scales = self._decoded_scales(piece, parts)
        if scales is not None:
            device = torch.device("cpu")
        else:
            t = plan.source.decoder.decode(src, parts.__getitem__, device=None if device.type == "cpu" else device) \
                if src.decoded else parts[src.stored]
            parts.clear()
            w = piece.expert.to_rows(t.to(device).to(plan.compute_dtype)).contiguous()
            del t
            scales = matrix_scales(w, block_elems=w.numel() if whole else None)
            del w
        del parts
        # the codes: not part of the front
        stub = torch.zeros(1, dtype=torch.int8, device=device).expand(len(scales), piece.expert.matrices[0].cols)
        out = []
        for group, tensors in zip(job.groups_of(piece), plan.format.encode(stub, scales, piece.expert.matrices)):
            outs = [o for o in group if o.value is None]
            out += [(o, x.cpu()) for o, (_, x) in zip(outs, tensors) if o.name in front]
        return out

    def _put(self, out: OutTensor, x: torch.Tensor) -> None:
        """Write ``out`` with the front outputs that lie right before it in its shard (``ShardSet.write_run``: one
        system call for a run of small scales, up to ``FRONT_WRITE_BYTES``); ``_flush`` writes the run."""
        if self._pending:
            first, last = self._pending[0][0], self._pending[-1][0]
            if out.shard != last.shard or out.offset != last.offset + last.nbytes or \
                    out.offset + out.nbytes - first.offset > FRONT_WRITE_BYTES:
                self._flush()
        self._pending.append((out, x))

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self.run.shards.write_run([o for o, _ in pending], [x for _, x in pending])

    def _decoded_scales(self, piece: Slice, parts: dict) -> torch.Tensor | None:
        """The scales of a quantize job's slice stored quantized, from the decoder's row absmax
        (``Decoder.row_absmax``: the FP8 block and the MXFP4 decoders read each byte once and write no decoded
        tensor) over the dimension along which the matrices' rows run (``ExpertTensor.row_dim``), where the decoder
        offers it for that dimension; else None (the caller decodes).

        The same bits as ``matrix_scales`` of the decoded rows in the compute dtype: the conversion from bf16 to the
        compute dtype is monotonic in magnitude (exact to fp32; to fp16 rounded to nearest even, overflowing to
        inf; NaN stays NaN), so the absmax of the converted row is the converted absmax; then the same scale
        arithmetic (``scales_from_absmax``) and NaN stored canonical."""
        src, et = piece.tensor, piece.expert
        dim = et.row_dim(src.shape)
        if not src.decoded or dim is None:
            return None
        row_absmax = getattr(self.run.plan.source.decoder, "row_absmax", None)  # (a decoder registered before it)
        amax = row_absmax(src, parts.__getitem__, dim) if row_absmax is not None else None
        if amax is None:
            return None
        amax = et.to_rows(amax)[:, 0].to(self.run.plan.compute_dtype)
        return canonical_nan_(scales_from_absmax(amax))


def run_copy(plan: Plan, job: Job, shards: ShardSet) -> None:
    out = job.outputs[0]
    t = shards.target(out)
    if t is None:  # its shard was finished by an earlier run
        return
    fd, pos = t
    try:
        copy_bytes(plan.source.root, job.tensor.stored, fd, pos)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror or e}", file=plan.shard_names[out.shard],
                          tensor=out.name) from None
    shards.done(out)


def check_decoded(job: Job, t: torch.Tensor, allow_nonfinite: bool) -> None:
    if t.is_floating_point() and not allow_nonfinite and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        parts = ", ".join(p.name for p in job.tensor.parts[1:]) or "its stored values"
        raise NonFiniteError(f"decodes to {bad} NaN/infinite values (from {parts}); the source is corrupt",
                             file=job.tensor.file, tensor=job.tensor.name,
                             hint=f"pass {option('allow_nonfinite')} to write it anyway")

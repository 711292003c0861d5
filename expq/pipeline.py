"""Executing a plan: source tensors through one pipeline per device into the output shards, with bounded memory.

Work is handed out by source shard (a *unit*: the jobs whose main tensor lives in that file) to whichever device
pipeline is free: in file order with one device, the largest first with several. A pipeline is three threads joined by bounded queues, so that reading, computing
and writing overlap:

* **read**: the stored bytes of the next job, one ``readinto`` of each tensor's whole span (into pinned host memory
  when the device is a GPU); a stacked expert tensor larger than ``plan.SLICE_BYTES`` goes through the three stages
  slice by slice (``plan.Slice``: runs of whole experts, only their stored bytes read), so that what one job holds
  does not grow with the number of experts; a byte budget (``PIPELINE_BYTES``) caps what is read ahead and not yet
  written;
* **compute**: decode (quantized source tensors, on the pipeline's device), cast to the compute dtype on the device
  and run the experts_int8 scheme on every row of every routed-expert matrix of the tensor
  (``scheme.quantize_matrix``: row blocks over the thread pool on a CPU; on a GPU asynchronous copies on the
  pipeline's own stream and one synchronisation per tensor), then the format's ``encode``; outputs come back to
  pinned host buffers;
* **write**: positional writes at the offsets the plan fixed (``copy_file_range`` for copied tensors); the shard
  hasher follows the written prefix, so a shard is hashed, fsync'd and journaled as soon as its last byte lands.

Within a unit, jobs run in the order their largest outputs lie in the output file, so shards fill front to back.
Where a shard lays out small tensors in front of its codes (experts-int8: the F32 scales of every matrix, then the
copied and decoded tensors, then the int8 codes), a **front pass** (``FrontPass``) writes them ahead of the
pipelines (the scales from one read of each value), so that the shard's hash follows its codes as they are written
instead of waiting for the shard's last job and reading the whole shard back.
The output bytes do not depend on the number of devices, their kind or their order.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from . import parallel
from .errors import NonFiniteError, option
from .interrupts import StopSignal
from .io import buffers
from .io.safetensors import DTYPE_BITS, TORCH_DTYPES, TensorInfo, read_tensor
from .plan import Job, JobKind, OutTensor, Plan, Slice
from .scheme import quantize_matrix
from .front_pass import FrontPass, Halt, check_decoded, front_outputs, run_copy
from .output.shards import ShardSet

MAX_LISTED_ROWS = 20
PIPELINE_BYTES = 1 << 30
"""Bytes one device pipeline holds at most: source tensors read ahead plus outputs not yet written (a single tensor
larger than this goes through alone). Peak memory is about this per device plus the tensor being computed."""
QUEUE_DEPTH = 2
"""Jobs waiting between two stages of a pipeline."""
BUFFER_POOL_FREE = 512 << 20
"""A CPU conversion's large host tensors (bytes read, decoded weights, codes) come from one pool of buffers
(``io.buffers``) that keeps at most this many bytes of buffers nobody holds: reused, they fault no pages."""


class SourceFeeder(Protocol):
    """Makes the source's files available to the pipeline as it needs them, and takes them back when it is done with
    them (``--stream``: downloaded a few shards ahead, deleted once converted). Without a feeder every file is
    already under ``plan.source.root``.

    The pipeline calls ``start`` once, from the thread that runs ``run_plan``, before any read; ``wait`` and ``done``
    from its worker threads; ``close`` once at the end, whatever happened (also after an error or an interrupt).
    """

    def start(self, files: list[str]) -> None:
        """``files`` (paths relative to the source root) are the ones the jobs still to run read, in the order the
        pipeline will first need them (files of shards an earlier run finished are not listed)."""
        ...

    def wait(self, file: str) -> None:
        """Return once ``file`` is complete under the source root (raises an ``ExpqError`` if it cannot be had)."""
        ...

    def done(self, file: str) -> None:
        """Every job that reads ``file`` has written its outputs: the file is not read again by this run."""
        ...

    def close(self) -> None:
        """The run is over (finished, failed or interrupted): stop any background work."""
        ...


@dataclass
class RowNote:
    """A notable row: where it is (source tensor, layer, expert, projection, row of that matrix)."""

    tensor: str
    layer: int
    expert: int
    proj: str
    row: int

    def __str__(self) -> str:
        return f"{self.tensor} layer {self.layer} expert {self.expert} {self.proj} row {self.row}"


@dataclass
class RunStats:
    """What running the plan found: counts of zero / underflow / non-finite rows, with the first few located.

    ``by_job`` holds each quantize job's own findings (job index -> JSON-ready dict), so that a resumed run adds up
    exactly what a run from scratch would (the aggregates are made in job order by ``finish``).
    """

    zero_rows: int = 0
    underflow_rows: int = 0
    nonfinite_rows: int = 0
    underflow_examples: list[RowNote] = field(default_factory=list)
    nonfinite_examples: list[RowNote] = field(default_factory=list)
    jobs_by_device: dict[str, int] = field(default_factory=dict)
    by_job: dict[int, dict] = field(default_factory=dict)
    peak_bytes_in_flight: dict[str, int] = field(default_factory=dict)  # device -> most bytes its pipeline held

    def finish(self) -> "RunStats":
        """Add up ``by_job`` in job order (deterministic whatever the devices and the resumes)."""
        self.zero_rows = self.underflow_rows = self.nonfinite_rows = 0
        self.underflow_examples, self.nonfinite_examples = [], []
        for k in sorted(self.by_job):
            r = self.by_job[k]
            self.zero_rows += r["zero"]
            self.underflow_rows += r["underflow"]
            self.nonfinite_rows += r["nonfinite"]
            for kind, dst in (("underflow_examples", self.underflow_examples),
                              ("nonfinite_examples", self.nonfinite_examples)):
                dst += [RowNote(*n) for n in r[kind][: MAX_LISTED_ROWS - len(dst)]]
        return self


@dataclass
class _Item:
    """One job, or one slice of a quantize job, on its way through a pipeline: what it holds at each stage."""

    index: int
    job: Job
    cost: int  # bytes charged to the pipeline's budget until written
    piece: Slice | None = None  # a quantize job's slice (the others: None)
    last: bool = True  # the job's last item: the job is done once it is written
    parts: dict[TensorInfo, torch.Tensor] | None = None  # stored tensors read (read stage)
    writes: list[tuple[OutTensor, torch.Tensor]] = field(default_factory=list)  # host tensors to write (compute)
    rows_found: dict | None = None
    front_done: bool = False  # the front pass writes this job's front outputs (``FrontPass``)


class _Budget:
    """Bytes in flight in one pipeline: ``acquire`` blocks while the budget is full (one item always gets in)."""

    def __init__(self, limit: int, halted: Callable[[], bool]):
        self.limit, self.used, self.peak = limit, 0, 0
        self.halted = halted
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            while self.used and self.used + n > self.limit:
                if self.halted():
                    raise Halt
                self.cond.wait(0.1)
            self.used += n
            self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class Run:
    """What the pipelines of one ``run_plan`` share: the plan, the shards, the unit queue, the stop flags, the
    findings, and the per-file reader counts for the feeder."""

    def __init__(self, plan: Plan, shards: ShardSet, stats: RunStats, allow_nonfinite: bool, stop: StopSignal,
                 feeder: SourceFeeder | None, on_progress: Callable[[int, int], None] | None):
        self.plan, self.shards, self.stats = plan, shards, stats
        self.allow_nonfinite, self.stop, self.feeder, self.on_progress = allow_nonfinite, stop, feeder, on_progress
        self.failed = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.units: queue.SimpleQueue = queue.SimpleQueue()
        self.readers: dict[str, int] = {}
        # the front pass (``FrontPass``): job index -> its front outputs; the jobs claimed (by the front pass or a
        # pipeline: whoever claims a job first writes its front outputs); units the read threads have taken
        self.front: dict[int, list[OutTensor]] = {}
        self.claimed: dict[int, str] = {}
        self.units_taken = 0
        self.taken = threading.Condition()

    def halted(self) -> bool:
        """The run stops: a signal, a stage failed, or a check the plan left running found a problem."""
        return self.stop.is_set() or self.failed.is_set() or self.plan.checks_failed()

    def fail(self, e: BaseException) -> None:
        """A stage failed with ``e``: every pipeline stops. An error after the stop signal is its consequence (a
        worker cut short, e.g. in a first import), not the run's outcome: the run reports the interrupt, and only an
        error that came before the signal wins over it."""
        with self.lock:
            if not self.stop.is_set():
                self.errors.append(e)
        self.failed.set()

    def put(self, q: queue.Queue, x) -> None:
        while True:
            try:
                return q.put(x, timeout=0.1)
            except queue.Full:
                if self.halted():
                    raise Halt from None

    def get(self, q: queue.Queue):
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                if self.halted():
                    raise Halt from None

    def unit_taken(self) -> None:
        with self.taken:
            self.units_taken += 1
            self.taken.notify_all()

    def wait_taken(self, n: int) -> None:
        """Block until the read threads have taken ``n`` units (or the run stops: ``Halt``)."""
        with self.taken:
            while self.units_taken < n:
                if self.halted():
                    raise Halt
                self.taken.wait(0.1)

    def claim(self, index: int, who: str) -> bool:
        """Claim job ``index``'s front outputs for ``who`` ("front" or "pipeline"); False if already claimed."""
        with self.lock:
            if index in self.claimed:
                return False
            self.claimed[index] = who
            return True

    def job_done(self, job: Job) -> None:
        if self.feeder is None:
            return
        for f in {p.file for p in job.tensor.parts}:
            with self.lock:
                self.readers[f] -= 1
                last = self.readers[f] == 0
            if last:
                self.feeder.done(f)


_END = object()


class _DevicePipeline:
    """Read, compute and write threads for one device (see the module docstring)."""

    def __init__(self, run: Run, device: torch.device):
        self.run, self.device = run, device
        self.cuda = device.type == "cuda"
        self.budget = _Budget(PIPELINE_BYTES, run.halted)
        self.read_q: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self.write_q: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self.count = 0
        self.stream = None
        self.partial: dict[int, dict] = {}  # job index -> row findings of the slices computed so far (compute)
        self.threads = [threading.Thread(target=self._stage, args=(fn,), name=f"expq-{fn.__name__[1:]}-{device}",
                                         daemon=True) for fn in (self._read, self._compute, self._write)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            while t.is_alive():  # a timed join, so that the main thread runs signal handlers promptly
                t.join(0.1)

    def _stage(self, fn) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            fn()
        except Halt:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.run.fail(e)

    # --- read ------------------------------------------------------------------------------------------------------
    def _read(self) -> None:
        run = self.run
        while not run.halted():
            try:
                unit = run.units.get_nowait()
            except queue.Empty:
                break
            run.unit_taken()
            for index, job in unit:
                self._read_job(index, job)
        run.put(self.read_q, _END)

    def _read_job(self, index: int, job: Job) -> None:
        """Hand one job to the compute stage: one item, or one per slice of a quantize job (``Job.slices``), each
        holding only its own stored bytes and charged for those and its outputs."""
        run = self.run
        pieces = job.slices or (None,)
        front_done = False
        for k, piece in enumerate(pieces):
            src = piece.tensor if piece is not None else job.tensor
            outs = job.outputs if piece is None else [o for g in job.groups_of(piece) for o in g]
            item = _Item(index, job, cost=0 if job.kind is JobKind.COPY else
                         src.nbytes_stored + sum(o.nbytes for o in outs), piece=piece, last=k == len(pieces) - 1)
            self.budget.acquire(item.cost)
            if k == 0 and run.feeder is not None:
                for f in dict.fromkeys(p.file for p in job.tensor.parts):
                    run.feeder.wait(f)
            if run.halted():
                raise Halt
            if k == 0:
                front_done = index in run.front and not run.claim(index, "pipeline")
            item.front_done = front_done
            if job.kind is JobKind.QUANTIZE or (job.kind is JobKind.DECODE and not item.front_done):
                item.parts = {p: read_tensor(run.plan.source.root, p, pinned=self.cuda) for p in src.parts}
            run.put(self.read_q, item)

    # --- compute ---------------------------------------------------------------------------------------------------
    def _compute(self) -> None:
        run = self.run
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
        while (item := run.get(self.read_q)) is not _END:
            job = item.job
            with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                if job.kind is JobKind.DECODE and not item.front_done:
                    t = self._logical(item)
                    check_decoded(job, t, run.allow_nonfinite)
                    item.writes = [(job.outputs[0], self._to_host(t))]
                    if self.cuda:
                        self.stream.synchronize()
                elif job.kind is JobKind.QUANTIZE:
                    self._quantize(item)
            item.parts = None
            run.put(self.write_q, item)
        run.put(self.write_q, _END)

    def _logical(self, item: _Item) -> torch.Tensor:
        src = item.piece.tensor if item.piece is not None else item.job.tensor
        if not src.decoded:
            return item.parts[src.stored]
        device = self.device if self.cuda else None
        return self.run.plan.source.decoder.decode(src, item.parts.__getitem__, device=device)

    def _quantize(self, item: _Item) -> None:
        plan, job, piece = self.run.plan, item.job, item.piece
        et = piece.expert
        t = self._logical(item)
        w = et.to_rows(t.to(self.device, non_blocking=True))
        del t
        if self.cuda or (w.dtype == plan.compute_dtype and w.is_contiguous()):
            w = w.to(plan.compute_dtype).contiguous()
        else:  # the cast and the copy of a CPU tensor in one pass, into a buffer of the pool
            w = buffers.empty(w.shape, plan.compute_dtype).copy_(w)
        codes, scales, rep = quantize_matrix(w)
        del w
        found = self._job_found_so_far(item, _rows_found(job, piece, rep))
        if item.last:
            item.rows_found = found
        else:
            self.partial[item.index] = found
        if found["nonfinite"] and not self.run.allow_nonfinite:
            if item.last:  # the whole tensor's count, as when it is taken whole
                raise _nonfinite_error(job, found, plan)
            return  # nothing written: the job fails at its last slice
        encoded = plan.format.encode(codes, scales, et.matrices)
        del codes
        for group, tensors in zip(job.groups_of(piece), encoded):
            outs = [o for o in group if o.value is None]
            if [s.name for s, _ in tensors] != [o.name for o in outs]:
                raise RuntimeError(f"internal: the format returned {[s.name for s, _ in tensors]} where the plan "
                                   f"has {[o.name for o in outs]}")
            item.writes += [(o, self._to_host(x)) for o, (_, x) in zip(outs, tensors)]
        if self.cuda:
            self.stream.synchronize()  # the copies back to the host are done
        if item.front_done:
            front = {o.name for o in self.run.front[item.index]}
            item.writes = [(o, x) for o, x in item.writes if o.name not in front]

    def _job_found_so_far(self, item: _Item, found: dict) -> dict:
        """The row findings of a job quantized slice by slice, added up in slice order up to this slice (at its
        last slice the same as the whole tensor's: the rows come in the same order)."""
        if item.piece.first > 0:
            found = _merge_found(self.partial.pop(item.index), found)
        return found

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        return host

    # --- write -----------------------------------------------------------------------------------------------------
    def _write(self) -> None:
        run = self.run
        while (item := run.get(self.write_q)) is not _END:
            job = item.job
            if item.rows_found is not None:  # before the writes: the shard the last one closes journals them
                with run.lock:
                    run.stats.by_job[item.index] = item.rows_found
            if job.kind is JobKind.COPY:
                if not item.front_done:
                    run_copy(run.plan, job, run.shards)
            else:
                for out, x in item.writes:
                    run.shards.write(out, x)
            item.writes = []
            self.budget.release(item.cost)
            if not item.last:
                continue
            self.count += 1
            run.job_done(job)
            if run.on_progress:
                run.on_progress(job.tensor.nbytes_stored, len(run.shards.closed))


def _rows_found(job: Job, piece: Slice, rep) -> dict:
    """The row findings of one slice of a job (JSON-ready): counts, and the first rows of each kind located."""
    src, et = job.tensor, piece.expert
    rows = et.rows_per_matrix

    def note(r: int) -> list:
        m = et.matrices[r // rows]
        return _note(RowNote(src.name, m.layer, m.expert, m.proj, r % rows))

    return {"zero": len(rep.zero_rows), "underflow": len(rep.underflow_rows), "nonfinite": len(rep.nonfinite_rows),
            "underflow_examples": [note(r) for r in rep.underflow_rows[:MAX_LISTED_ROWS]],
            "nonfinite_examples": [note(r) for r in rep.nonfinite_rows[:MAX_LISTED_ROWS]]}


def _nonfinite_error(job: Job, found: dict, plan: Plan) -> NonFiniteError:
    """The refusal of a job whose rows hold NaN/inf: the whole tensor's count (``found``: every slice's findings
    added up) and its first such row, the same whether the tensor was quantized whole or in slices."""
    src, n = job.tensor, RowNote(*found["nonfinite_examples"][0])
    count = found["nonfinite"]
    cast = "" if TORCH_DTYPES[src.dtype] == plan.compute_dtype else f" after the cast from {src.dtype} to " \
        f"{str(plan.compute_dtype).removeprefix('torch.')}"
    return NonFiniteError(f"routed-expert row holds NaN or infinity{cast} ({count} such row{'s' * (count != 1)} in "
                          f"this tensor, first: layer {n.layer} {n.proj}); vLLM would quantize it to garbage",
                          file=src.file, tensor=src.name, expert=n.expert, row=n.row,
                          hint=f"pass {option('allow_nonfinite')} to reproduce vLLM anyway")


def _merge_found(a: dict, b: dict) -> dict:
    """Row findings of consecutive slices of one job added up: counts summed, examples in row order, at most
    ``MAX_LISTED_ROWS`` of each."""
    return {k: (a[k] + b[k])[:MAX_LISTED_ROWS] if k.endswith("_examples") else a[k] + b[k] for k in a}


def _note(n: RowNote) -> list:
    return [n.tensor, n.layer, n.expert, n.proj, n.row]


def _write_order(job_item: tuple[int, Job]) -> tuple:
    """Jobs of a unit in the order their largest outputs lie in the output file (shard, then the plan's layout:
    wider dtypes first, then production order), so that shards fill front to back."""
    i, job = job_item
    big = max(job.outputs, key=lambda o: o.nbytes)
    return big.shard, -max(1, DTYPE_BITS[big.dtype] // 8), i


def make_units(plan: Plan, todo: list[tuple[int, Job]], largest_first: bool = True) -> list[list[tuple[int, Job]]]:
    """The jobs still to run, cut into units of work: one per source shard (the file of each job's main tensor),
    each in write order.

    Args:
        todo: (job index, job) pairs, in plan order.
        largest_first: hand the largest units out first (several devices: the last units to finish are the
            small ones, so no device idles long at the end); else in file order (one device: output shards then
            complete one after another, so an interrupted run keeps the most finished shards and a streamed source
            the fewest shards to fetch again).
    """
    by_file: dict[str, list[tuple[int, Job]]] = {}
    for ij in todo:
        by_file.setdefault(ij[1].tensor.file, []).append(ij)
    units = [sorted(u, key=_write_order) for u in by_file.values()]
    if not largest_first:
        return units
    return sorted(units, key=lambda u: -sum(j.tensor.nbytes_stored for _, j in u))


def run_plan(plan: Plan, shards: ShardSet, devices: list[torch.device], *, allow_nonfinite: bool = False,
             on_progress: Callable[[int, int], None] | None = None, done_jobs: dict[int, dict] | None = None,
             stop: StopSignal | None = None, feeder: SourceFeeder | None = None) -> RunStats:
    """Execute every job of ``plan`` through one pipeline per device in ``devices``, writing into ``shards``.

    A job whose outputs all lie in shards an earlier run finished is skipped (for a quantize job, when its row
    findings are in ``done_jobs``, from the journal).

    Args:
        devices: one pipeline each (the same device may be listed twice: two pipelines).
        on_progress: called (from the write threads) after each job with (source bytes it consumed, shards
            finished); an exception it raises stops the run like any other error.
        done_jobs: row findings of quantize jobs an earlier run finished (job index -> dict).
        stop: when set (an interrupt: ``interrupts.stop_on_signals``), pipelines finish the tensor in hand and stop;
            ``Interrupted`` is raised (None: never set).
        feeder: where the source files come from when they are not all on disk (``SourceFeeder``).

    Returns:
        RunStats (``finish``ed), with the jobs each device ran and the most bytes its pipeline held.

    Raises:
        NonFiniteError: a routed-expert row holds NaN/inf (unless ``allow_nonfinite``).
        ExpqError: any source read or output write error; the first error stops every pipeline.
        Interrupted: ``stop`` was set.
        LayoutError: a check the plan left running (``Plan.finish_checks``) found a problem; the pipelines stopped.
    """
    stats = RunStats(by_job=dict(done_jobs or {}))
    shards.on_close = lambda: dict(stats.by_job)  # what the journal records when a shard is finished
    run = Run(plan, shards, stats, allow_nonfinite, stop or StopSignal(), feeder, on_progress)
    todo = []
    for i, j in enumerate(plan.jobs):
        if shards.needed(j.outputs) or (j.kind is JobKind.QUANTIZE and i not in stats.by_job):
            todo.append((i, j))
        elif on_progress:
            on_progress(j.tensor.nbytes_stored, len(shards.closed))
    units = make_units(plan, todo, largest_first=len(devices) > 1)
    for u in units:
        run.units.put(u)
        for _, j in u:
            for f in dict.fromkeys(p.file for p in j.tensor.parts):
                run.readers[f] = run.readers.get(f, 0) + 1
    pipes = [_DevicePipeline(run, d) for d in devices]
    if feeder is None:
        run.front = front_outputs(plan, todo)
    front = FrontPass(run, units, devices) if run.front else None
    cpu = any(d.type == "cpu" for d in devices)
    with cpu_threads(cpu), buffers.using(buffers.Pool(BUFFER_POOL_FREE) if cpu else None):
        _run_pipelines(run, pipes, shards, feeder, on_progress, front)
    for p in pipes:
        key = str(p.device)
        stats.jobs_by_device[key] = stats.jobs_by_device.get(key, 0) + p.count
        stats.peak_bytes_in_flight[key] = max(stats.peak_bytes_in_flight.get(key, 0), p.budget.peak)
    if run.errors:
        raise run.errors[0]
    if run.stop.is_set():
        raise run.stop.interrupted()
    if plan.checks_failed():  # the pipelines stopped for it
        plan.finish_checks()
    if not shards.complete():
        raise RuntimeError("internal: some output tensors were not written")
    return stats.finish()


@contextmanager
def cpu_threads(active: bool):
    """While a CPU pipeline runs: torch single-threaded, and a pool of one thread per core for the scheme's row
    blocks and the decoders' bands (``parallel``; nothing when ``active`` is False). OpenMP teams spin-wait for each other and slow down several
    times over when the pipeline's read, write and hash threads take a core; plain threads do not."""
    if not active:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with parallel.Pool(parallel.usable_cores(), "expq-rows") as pool, parallel.using(pool):
            yield
    finally:
        torch.set_num_threads(before)


def _run_pipelines(run: Run, pipes: list[_DevicePipeline], shards: ShardSet, feeder: SourceFeeder | None,
                   on_progress: Callable[[int, int], None] | None, front: FrontPass | None) -> None:
    try:
        if feeder is not None:
            feeder.start(list(run.readers))
        for p in (*pipes, *([front] if front else [])):
            p.start()
        for p in (*pipes, *([front] if front else [])):
            p.join()
        if not run.halted():
            shards.wait_closed(run.stop)
            if on_progress:
                on_progress(0, len(shards.closed))
    finally:
        if feeder is not None:
            feeder.close()

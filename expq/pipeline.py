"""Executing a plan: source tensors through one or more devices into the output shards, with bounded memory.

Each worker owns one device and takes the next job (one logical source tensor) from a shared queue: a copy job moves
raw bytes; a decode job writes a quantized non-expert tensor decoded; a quantize job reads (and decodes) the tensor,
casts it to the compute dtype on its device, quantizes every row of every routed-expert matrix it holds in one
batch, and writes the tensors the output format returns at their planned offsets. At most one job per worker is in
memory at a time, whatever the model's size; the output bytes do not depend on which device ran which job.
"""

from __future__ import annotations

import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .errors import Interrupted, NonFiniteError
from .plan import Job, Plan
from .scheme import quantize_matrix
from .source import TORCH_DTYPES, copy_bytes
from .writer import OutputError, ShardSet

MAX_LISTED_ROWS = 20


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


def _run_copy(plan: Plan, job: Job, shards: ShardSet) -> None:
    out = job.outputs[0]
    t = shards.target(out)
    if t is None:  # its shard was finished by an earlier run
        return
    fd, pos = t
    try:
        copy_bytes(plan.source.root, job.source.stored, fd, pos)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror or e}", file=plan.shard_names[out.shard],
                          tensor=out.name) from None
    shards.done(out)


def _run_decode(plan: Plan, job: Job, shards: ShardSet, allow_nonfinite: bool) -> None:
    t = plan.source.read_logical(job.source)
    if t.is_floating_point() and not allow_nonfinite and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        parts = ", ".join(p.name for p in job.source.parts[1:]) or "its stored values"
        raise NonFiniteError(f"decodes to {bad} NaN/infinite values (from {parts}); the source is corrupt",
                             file=job.source.file, tensor=job.source.name,
                             hint="pass --allow-nonfinite to write it anyway")
    shards.write(job.outputs[0], t)


def _run_quantize(plan: Plan, index: int, job: Job, device: torch.device, shards: ShardSet, stats: RunStats,
                  allow_nonfinite: bool, lock: threading.Lock) -> None:
    src, et = job.source, job.expert
    t = plan.source.read_logical(src)
    w = et.to_rows(t.to(device).to(plan.compute_dtype)).contiguous()
    del t
    codes, scales, rep = quantize_matrix(w)
    del w
    rows = et.rows_per_matrix

    def note(r: int) -> RowNote:
        m = et.matrices[r // rows]
        return RowNote(src.name, m.layer, m.expert, m.proj, r % rows)

    if rep.nonfinite_rows and not allow_nonfinite:
        n = note(rep.nonfinite_rows[0])
        cast = "" if TORCH_DTYPES[src.dtype] == plan.compute_dtype else f" after the cast from {src.dtype} to " \
            f"{str(plan.compute_dtype).removeprefix('torch.')}"
        raise NonFiniteError(f"routed-expert row holds NaN or infinity{cast} ({len(rep.nonfinite_rows)} such rows "
                             f"in this tensor, first: layer {n.layer} {n.proj}); vLLM would quantize it to garbage",
                             file=src.file, tensor=src.name, expert=n.expert, row=n.row,
                             hint="pass --allow-nonfinite to reproduce vLLM anyway")
    rows_found = {"zero": len(rep.zero_rows), "underflow": len(rep.underflow_rows),
                  "nonfinite": len(rep.nonfinite_rows),
                  "underflow_examples": [_note(note(r)) for r in rep.underflow_rows[:MAX_LISTED_ROWS]],
                  "nonfinite_examples": [_note(note(r)) for r in rep.nonfinite_rows[:MAX_LISTED_ROWS]]}
    encoded = plan.format.encode(codes, scales, et.matrices)
    del codes
    for group, tensors in zip(job.groups, encoded):
        for out, (spec, tensor) in zip(group, tensors):
            if spec.name != out.name:
                raise RuntimeError(f"internal: the format returned {spec.name} where the plan has {out.name}")
            shards.write(out, tensor)
    with lock:
        stats.by_job[index] = rows_found


def _note(n: RowNote) -> list:
    return [n.tensor, n.layer, n.expert, n.proj, n.row]


def run_plan(plan: Plan, shards: ShardSet, devices: list[torch.device], *, allow_nonfinite: bool = False,
             on_progress: Callable[[int, int], None] | None = None, done_jobs: dict[int, dict] | None = None,
             stop: threading.Event | None = None, feeder: SourceFeeder | None = None) -> RunStats:
    """Execute every job of ``plan`` on ``devices`` (one worker thread each), writing into ``shards``.

    A job whose outputs all lie in shards an earlier run finished is skipped (for a quantize job, when its row
    findings are in ``done_jobs``, from the journal).

    Args:
        on_progress: called (from worker threads) after each job with (source bytes it consumed, shards finished);
            an exception it raises stops the run like any other error.
        done_jobs: row findings of quantize jobs an earlier run finished (job index -> dict).
        stop: when set (an interrupt), workers finish the tensor in hand and stop; ``Interrupted`` is raised.
        feeder: where the source files come from when they are not all on disk (``SourceFeeder``).

    Returns:
        RunStats (``finish``ed).

    Raises:
        NonFiniteError: a routed-expert row holds NaN/inf (unless ``allow_nonfinite``).
        ExpqError: any source read or output write error; the first error stops every worker.
        Interrupted: ``stop`` was set.
    """
    stats = RunStats(by_job=dict(done_jobs or {}))
    shards.on_close = lambda: dict(stats.by_job)  # what the journal records when a shard is finished
    lock = threading.Lock()
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for i, j in enumerate(plan.jobs):
        if shards.needed(j.outputs) or (j.kind == "quantize" and i not in stats.by_job):
            jobs.put((i, j))
        elif on_progress:
            on_progress(j.source.nbytes_stored, len(shards.closed))
    todo = []
    while True:
        try:
            todo.append(jobs.get_nowait())
        except queue.Empty:
            break
    readers: dict[str, int] = {}  # source file -> jobs still to run that read it
    for _, j in todo:
        for f in {p.file for p in j.source.parts}:
            readers[f] = readers.get(f, 0) + 1
        jobs.put((_, j))
    if feeder is not None:
        feeder.start(list(readers))

    def job_done(job: Job) -> None:
        if feeder is None:
            return
        for f in {p.file for p in job.source.parts}:
            with lock:
                readers[f] -= 1
                last = readers[f] == 0
            if last:
                feeder.done(f)

    errors: list[BaseException] = []
    stop = stop or threading.Event()
    failed = threading.Event()

    def worker(device: torch.device) -> None:
        count = 0
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while not (stop.is_set() or failed.is_set()):
                try:
                    i, job = jobs.get_nowait()
                except queue.Empty:
                    break
                if feeder is not None:
                    for f in dict.fromkeys(p.file for p in job.source.parts):
                        feeder.wait(f)
                if job.kind == "copy":
                    _run_copy(plan, job, shards)
                elif job.kind == "decode":
                    _run_decode(plan, job, shards, allow_nonfinite)
                else:
                    _run_quantize(plan, i, job, device, shards, stats, allow_nonfinite, lock)
                count += 1
                job_done(job)
                if on_progress:
                    on_progress(job.source.nbytes_stored, len(shards.closed))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with lock:
                errors.append(e)
            failed.set()
        finally:
            with lock:
                stats.jobs_by_device[str(device)] = stats.jobs_by_device.get(str(device), 0) + count

    threads = [threading.Thread(target=worker, args=(d,), name=f"expq-{d}", daemon=True) for d in devices]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():  # a timed join, so that the main thread runs signal handlers promptly
                t.join(0.1)
    finally:
        if feeder is not None:
            feeder.close()
    if errors:
        raise errors[0]
    if stop.is_set():
        raise Interrupted(getattr(stop, "signum", signal.SIGINT))
    if not shards.complete():
        raise RuntimeError("internal: some output tensors were not written")
    return stats.finish()

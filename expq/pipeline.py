"""Executing a plan: source tensors through one or more devices into the output shards, with bounded memory.

Each worker owns one device and takes the next job (one logical source tensor) from a shared queue: a copy job moves
raw bytes; a decode job writes a quantized non-expert tensor decoded; a quantize job reads (and decodes) the tensor,
casts it to the compute dtype on its device, quantizes every row of every routed-expert matrix it holds in one
batch, and writes the tensors the output format returns at their planned offsets. At most one job per worker is in
memory at a time, whatever the model's size; the output bytes do not depend on which device ran which job.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import NonFiniteError
from .plan import Job, Plan
from .scheme import quantize_matrix
from .source import TORCH_DTYPES, copy_bytes
from .writer import OutputError, ShardSet

MAX_LISTED_ROWS = 20


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
    """What running the plan found: counts of zero / underflow / non-finite rows, with the first few located."""

    zero_rows: int = 0
    underflow_rows: int = 0
    nonfinite_rows: int = 0
    underflow_examples: list[RowNote] = field(default_factory=list)
    nonfinite_examples: list[RowNote] = field(default_factory=list)
    jobs_by_device: dict[str, int] = field(default_factory=dict)


def _run_copy(plan: Plan, job: Job, shards: ShardSet) -> None:
    out = job.outputs[0]
    fd, pos = shards.target(out)
    try:
        copy_bytes(plan.source.root, job.source.stored, fd, pos)
    except OSError as e:
        raise OutputError(f"cannot write: {e.strerror or e}", file=plan.shard_names[out.shard],
                          tensor=out.name) from None
    shards.done(out)


def _run_decode(plan: Plan, job: Job, shards: ShardSet) -> None:
    shards.write(job.outputs[0], plan.source.read_logical(job.source))


def _run_quantize(plan: Plan, job: Job, device: torch.device, shards: ShardSet, stats: RunStats,
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
    encoded = plan.format.encode(codes, scales, et.matrices)
    del codes
    for group, tensors in zip(job.groups, encoded):
        for out, (spec, tensor) in zip(group, tensors):
            if spec.name != out.name:
                raise RuntimeError(f"internal: the format returned {spec.name} where the plan has {out.name}")
            shards.write(out, tensor)
    with lock:
        stats.zero_rows += len(rep.zero_rows)
        stats.underflow_rows += len(rep.underflow_rows)
        stats.nonfinite_rows += len(rep.nonfinite_rows)
        for r in rep.underflow_rows[: MAX_LISTED_ROWS - len(stats.underflow_examples)]:
            stats.underflow_examples.append(note(r))
        for r in rep.nonfinite_rows[: MAX_LISTED_ROWS - len(stats.nonfinite_examples)]:
            stats.nonfinite_examples.append(note(r))


def run_plan(plan: Plan, shards: ShardSet, devices: list[torch.device], *, allow_nonfinite: bool = False,
             on_progress: Callable[[int, int], None] | None = None) -> RunStats:
    """Execute every job of ``plan`` on ``devices`` (one worker thread each), writing into ``shards``.

    Args:
        on_progress: called (from worker threads) after each job with (source bytes it consumed, shards finished);
            an exception it raises stops the run like any other error.

    Returns:
        RunStats.

    Raises:
        NonFiniteError: a routed-expert row holds NaN/inf (unless ``allow_nonfinite``).
        ExpqError: any source read or output write error; the first error stops every worker.
    """
    stats = RunStats()
    lock = threading.Lock()
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for j in plan.jobs:
        jobs.put(j)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(device: torch.device) -> None:
        count = 0
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while not stop.is_set():
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                if job.kind == "copy":
                    _run_copy(plan, job, shards)
                elif job.kind == "decode":
                    _run_decode(plan, job, shards)
                else:
                    _run_quantize(plan, job, device, shards, stats, allow_nonfinite, lock)
                count += 1
                if on_progress:
                    on_progress(job.source.nbytes_stored, len(shards.closed))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with lock:
                errors.append(e)
            stop.set()
        finally:
            with lock:
                stats.jobs_by_device[str(device)] = stats.jobs_by_device.get(str(device), 0) + count

    threads = [threading.Thread(target=worker, args=(d,), name=f"expq-{d}", daemon=True) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if not shards.complete():
        raise RuntimeError("internal: some output tensors were not written")
    return stats

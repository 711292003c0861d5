"""Executing a plan: source tensors through one or more devices into the output shards, with bounded memory.

Each worker owns one device and takes the next job (one source tensor) from a shared queue: a copy job moves raw
bytes; a quantize job reads the tensor, casts it to the compute dtype on its device, quantizes every row of every
routed-expert matrix it holds in one batch, encodes them in the output format and writes each tensor at its planned
offset. At most one job per worker is in memory at a time, whatever the model's size; the output bytes do not depend
on which device ran which job.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import NonFiniteError, UsageError
from .formats import compressed_tensors as ct
from .plan import Job, Plan
from .scheme import quantize_matrix
from .source import TORCH_DTYPES, copy_bytes, read_tensor
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


def parse_devices(spec: str | None) -> list[torch.device]:
    """``auto`` (every visible CUDA device, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``cuda:0,cuda:1,...``.

    Raises:
        UsageError: an unknown device, or CUDA asked for where none is available.
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    devs = []
    for part in spec.split(","):
        part = part.strip()
        try:
            d = torch.device(part)
        except RuntimeError:
            raise UsageError(f"unknown device {part!r} (use auto, cpu, cuda, cuda:N or a comma-separated list)") \
                from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"device {part} asked for, but CUDA is not available here")
            if d.index is None:
                d = torch.device("cuda:0")
            if d.index >= torch.cuda.device_count():
                raise UsageError(f"device {part} asked for, but only {torch.cuda.device_count()} CUDA devices exist")
        elif d.type != "cpu":
            raise UsageError(f"unsupported device {part!r}")
        devs.append(d)
    if len(set(devs)) != len(devs):
        raise UsageError(f"device listed twice in {spec!r}")
    return devs


def _matrix_rows(job: Job, w: torch.Tensor) -> torch.Tensor:
    """The job's matrices stacked by rows, [sum of rows, cols], in the job's matrix order."""
    ex = job.extract
    if ex is None:  # per-expert: the tensor is the matrix
        return w
    E = ex.experts
    w = w.reshape(E, -1, w.shape[-1])  # flat [E*a, b] and stacked [E, a, b] alike
    if ex.orientation == "in_out":
        w = w.transpose(1, 2)
    if ex.order == "concat":  # gate rows then up rows: matrix order (e, gate), (e, up) is already row order
        return w.reshape(-1, w.shape[-1])
    if ex.order == "interleaved":  # even rows gate, odd rows up
        return torch.stack((w[:, 0::2], w[:, 1::2]), dim=1).reshape(-1, w.shape[-1])
    return w.reshape(-1, w.shape[-1])


def _run_quantize(plan: Plan, job: Job, device: torch.device, shards: ShardSet, stats: RunStats,
                  allow_nonfinite: bool, lock: threading.Lock) -> None:
    src = job.source
    t = read_tensor(plan.source.root, src)
    w = t.to(device).to(plan.compute_dtype)
    del t
    w = _matrix_rows(job, w).contiguous()
    codes, scales, rep = quantize_matrix(w)
    del w
    rows = job.matrices[0].rows

    def note(r: int) -> RowNote:
        m = job.matrices[r // rows]
        return RowNote(src.name, m.layer, m.expert, m.proj, r % rows)

    if rep.nonfinite_rows and not allow_nonfinite:
        n = note(rep.nonfinite_rows[0])
        cast = "" if TORCH_DTYPES[src.dtype] == plan.compute_dtype else f" after the cast from {src.dtype} to " \
            f"{str(plan.compute_dtype).removeprefix('torch.')}"
        raise NonFiniteError(f"routed-expert row holds NaN or infinity{cast} ({len(rep.nonfinite_rows)} such rows "
                             f"in this tensor, first: layer {n.layer} {n.proj}); vLLM would quantize it to garbage",
                             file=src.file, tensor=src.name, expert=n.expert, row=n.row,
                             hint="pass --allow-nonfinite to reproduce vLLM anyway")
    packed, scale2d, _ = ct.encode(codes, scales)
    del codes
    packed = packed.cpu()
    scale2d = scale2d.cpu()
    for i, m in enumerate(job.matrices):
        p_out, s_out, sh_out = job.outputs[3 * i: 3 * i + 3]
        sl = slice(i * rows, (i + 1) * rows)
        shards.write(p_out, packed[sl].numpy())
        shards.write(s_out, scale2d[sl].contiguous().view(torch.uint8).numpy())
        shards.write(sh_out, torch.tensor([m.rows, m.cols], dtype=torch.int64).numpy())
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
        on_progress: called (from worker threads) after each job with (source bytes it consumed, shards finished).

    Returns:
        RunStats.

    Raises:
        NonFiniteError: a routed-expert row holds NaN/inf (unless ``allow_nonfinite``).
        ExpqError: any source read error; the first error stops every worker.
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
                    out = job.outputs[0]
                    fd, pos = shards.target(out)
                    try:
                        copy_bytes(plan.source.root, job.source, fd, pos)
                    except OSError as e:
                        raise OutputError(f"cannot write: {e.strerror or e}", file=plan.shard_names[out.shard],
                                          tensor=out.name) from None
                    shards.done(out)
                else:
                    _run_quantize(plan, job, device, shards, stats, allow_nonfinite, lock)
                count += 1
                if on_progress:
                    on_progress(job.source.nbytes, len(shards.closed))
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

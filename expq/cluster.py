"""``--ray``: one conversion spread over a Ray cluster, byte-identical to ``convert`` on one machine.

The driver plans from headers only (a directory's shard headers; a Hub repo's by ranged reads, as ``--stream``)
and never reads a weight byte: even the source identity that the journal and ``expq.json`` record (the first and
last MiB of each local shard) is read by a task. Then:

1. **Group** (``task_groups``): output shards that one source tensor feeds belong together; each group of output
   shards (a connected component of the tensor / output-shard graph) is one task, with the source files its tensors
   live in. So every output shard is written by exactly one task, and no tensor is converted twice.
2. **Run** (``write_shards``, in each task): the normal pipeline (``run_plan``, ``ShardSet``) restricted to the
   task's shards: the other shards count as finished elsewhere. A directory SRC is read in place (a shared
   filesystem); a Hub SRC's files are downloaded by the task alone into a temporary folder on its node, a few at a
   time (``hub.stream.StreamFeeder``), and deleted once converted. The shards go into OUT's staging folder (shared
   filesystem), or, with ``--to-hub``, into a temporary folder from which the task uploads them itself
   (``hub.publish.upload_shards``) and deletes them. A task returns only names, sizes, sha256 and row findings (and the
   upload's ``CommitOperationAdd``, its content freed).
3. **Record and commit** (the driver): each result goes into OUT's journal as it arrives (a re-run keeps those
   shards and runs only the tasks of the missing ones); then config, index, side files and ``expq.json``, and the one
   commit point of ``output.outdir.OutputDir``. With ``--to-hub``: the same small files (beside sparse stand-ins of the
   shards, for the model card), the repo's README (``hub.card.model_card``), one commit with every file, then a check
   of every remote size and hash (``hub.publish``).

Tasks ask for ``num_cpus=1`` (and ``num_gpus=1`` per device with ``--device cuda...``) and ``memory`` from the
plan's bytes; a task whose worker dies is retried (``MAX_RETRIES``), and so is one that fails on the network
(``TRANSIENT``); other errors stop the run at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .conversion import (ConvertReport, command_line, keep_or_discard, make_report, plan_conversion, run_settings,
                         source_stamps, write_and_commit, write_side_files)
from .errors import ClusterError, ExpqError, HubOfflineError, Interrupted, UsageError, resumable
from .hub.card import model_card
from .hub.publish import prepare_repo, publish, upload_settings, upload_shards
from .hub.push import hub_token as login_token
from .hub.stream import StreamFeeder, streamed
from .interrupts import StopSignal, as_interrupted, keeping_handlers, stop_on_signals
from .manifest import Manifest
from .pipeline import RunStats
from .plan import JobKind, Plan
from .options import is_repo_id
from .source import local_identity, resolve_source
from .version import __version__
from .output.outdir import OutputDir
from .output.shards import placeholder_shard

MAX_RETRIES = 3  # times a task is retried after its worker died or a transient error
FAULT_ENV = "EXPQ_RAY_FAULT"
"""Test seam, read on the driver and handed to its tasks: ``kill-once:MARKER`` kills the worker (SIGKILL) after the
first tensor it writes, unless the file ``MARKER`` exists (it is created first, so the retry runs through)."""
TASK_BASE_MEMORY = 512 << 20


@dataclass(frozen=True)
class TaskGroup:
    """One task's work: output shards (indices into ``plan.shard_names``), the source files they are made from,
    and the bytes of source tensors it reads."""

    shards: tuple[int, ...]
    files: tuple[str, ...]
    bytes_in: int
    memory: int

    def names(self, plan: Plan) -> list[str]:
        return [plan.shard_names[k] for k in self.shards]


@dataclass
class ShardResult:
    """What a task sends back for one output shard: never its bytes."""

    name: str
    size: int
    sha256: str
    operation: object | None = None  # --to-hub: the CommitOperationAdd, uploaded, content freed


def task_groups(plan: Plan, skip: set[int] = frozenset()) -> list[TaskGroup]:
    """The tasks of a plan: connected components of the graph whose edges join each source tensor to the output
    shards it feeds (a tensor whose matrices land in two shards joins them), leaving out the shards in ``skip``
    (finished by an earlier run). Largest first (by source bytes read).

    Example:
        >>> groups = task_groups(expq.inspect("ckpt", max_shard_size="40KB"))  # doctest: +SKIP
        >>> [g.shards for g in groups]  # doctest: +SKIP
        [(0,), (1,), (2, 3), ...]
    """
    from .pipeline import PIPELINE_BYTES

    parent = list(range(len(plan.shard_names)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for j in plan.jobs:
        ks = sorted({o.shard for o in j.outputs})
        for k in ks[1:]:
            parent[find(k)] = find(ks[0])
    members: dict[int, list[int]] = {}
    for k in range(len(plan.shard_names)):
        members.setdefault(find(k), []).append(k)
    groups = []
    for ks in members.values():
        if set(ks) & set(skip):
            continue
        mine = set(ks)
        jobs = [j for j in plan.jobs if any(o.shard in mine for o in j.outputs)]
        files = tuple(dict.fromkeys(p.file for j in jobs for p in j.tensor.parts))
        work = [j for j in jobs if j.kind is not JobKind.COPY]  # read into memory (a copy goes file to file)
        costs = [j.tensor.nbytes_stored + sum(o.nbytes for o in j.outputs) for j in work]
        biggest = max((j.tensor.nbytes_stored for j in work), default=0)
        memory = TASK_BASE_MEMORY + min(PIPELINE_BYTES, sum(costs)) + 4 * biggest
        groups.append(TaskGroup(tuple(ks), files, sum(j.tensor.nbytes_stored for j in jobs), memory))
    return sorted(groups, key=lambda g: (-g.bytes_in, g.shards))


# --- in each task ----------------------------------------------------------------------------------------------------
def write_shards(plan: Plan, shards: list[int], folder: Path, *, device: str = "cpu", allow_nonfinite: bool = False,
                 fsync: bool = True, feeder=None, on_progress: Callable[[int, int], None] | None = None
                 ) -> tuple[list[ShardResult], dict[int, dict]]:
    """The normal conversion (``pipeline.run_plan`` into an ``output.shards.ShardSet``) of output shards ``shards`` of
    ``plan`` only, into ``folder``: what one task does.

    Returns:
        (a ShardResult per shard, the row findings of the quantize jobs it ran: job index -> dict).

    Raises:
        as ``run_plan``; OutputError: ``folder`` is not there (``ShardFolder``).
    """
    from .devices import parse_devices, warm_up
    from .pipeline import run_plan
    from .output.shards import ShardFolder, ShardSet

    devices = parse_devices(device)
    with warm_up(devices):
        names = [plan.shard_names[k] for k in shards]
        out = ShardFolder(folder, names, plan.shard_names)
        mine = set(shards)
        elsewhere = {i: _NO_FINDINGS for i, j in enumerate(plan.jobs)
                     if j.kind is JobKind.QUANTIZE and not any(o.shard in mine for o in j.outputs)}
        shard_set = ShardSet(plan, out, fsync=fsync)
        try:
            stats = run_plan(plan, shard_set, devices, allow_nonfinite=allow_nonfinite, done_jobs=elsewhere,
                             feeder=feeder, on_progress=on_progress)
        finally:
            shard_set.close_all()
    findings = {i: f for i, f in stats.by_job.items() if i not in elsewhere}
    return [ShardResult(n, out.records[n]["size"], out.records[n]["sha256"]) for n in names], findings


_NO_FINDINGS = {"zero": 0, "underflow": 0, "nonfinite": 0, "underflow_examples": [], "nonfinite_examples": []}


def _task(plan: Plan, group: TaskGroup, dest: str | None, listing, upload: dict | None, device: str,
          allow_nonfinite: bool, fsync: bool, fault: str) -> tuple[list[ShardResult], dict[int, dict]]:
    """One Ray task: ``write_shards`` of its group, reading a directory SRC in place or downloading its Hub files
    into a temporary folder; writing into ``dest`` (OUT's staging folder) or, with ``upload``, into a temporary
    folder whose shards it uploads and deletes."""
    with tempfile.TemporaryDirectory(prefix="expq-ray-") as tmp:
        feeder = None
        if listing is not None:
            src = Path(tmp) / "src"
            src.mkdir()
            plan = dataclasses.replace(plan, source=dataclasses.replace(plan.source, root=src))
            feeder = StreamFeeder(listing, src, None)
        folder = Path(dest) if dest is not None else Path(tmp) / "out"
        if dest is None:
            folder.mkdir()
        results, findings = write_shards(plan, list(group.shards), folder, device=device,
                                         allow_nonfinite=allow_nonfinite, fsync=fsync, feeder=feeder,
                                         on_progress=_fault_hook(fault))
        if upload is not None:
            for r, op in zip(results, upload_shards(folder, [r.name for r in results], **upload)):
                r.operation = op
    return results, findings


def _fault_hook(spec: str) -> Callable[[int, int], None] | None:
    if not spec.startswith("kill-once:"):
        return None
    marker = Path(spec.removeprefix("kill-once:"))

    def hook(nbytes: int, closed: int) -> None:
        if threading.current_thread().name.startswith("expq-write") and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _identity_task(source) -> list[list]:
    return local_identity(source)


# --- the driver ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def connected(address: str):
    """Ray, connected: an already initialised Ray as it is; ``local``: a new single-machine cluster (shut down
    afterwards); ``auto`` or ``HOST:PORT`` / ``ray://HOST:PORT``: an existing cluster (``ray.init(address=...)``).

    Raises:
        UsageError: Ray is not installed. ClusterError: the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise UsageError('--ray needs Ray, which is not installed: pip install "expq[ray]"') from None
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    try:
        with _workers_import_this_expq(), keeping_handlers():  # ray.init's SIGTERM handler: exit 15, no line
            if address == "local":
                ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            else:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - one line
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {_first_line(e)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _workers_import_this_expq():
    """While inside, the working directory is the folder holding this ``expq`` package: ``ray.init`` puts the
    driver's working directory first on every worker's import path, where a folder named ``expq`` (an OUT, say)
    would shadow the package; from here, the workers import the driver's own expq."""
    here = os.getcwd()
    os.chdir(Path(__file__).resolve().parent.parent)
    try:
        yield
    finally:
        os.chdir(here)


def _check_reachable(address: str) -> None:
    """For ``HOST:PORT`` (or ``ray://HOST:PORT``), a TCP connection first: ``ray.init`` waits minutes for a
    cluster that is not there."""
    if address in ("local", "auto"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray takes local, auto or HOST:PORT (or ray://HOST:PORT), not {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterError(f"cannot connect to the Ray cluster at {address}: {e.strerror or e}",
                           hint="start it with `ray start --head`, or pass --ray local") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _resources(group: TaskGroup, device: str) -> dict:
    spec = (device or "auto").strip()
    gpus = len(spec.split(",")) if spec.startswith("cuda") else 0
    return {"num_cpus": 1, "num_gpus": gpus, "memory": group.memory}


def _task_device(device: str) -> str:
    """Inside a task Ray shows only the GPUs it was given, as cuda:0, cuda:1...; ``auto`` without GPUs is the CPU."""
    spec = (device or "auto").strip()
    if spec.startswith("cuda"):
        n = len(spec.split(","))
        return ",".join(f"cuda:{i}" for i in range(n))
    return spec


def source_identity(ray, source) -> list[list]:
    """``source.local_identity`` of a directory SRC, computed by a task (the driver reads no weight byte)."""
    remote = ray.remote(_identity_task).options(num_cpus=1, max_retries=MAX_RETRIES)
    return _get(ray, remote.remote(source), "the source identity")


def _get(ray, ref, what: str):
    try:
        return ray.get(ref)
    except BaseException as e:  # noqa: BLE001 - translated to one line
        raise _task_failure(e, what) from None


def _task_failure(e: BaseException, what: str) -> BaseException:
    """The one line a failed task means: its cause (an expq error keeps its exit status), after the retries."""
    from ray import exceptions as rex

    if isinstance(e, (KeyboardInterrupt, Interrupted)):
        return e
    cause = getattr(e, "cause", None) if isinstance(e, rex.RayTaskError) else None
    if isinstance(e, rex.RayTaskError) and cause is not None:
        expq_cause = isinstance(cause, ExpqError)
        after = f" after {MAX_RETRIES} retries" if isinstance(cause, TRANSIENT) else ""
        err = ClusterError(f"the Ray task writing {what} failed{after}: "
                           f"{cause if expq_cause else _first_line(cause)}")
        if expq_cause:
            err.exit_code = cause.exit_code
        err.resumable = not expq_cause or resumable(cause)
        return err
    if isinstance(e, rex.RayError):  # the worker or its node died (after the retries), out of memory...
        return ClusterError(f"the Ray task writing {what} failed after {MAX_RETRIES} retries: {_first_line(e)}")
    return e


TRANSIENT = (HubOfflineError, ConnectionError, TimeoutError)
"""Errors a task is retried on (the network); any other error is final."""


def run_tasks(ray, plan: Plan, groups: list[TaskGroup], *, dest: Path | None, listing, upload: dict | None,
              device: str, allow_nonfinite: bool, fsync: bool, stop: StopSignal, on_result: Callable) -> None:
    """Submit one task per group and hand each result to ``on_result(group, results, findings)`` as it arrives
    (``findings``: the row findings of the task's quantize jobs, job index -> dict).

    Raises:
        ClusterError: a task failed (after its retries); the others are cancelled, and have ended when this
            raises (``_stop_tasks``). Interrupted: ``stop`` was set (the results already there are handed over
            first; the other tasks are stopped alike).
    """
    if not groups:
        return
    plan_ref = ray.put(plan)
    fn = ray.remote(_task)
    pending = {}
    for g in groups:
        names = g.names(plan)
        opts = dict(**_resources(g, device), max_retries=MAX_RETRIES, retry_exceptions=list(TRANSIENT),
                    name=f"expq:{names[0]}" + (f"+{len(names) - 1}" if len(names) > 1 else ""))
        ref = fn.options(**opts).remote(plan_ref, g, str(dest) if dest is not None else None, listing, upload,
                                        _task_device(device), allow_nonfinite, fsync, os.environ.get(FAULT_ENV, ""))
        pending[ref] = g
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            if stop.is_set():
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                g = pending.pop(ref)
                results, findings = _get(ray, ref, ", ".join(g.names(plan)))
                on_result(g, results, findings)
            if stop.is_set():
                raise stop.interrupted()
    finally:
        _stop_tasks(ray, list(pending))


STOP_WAIT_S = 60.0
"""How long ``_stop_tasks`` waits for cancelled tasks to end (a forced cancel kills the worker at once; Ray reports
the end once the worker is gone, or once it declares the node dead)."""


def _stop_tasks(ray, refs: list) -> None:
    """Cancel tasks (queued or running; a running one's worker is killed) and wait until each has ended, at most
    ``STOP_WAIT_S``: ``ray.cancel`` only asks, and a task still running would go on writing into OUT's staging folder
    while the driver keeps or removes it (a removed folder would come back, half written)."""
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
    if refs:
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S, fetch_local=False)


# --- the driver's steps ----------------------------------------------------------------------------------------------
def convert_on_ray(src, out, address: str, *, to_hub: str | None, private: bool, format: str, dtype: str,
                   device: str, revision: str | None, max_shard_size, overwrite: bool, layout, allow_nonfinite: bool,
                   token: str | None, fsync: bool, allow_random_experts: bool, on_plan, on_progress,
                   t0: float) -> ConvertReport:
    """``api.convert`` with ``ray`` (its options, checked already): connect; open the source from headers only;
    plan; the source's identity (by a task, for a directory); then into OUT (``_RayRun.into_out``) or to the Hub
    (``_RayRun.to_hub``).

    Raises:
        as ``api.convert``; ClusterError: the cluster cannot be reached, or a task failed after its retries.
    """
    hub_token = login_token(token) if to_hub is not None else None
    with contextlib.ExitStack() as stack:
        here = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="expq-driver-"))) / "out" \
            if to_hub is not None else Path(out)
        ray = stack.enter_context(connected(address))
        source, listing = stack.enter_context(_headers_only(src, here, revision=revision, token=token or hub_token))
        plan = plan_conversion(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format,
                               allow_random_experts=allow_random_experts)
        stamps = source_stamps(source) if listing is None else {}  # before hashing: a write while it hashes shows
        identity = source_identity(ray, source) if listing is None else None
        settings = run_settings(plan, dtype=dtype, allow_nonfinite=allow_nonfinite, identity=identity)
        run = _RayRun(ray, plan, settings, listing, device=device, allow_nonfinite=allow_nonfinite, fsync=fsync,
                      command=command_line(plan, dtype, allow_nonfinite, layout is not None), on_plan=on_plan,
                      on_progress=on_progress)
        run.stamps = stamps
        if to_hub is not None:
            return run.to_hub(here, to_hub, hub_token, private=private, t0=t0)
        return run.into_out(here, overwrite=overwrite, src_root=None if listing is not None else source.root, t0=t0)


@contextlib.contextmanager
def _headers_only(src, out: Path, *, revision: str | None, token: str | None):
    """(the Source, the Hub listing the tasks download from, or None for a directory), reading no weight byte: a
    directory's headers, or a Hub repo's by ranged reads (``hub.stream.streamed``; its folder holds the side files
    only)."""
    p = Path(src).expanduser()
    if p.exists() or not is_repo_id(str(src)):  # a directory, or the same error a plain convert gives
        # absolute: the tasks run in other working directories (and on other machines, at the same path)
        yield resolve_source(p.resolve() if p.exists() else src, revision=revision), None
        return
    if token is None:
        from huggingface_hub import get_token

        token = get_token()  # the tasks, on other machines, read with the driver's token
    with streamed(str(src), out, revision=revision, token=token, keep=resumable) as (source, feeder):
        yield source, feeder.listing


class _RayRun:
    """What the two ways of ending a ``--ray`` conversion share: the plan, its settings, the tasks' options, and
    what the tasks have sent back (``findings``: row findings by job index; ``tasks``: each task's shards)."""

    def __init__(self, ray, plan: Plan, settings: dict, listing, *, device: str, allow_nonfinite: bool, fsync: bool,
                 command: str, on_plan, on_progress):
        self.ray, self.plan, self.settings, self.listing = ray, plan, settings, listing
        self.device, self.allow_nonfinite, self.fsync, self.command = device, allow_nonfinite, fsync, command
        self.on_plan, self.on_progress = on_plan, on_progress
        self.findings: dict[int, dict] = {}
        self.stamps: dict[str, tuple] = {}  # the directory source's files as hashed (``check_unchanged``)
        self.tasks: list[list[str]] = []
        self.finished = 0

    def _run(self, groups: list[TaskGroup], *, dest: Path | None, upload: dict | None, on_shard,
             stop: StopSignal) -> None:
        """Run the tasks of ``groups``, handing each result to ``on_shard``; inside the caller's
        ``stop_on_signals`` (``stop``), which goes on to its commit."""
        def on_result(group, results, findings):
            self.findings.update(findings)
            self.tasks.append([r.name for r in results])
            for r in results:
                on_shard(r, findings)
            self.finished += len(results)
            if self.on_progress:
                self.on_progress(group.bytes_in, self.finished)

        if self.on_plan:
            self.on_plan(self.plan)
        done_bytes = self.plan.bytes_in - sum(g.bytes_in for g in groups)
        if self.on_progress and done_bytes:
            self.on_progress(done_bytes, self.finished)
        run_tasks(self.ray, self.plan, groups, dest=dest, listing=self.listing, upload=upload,
                  device=self.device, allow_nonfinite=self.allow_nonfinite, fsync=self.fsync, stop=stop,
                  on_result=on_result)

    def _report(self, outdir: OutputDir, man: Manifest, t0: float, **changes) -> ConvertReport:
        rep = make_report(self.plan, outdir, man, [f"ray ({self.device})"], time.perf_counter() - t0)
        return dataclasses.replace(rep, ray_tasks=self.tasks, **changes)

    def into_out(self, out: Path, *, overwrite: bool, src_root: Path | None, t0: float) -> ConvertReport:
        """Tasks write into OUT's staging folder; each result goes into the journal as it comes (a re-run keeps
        those shards); then the small files and the one commit."""
        plan = self.plan
        outdir = OutputDir(out, fingerprint=self.settings, overwrite=overwrite, src_root=src_root)
        if outdir.up_to_date():
            outdir.finish_up_to_date()
            return self._report(outdir, outdir.existing.record, t0, up_to_date=True)
        outdir.start()
        self.findings = dict(outdir.done_jobs)
        self.finished = len(outdir.kept_files)
        finished_shards = {k for k, n in enumerate(plan.shard_names) if n in outdir.finished_files}
        try:
            with stop_on_signals() as stop:  # the commit too: a signal then waits for it (``write_and_commit``)
                self._run(task_groups(plan, skip=finished_shards), dest=outdir.staging, upload=None,
                          on_shard=lambda r, findings: outdir.record(r.name, jobs=findings, sha256=r.sha256),
                          stop=stop)
                man = write_and_commit(plan, outdir, RunStats(by_job=self.findings).finish(),
                                       allow_nonfinite=self.allow_nonfinite, command=self.command,
                                       stamps=self.stamps, stop=stop)
        except BaseException as e:
            keep_or_discard(e, plan, outdir, self.finished)
            raise
        return self._report(outdir, man, t0)

    def to_hub(self, here: Path, repo_id: str, token: str, *, private: bool, t0: float) -> ConvertReport:
        """Tasks upload their shards; the driver lays down the small files beside sparse stand-ins of the shards
        (real headers and sizes, for the card), commits them locally, writes the card, and publishes it all in one
        commit."""
        plan = self.plan
        prepare_repo(repo_id, token, private=private)
        results: dict = {}
        with stop_on_signals() as stop:
            self._run(task_groups(plan), dest=None, upload=upload_settings(repo_id, token),
                      on_shard=lambda r, findings: results.__setitem__(r.name, r), stop=stop)
        publishing = False
        try:  # the driver's folder is a stand-in: OUT is the repo, which only the publish's commit changes
            outdir = OutputDir(here, fingerprint=self.settings)
            outdir.start()
            for k, name in enumerate(plan.shard_names):
                placeholder_shard(plan, k, outdir.path(name))
                outdir.record(name, sha256=results[name].sha256)
            man = write_side_files(plan, outdir, RunStats(by_job=self.findings).finish(), self.allow_nonfinite,
                                   self.settings, self.command)
            outdir.commit()
            (here / "README.md").write_text(model_card(here, repo_id))
            publishing = True
            urls, _ = publish(here, plan, results, repo_id, token,
                              commit_message=f"Upload {plan.format.name} checkpoint made with expq {__version__}")
        except BaseException as e:
            if (stop := as_interrupted(e)) is None:
                raise
            name = signal.Signals(stop.signum).name
            what = ("while publishing: its one commit may or may not have been made (the repo's history says)"
                    if publishing else "before its commit: the repo is unchanged (the shards the tasks uploaded are "
                                       "in no commit)")
            raise Interrupted(stop.signum, f"interrupted by {name} {what}; re-run the same command to publish to "
                                           f"{repo_id}") from None
        return self._report(outdir, man, t0, out=f"hf://{repo_id}", hub_commits=urls)

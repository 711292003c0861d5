"""The public entry points ``convert`` and ``inspect``: source -> plan -> pipeline -> writer."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shlex
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .version import __version__
from .devices import parse_devices, warm_up
from .engines.clients import stock_transformers_misloads
from .errors import HubError, Interrupted, SourceError, UsageError, option
from .formats import FORMATS
from .io.hashing import sha256_file
from .io.index import INDEX_NAME, index_json
from .layouts import Layout
from .manifest import CONFIG, MANIFEST, FileRecord, Manifest
from .options import check_convert, check_inspect
from .pipeline import RunStats, run_plan
from .plan import DEFAULT_FORMAT, DEFAULT_MAX_SHARD, Plan, make_plan
from .source import Source, is_repo_id, resolve_source
from .streaming import ShardStream, streamed
from .writer import STOP, OutputDir, OutputError, ShardSet, check_out_location, config_json


@dataclass
class ConvertReport:
    """What ``convert`` did. Sizes in bytes, time in seconds.

    ``tensors_quantized`` counts source tensors holding routed experts, ``matrices_quantized`` the expert projection
    matrices (layers x experts x 3); ``zero_rows`` rows were all zero (scale 0); ``underflow_rows`` had a scale that
    underflowed in the compute dtype (listed in ``underflow_examples``, up to 20).
    """

    out: str
    source: str
    revision: str | None
    commit: str | None
    architecture: str | None
    model_type: str | None
    layout: str
    format: str
    compute_dtype: str
    layers: int
    moe_layers: list[int]
    dense_layers: list[int]
    experts: int
    tensors_quantized: int
    tensors_copied: int
    matrices_quantized: int
    side_files_copied: int
    shards: int
    bytes_in: int
    bytes_out: int
    seconds: float
    devices: list[str]
    zero_rows: int
    underflow_rows: int
    nonfinite_rows: int
    underflow_examples: list[str] = field(default_factory=list)
    nonfinite_examples: list[str] = field(default_factory=list)
    up_to_date: bool = False  # OUT already held exactly this conversion: nothing was done
    shards_resumed: int = 0  # output shards an interrupted earlier run had finished, kept (content checked)
    stream_peak_bytes: int | None = None  # --stream: the most bytes the stream folder held at once (else None)
    ray_tasks: list[list[str]] | None = None  # --ray: the output shards each task of this run wrote (else None)
    hub_commits: list[str] | None = None  # --to-hub: the commit URLs (one, or batches for very many files)
    # what went wrong after the commit, the new checkpoint being in place (an old one left behind, a failed flush)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def inspect(src: str | Path, *, revision: str | None = None, layout: str | Path | Layout | None = None,
            dtype: str = "auto", max_shard_size: str | int = "5GB", token: str | None = None,
            format: str = DEFAULT_FORMAT) -> Plan:
    """What ``convert`` would do, without writing anything.

    Args:
        src: a local checkpoint directory or a Hub repo id (see ``source.resolve_source``).
        revision, token: for Hub repo ids.
        layout, dtype, max_shard_size, format: as for ``convert``.

    Returns:
        the Plan (``plan.summary()`` is a JSON-ready description).

    Raises:
        SourceError, LayoutError: see ``source.resolve_source`` and ``plan.make_plan``.
        UsageError: a bad ``dtype`` or ``max_shard_size``.
    """
    check_inspect(src, format=format, dtype=dtype, max_shard_size=max_shard_size)
    source = resolve_source(src, revision=revision, token=token)
    try:
        return make_plan(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format)
    except ValueError as e:
        raise UsageError(str(e)) from None


def convert(src: str | Path, out: str | Path | None = None, *, format: str = DEFAULT_FORMAT, dtype: str = "auto",
            device: str = "auto", revision: str | None = None, max_shard_size: str | int = "5GB",
            overwrite: bool = False, layout: str | Path | Layout | None = None, allow_nonfinite: bool = False,
            token: str | None = None, fsync: bool = True, stream: bool = False, ray: str | None = None,
            to_hub: str | None = None, private: bool = False, allow_random_experts_in_transformers: bool = False,
            on_plan: Callable[[Plan], None] | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Convert a MoE checkpoint: routed experts to experts_int8 codes and scales, everything else byte for byte.

    Steps: parse the devices; open the source (with ``stream``, its headers only); plan (every check before a byte
    is written); take OUT (staging and lock); run the plan through the devices (with ``stream``, downloading the
    shards as they are needed); write config, index, side files and ``expq.json``; commit.

    Args:
        src: a local checkpoint directory or a Hub repo id (``revision``, ``token``; the user's cache and login,
            ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are honoured). Never modified.
        out: the output directory: must not exist or be empty, unless ``overwrite``.
        format: output format: ``auto`` (the family's default, see ``inspect``), ``compressed-tensors``
            (pack-quantized W8A16 channel-wise, what stock vLLM and transformers load) or ``experts-int8`` (int8
            codes and fp32 scales as vLLM's experts_int8 holds them; served by expq's vLLM plugin and loaded by
            transformers after ``import expq``; stock clients refuse it). A format that stock transformers would
            load with randomly initialised experts for this family (``compressed-tensors`` for the families whose
            layout says ``[clients] transformers = false``: granitemoe, qwen3_vl_moe, gpt_oss, dbrx) is refused
            unless ``allow_random_experts_in_transformers``.
        dtype: compute dtype: ``auto`` (vLLM's ``--dtype auto`` rule), ``bfloat16``, ``float16`` or ``float32``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``cuda:0,cuda:1,...`` (results are identical on all; one
            pipeline per device, see ``pipeline``). While a CPU pipeline runs, torch is held to one intra-op thread
            and the arithmetic goes through expq's own pool of one thread per core (restored afterwards).
        max_shard_size: largest output shard, e.g. ``"5GB"``.
        layout: a layout file (``configs/*.toml`` format) for an architecture expq does not know.
        allow_nonfinite: quantize rows holding NaN/inf as vLLM would instead of refusing them.
        fsync: flush each shard to disk before renaming it (on by default).
        stream: for a Hub repo: plan from the shard headers (ranged reads), then download the shards a few at a
            time into ``.<OUT>.expq-stream/`` beside OUT, deleting each once converted, instead of using the Hub
            cache (peak disk: OUT + 3 source shards; see ``streaming``). A killed run resumes from that folder.
        ray: run on a Ray cluster (``local``: a new one on this machine; ``auto``: the one this machine belongs
            to; ``HOST:PORT`` or ``ray://HOST:PORT``; an already initialised Ray is used as it is): the driver
            plans from headers only, one task per group of output shards converts them where the cluster puts it
            (a directory SRC and OUT must be on a filesystem every node sees; a Hub SRC is downloaded by the tasks,
            each its own shards), and the driver records, writes the small files and commits. The output is
            byte-identical. See ``cluster``.
        to_hub: with ``ray``, publish to this Hub model repo instead of writing ``out`` (None): each task uploads
            its shards, the driver makes one commit with them, config, index, ``expq.json`` and the model card
            (``hub.model_card``), then checks every remote file's size and sha256. ``private``: create it private.
        allow_random_experts_in_transformers: write ``format`` even where stock transformers would load the result
            with randomly initialised experts (a checkpoint only for vLLM or expq); ``verify`` and the model card
            then say so.
        on_plan: called with the plan before any work; on_progress: called after each source tensor with
            (its bytes, output shards finished so far); an exception either raises stops the conversion cleanly.
            With ``ray``, once per task, with its source bytes.

    Returns:
        ConvertReport.

    Raises:
        UsageError: bad options or output location; ``stream`` with a local directory; a ``format`` stock
            transformers would load with random experts, without ``allow_random_experts_in_transformers``.
            SourceError, LayoutError:
            see ``inspect``. HubError: with ``stream``, a shard download failed or does not match the listing.
        NonFiniteError: a routed-expert row holds NaN/inf (names tensor, expert and row).
        On any error nothing is left under a final name in ``out``.
    """
    t0 = time.perf_counter()
    check_convert(src, out, format=format, dtype=dtype, device=device, max_shard_size=max_shard_size, stream=stream,
                  ray=ray, to_hub=to_hub)
    if to_hub is None:
        check_out_location(out)  # a link or a mount point: refused before anything is read
    if ray is not None:
        return _convert_on_ray(src, out, ray, to_hub=to_hub, private=private, format=format, dtype=dtype,
                               device=device, revision=revision, max_shard_size=max_shard_size, overwrite=overwrite,
                               layout=layout, allow_nonfinite=allow_nonfinite, token=token, fsync=fsync,
                               allow_random_experts=allow_random_experts_in_transformers, on_plan=on_plan,
                               on_progress=on_progress, t0=t0)
    devices = parse_devices(device)
    warm_up(devices)
    with _opened_source(src, out, stream=stream, revision=revision, token=token) as (source, feeder):
        try:
            plan = make_plan(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format)
        except ValueError as e:
            raise UsageError(str(e)) from None
        refuse_random_experts(plan, allowed=allow_random_experts_in_transformers)
        stamps = source_stamps(source)  # before hashing: a write while it hashes shows at the commit
        settings = run_settings(plan, dtype=dtype, allow_nonfinite=allow_nonfinite)
        outdir = OutputDir(out, fingerprint=settings, overwrite=overwrite, src_root=source.root)
        if outdir.up_to_date():
            outdir.finish_up_to_date()
            return make_report(plan, outdir, Manifest.load(outdir.out), devices, time.perf_counter() - t0, feeder,
                           up_to_date=True)
        outdir.start()
        shards = ShardSet(plan, outdir, fsync=fsync)
        try:
            with stop_on_signals() as stop:
                if on_plan:
                    on_plan(plan)
                stats = run_plan(plan, shards, devices, allow_nonfinite=allow_nonfinite, on_progress=on_progress,
                                 done_jobs=outdir.done_jobs, stop=stop, feeder=feeder)
                man = write_side_files(plan, outdir, stats, allow_nonfinite, settings,
                                        command_line(plan, dtype, allow_nonfinite, layout is not None))
                check_unchanged(source, stamps)
                outdir.commit()
        except BaseException as e:
            shards.close_all()
            keep_or_discard(e, outdir, len(shards.closed), len(plan.shard_names))
            raise
    return make_report(plan, outdir, man, devices, time.perf_counter() - t0, feeder)


def refuse_random_experts(plan: Plan, *, allowed: bool) -> None:
    """Refuse a plan whose output stock transformers would load with randomly initialised routed experts
    (``engines.clients.stock_transformers_misloads``), unless ``allowed``.

    Raises:
        UsageError: naming the format, the family, why, and the formats stock transformers refuses instead.
    """
    why = stock_transformers_misloads(plan.format, plan.layout)
    if not why or allowed:
        return
    safe = [name for name, cls in FORMATS.items() if cls.expq_loads]
    raise UsageError(f"refusing to write {plan.format.name}: {why}",
                     hint=f"use {' or '.join(option('format', n) for n in safe)}, which stock transformers refuses "
                          f"with an error instead, or pass {option('allow_random_experts_in_transformers')} for a "
                          "checkpoint never meant for stock transformers")


# --- --ray: the driver's steps ---------------------------------------------------------------------------------------
def _convert_on_ray(src, out, address: str, *, to_hub: str | None, private: bool, format: str, dtype: str,
                    device: str, revision: str | None, max_shard_size, overwrite: bool, layout, allow_nonfinite: bool,
                    token: str | None, fsync: bool, allow_random_experts: bool, on_plan, on_progress,
                    t0: float) -> ConvertReport:
    """``convert`` with ``ray``: connect; open the source from headers only; plan; the source's identity (by a
    task, for a directory); then into OUT (``_ray_into_out``) or to the Hub (``_ray_to_hub``)."""
    from . import cluster

    hub_token = cluster.check_target(to_hub, token) if to_hub is not None else None
    with contextlib.ExitStack() as stack:
        here = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="expq-driver-"))) / "out" \
            if to_hub is not None else Path(out)
        ray = stack.enter_context(cluster.connected(address))
        source, listing = stack.enter_context(_headers_only(src, here, revision=revision, token=token or hub_token))
        try:
            plan = make_plan(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format)
        except ValueError as e:
            raise UsageError(str(e)) from None
        refuse_random_experts(plan, allowed=allow_random_experts)
        stamps = source_stamps(source) if listing is None else {}
        identity = cluster.source_identity(ray, source) if listing is None else None
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
    directory's headers, or a Hub repo's by ranged reads (``streaming.streamed``; its folder holds the side files
    only)."""
    p = Path(src).expanduser()
    if p.exists() or not is_repo_id(str(src)):  # a directory, or the same error a plain convert gives
        yield resolve_source(p if p.exists() else src, revision=revision), None
        return
    if token is None:
        from huggingface_hub import get_token

        token = get_token()  # the tasks, on other machines, read with the driver's token
    with streamed(str(src), out, revision=revision, token=token, keep=resumable) as (source, stream):
        yield source, stream.listing


class _RayRun:
    """What the two ways of ending a ``--ray`` conversion share: the plan, its settings, the tasks' options."""

    def __init__(self, ray, plan: Plan, settings: dict, listing, *, device: str, allow_nonfinite: bool, fsync: bool,
                 command: str, on_plan, on_progress):
        self.ray, self.plan, self.settings, self.listing = ray, plan, settings, listing
        self.device, self.allow_nonfinite, self.fsync, self.command = device, allow_nonfinite, fsync, command
        self.on_plan, self.on_progress = on_plan, on_progress
        self.rows: dict[int, dict] = {}
        self.stamps: dict[str, tuple] = {}  # the directory source's files as hashed (``check_unchanged``)
        self.tasks: list[list[str]] = []
        self.finished = 0

    def _run(self, groups, *, dest: Path | None, upload: dict | None, on_shard) -> None:
        from . import cluster

        def on_result(group, results, rows):
            self.rows.update(rows)
            self.tasks.append([r.name for r in results])
            for r in results:
                on_shard(r, rows)
            self.finished += len(results)
            if self.on_progress:
                self.on_progress(group.bytes_in, self.finished)

        with stop_on_signals() as stop:
            if self.on_plan:
                self.on_plan(self.plan)
            done_bytes = self.plan.bytes_in - sum(g.bytes_in for g in groups)
            if self.on_progress and done_bytes:
                self.on_progress(done_bytes, self.finished)
            cluster.run_tasks(self.ray, self.plan, groups, dest=dest, listing=self.listing, upload=upload,
                              device=self.device, allow_nonfinite=self.allow_nonfinite, fsync=self.fsync, stop=stop,
                              on_result=on_result)

    def _report(self, outdir: OutputDir, man: Manifest, t0: float, **changes) -> ConvertReport:
        rep = make_report(self.plan, outdir, man, [f"ray ({self.device})"], time.perf_counter() - t0, None)
        return dataclasses.replace(rep, ray_tasks=self.tasks, **changes)

    def into_out(self, out: Path, *, overwrite: bool, src_root: Path | None, t0: float) -> ConvertReport:
        """Tasks write into OUT's staging folder; each result goes into the journal as it comes (a re-run keeps
        those shards); then the small files and the one commit."""
        from . import cluster

        plan = self.plan
        outdir = OutputDir(out, fingerprint=self.settings, overwrite=overwrite, src_root=src_root)
        if outdir.up_to_date():
            outdir.finish_up_to_date()
            return self._report(outdir, Manifest.load(outdir.out), t0, up_to_date=True)
        outdir.start()
        self.rows = dict(outdir.done_jobs)
        self.finished = len(outdir.kept)
        kept = {k for k, n in enumerate(plan.shard_names) if n in outdir.kept}
        try:
            self._run(cluster.task_groups(plan, skip=kept), dest=outdir.staging, upload=None,
                      on_shard=lambda r, rows: outdir.record(r.name, jobs=rows, sha256=r.sha256))
            man = write_side_files(plan, outdir, RunStats(by_job=self.rows).finish(), self.allow_nonfinite,
                                   self.settings, self.command)
            check_unchanged(plan.source, self.stamps)
            outdir.commit()
        except BaseException as e:
            keep_or_discard(e, outdir, self.finished, len(plan.shard_names))
            raise
        return self._report(outdir, man, t0)

    def to_hub(self, here: Path, repo_id: str, token: str, *, private: bool, t0: float) -> ConvertReport:
        """Tasks upload their shards; the driver lays down the small files beside sparse stand-ins of the shards
        (real headers and sizes, for the card), commits them locally, writes the card, and publishes it all in one
        commit."""
        from . import cluster
        from .hub import model_card
        from .writer import placeholder_shard

        plan = self.plan
        cluster.prepare_repo(repo_id, token, private=private)
        results: dict = {}
        self._run(cluster.task_groups(plan), dest=None,
                  upload=cluster.upload_settings(repo_id, token),
                  on_shard=lambda r, rows: results.__setitem__(r.name, r))
        outdir = OutputDir(here, fingerprint=self.settings)
        outdir.start()
        for k, name in enumerate(plan.shard_names):
            placeholder_shard(plan, k, outdir.path(name))
            outdir.record(name, sha256=results[name].sha256)
        man = write_side_files(plan, outdir, RunStats(by_job=self.rows).finish(), self.allow_nonfinite,
                               self.settings, self.command)
        outdir.commit()
        (here / "README.md").write_text(model_card(here, repo_id))
        urls, _ = cluster.publish(here, plan, results, repo_id, token,
                                  commit_message=f"Upload {plan.format.name} checkpoint made with expq {__version__}")
        return self._report(outdir, man, t0, out=f"hf://{repo_id}", hub_commits=urls)


def keep_or_discard(e: BaseException, outdir: OutputDir, kept: int, total: int) -> None:
    """After a failed run: keep staging and journal when the same command can resume (an interrupt, a killed
    worker, a network failure; raises ``Interrupted`` saying how many of ``total`` shards are kept), else remove them.
    The caller re-raises ``e``."""
    if resumable(e) or getattr(e, "resumable", False):
        outdir.release()  # staging and journal stay: the same command resumes
        if isinstance(e, Interrupted):
            raise Interrupted(e.signum, f"interrupted by {signal.Signals(e.signum).name}; {kept} of {total} shards "
                                        "are kept: re-run the same command to resume") from None
    else:
        outdir.discard()


def resumable(e: BaseException) -> bool:
    """Whether the same command resumes after ``e``: an interrupt, a failed write (disk full...), or a Hub failure
    during a ``--stream`` download. The staging folder, journal and stream folder are kept for it; after any other
    error they are removed."""
    return isinstance(e, (Interrupted, KeyboardInterrupt, OSError, OutputError, HubError))


@contextlib.contextmanager
def _opened_source(src: str | Path, out: str | Path, *, stream: bool, revision: str | None, token: str | None):
    """(the Source, the ShardStream that feeds its shards, or None): ``resolve_source``, or with ``stream``
    ``streaming.streamed`` (the stream folder is removed after a success and after an error that is not
    ``resumable``)."""
    if not stream:
        yield resolve_source(src, revision=revision, token=token), None
        return
    with streamed(str(src), out, revision=revision, token=token, keep=resumable) as opened:
        yield opened


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT, SIGTERM and SIGHUP set an event (carrying ``signum``) that stops the workers, instead of killing the
    process mid-write; the previous handlers come back afterwards. A no-op outside the main thread."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        stop.signum = STOP.signum = signum  # STOP's: for a worker waiting on a --stream download (streaming)
        stop.set()
        STOP.set()

    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, handler) for s in sigs}
    STOP.clear()
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_settings(plan: Plan, *, dtype: str, allow_nonfinite: bool, identity: list[list] | None = None) -> dict:
    """What makes two conversions the same (recorded in the journal and expq.json; resume and the no-op re-run
    compare it): expq's version, the options, the layout's text, and the source's identity (``source_identity``;
    ``identity``: a directory's list when it was computed elsewhere, by ``local_identity``: with ``--ray`` a task
    reads those bytes, not the driver). Deterministic: no paths, no times."""
    src = plan.source
    return {"expq_version": __version__, "format": plan.format.name, "dtype": dtype,
            "compute_dtype": str(plan.compute_dtype).removeprefix("torch."), "max_shard_size": plan.max_shard_size,
            "layout_sha256": hashlib.sha256(plan.layout.source_text.encode()).hexdigest(),
            "allow_nonfinite": allow_nonfinite, "source": source_identity(src, identity)}


def source_identity(src: Source, identity: list[list] | None = None) -> dict:
    """What any changed byte of the source changes: for a Hub repo, its commit and the Hub's own sha256 (LFS oid)
    of every shard, as the download's metadata gives them (no byte is read); for a directory, every shard's and
    side file's size and full sha256 (``local_identity``, or ``identity`` when it was computed elsewhere)."""
    if src.repo_id and src.commit:
        return {"repo_id": src.repo_id, "commit": src.commit, "shards_sha256": dict(sorted(src.hub_sha256.items()))}
    return {"files": identity if identity is not None else local_identity(src)}


def local_identity(src: Source, threads: int | None = None) -> list[list]:
    """A directory source's identity: [file, size, sha256] of every shard and side file (config.json first, then
    the shards, then the side files), each file read whole in chunks, ``threads`` files at a time (default: one per
    core, at most 8; sha256 releases the GIL). ``docs/benchmarks.md`` has what it costs against a conversion.

    Raises:
        SourceError: a file is not a regular file or cannot be read (EIO...), naming it.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    from .io.regular import sha256_regular

    rels = ["config.json", *(sh.file for sh in src.shards), *src.side_files]
    n = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="expq-identity") as pool:
        sums = list(pool.map(lambda rel: sha256_regular(src.root / rel, "source file"), rels))
    return [[rel, size, digest] for rel, (size, digest) in zip(rels, sums)]


def source_stamps(src: Source) -> dict[str, tuple]:
    """(size, mtime_ns, ctime_ns, inode) of every source file of a directory (empty for a Hub repo: its files are
    pinned by commit and sha256): taken with the identity, compared before the commit (``check_unchanged``)."""
    if src.repo_id and src.commit:
        return {}
    out = {}
    for rel in ["config.json", *(sh.file for sh in src.shards), *src.side_files]:
        st = (src.root / rel).stat()
        out[rel] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return out


def check_unchanged(src: Source, stamps: dict[str, tuple]) -> None:
    """Refuse to commit when a source file was written (or replaced) while it was being converted: its identity,
    hashed before, would no longer describe what was read.

    Raises:
        SourceError: naming the file (the staging folder is discarded: a re-run hashes and converts anew).
    """
    now = source_stamps(src)
    for rel, stamp in stamps.items():
        if now.get(rel) != stamp:
            raise SourceError("changed while it was being converted (size, time or inode differs); nothing was "
                              "committed: re-run once the source is complete", file=str(src.root / rel))


def make_report(plan: Plan, outdir: OutputDir, man: Manifest, devices: list, seconds: float,
            feeder: ShardStream | None, up_to_date: bool = False) -> ConvertReport:
    em, src, rows = plan.experts, plan.source, man.rows
    return ConvertReport(
        out=str(outdir.out), source=src.id, revision=src.revision, commit=src.commit,
        architecture=plan.architecture, model_type=plan.model_type, layout=plan.layout.name, format=plan.format.name,
        compute_dtype=str(plan.compute_dtype).removeprefix("torch."), layers=em.num_layers,
        moe_layers=em.moe_layers, dense_layers=em.dense_layers, experts=em.num_experts,
        tensors_quantized=len(em.tensors), tensors_copied=len(plan.copied), matrices_quantized=len(em.matrices),
        side_files_copied=len(src.side_files), shards=len(plan.shard_names), bytes_in=plan.bytes_in,
        bytes_out=plan.bytes_out, seconds=round(seconds, 3), devices=[str(d) for d in devices],
        zero_rows=rows.zero, underflow_rows=rows.underflow, nonfinite_rows=rows.nonfinite,
        underflow_examples=list(rows.underflow_examples), nonfinite_examples=list(rows.nonfinite_examples),
        up_to_date=up_to_date, shards_resumed=len(outdir.kept),
        stream_peak_bytes=feeder.peak_bytes if feeder is not None else None, warnings=list(outdir.warnings))


def command_line(plan: Plan, dtype: str, allow_nonfinite: bool, layout_given: bool) -> str:
    """The ``expq convert`` command line that reproduces OUT (options that differ from the defaults only; the
    output directory is written ``OUT`` so that the manifest does not depend on where it was written)."""
    src = plan.source.repo_id or plan.source.root.name
    parts = ["expq", "convert", src, "OUT"]
    if plan.source.repo_id and plan.source.commit:
        parts += ["--revision", plan.source.commit]
    if plan.format.name != plan.layout.default_format:
        parts += ["--format", plan.format.name]
    if dtype != "auto":
        parts += ["--dtype", dtype]
    if plan.max_shard_size != DEFAULT_MAX_SHARD:
        parts += ["--max-shard-size", str(plan.max_shard_size)]
    if layout_given:
        parts += ["--layout", Path(plan.layout.path).name]
    if allow_nonfinite:
        parts.append("--allow-nonfinite")
    return shlex.join(parts)


def _source_card(source: Source) -> dict:
    """The source model card's YAML metadata (licence, language, pipeline tag...), if it has a README.md."""
    readme = source.root / "README.md"
    if not readme.is_file():
        return {}
    try:
        from huggingface_hub.repocard import metadata_load

        return metadata_load(readme) or {}
    except Exception:  # noqa: BLE001 - a card we cannot parse carries nothing over
        return {}


def write_side_files(plan: Plan, outdir: OutputDir, stats: RunStats, allow_nonfinite: bool, settings: dict,
                      command: str) -> Manifest:
    """Side files, index and config.json, then expq.json listing every other file's size and sha256."""
    source = plan.source
    for rel in source.side_files:
        if rel == MANIFEST:
            continue
        outdir.copy_file(source.root / rel, rel)
    if len(plan.shard_names) > 1:
        weight_map = {o.name: plan.shard_names[o.shard] for o in plan.outputs}
        outdir.write_text(INDEX_NAME, index_json(weight_map, total_size=sum(plan.shard_sizes)))
    files = [_file_record(outdir, n) for n in outdir.staged_files() if n not in (MANIFEST, CONFIG)]
    man = Manifest.from_plan(plan, stats, allow_nonfinite=allow_nonfinite, command=command,
                             source_card=_source_card(source), settings=settings, files=files)
    # config.json records the manifest's hash, expq.json config.json's (see manifest.canonical_sha256)
    outdir.write_text(CONFIG, config_json(source.config, plan.quantization_config(), manifest_sha256=man.sha256()))
    man = man.model_copy(update={"files": sorted([*files, _file_record(outdir, CONFIG)], key=lambda f: f.name)})
    outdir.write_text(MANIFEST, man.to_json())
    return man


def _file_record(outdir: OutputDir, name: str) -> FileRecord:
    path = outdir.staging / name
    return FileRecord(name=name, size=path.stat().st_size, sha256=outdir.recorded_sha256(name) or sha256_file(path))

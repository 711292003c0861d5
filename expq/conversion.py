"""The steps of a conversion whatever runs it: on this machine (``api.convert``) or from a Ray driver
(``cluster.convert_on_ray``): plan with the refusals, the settings that identify a run, the small files and
``expq.json``, keep or discard a failed run's staging folder, and the report.
"""

from __future__ import annotations

import hashlib
import shlex
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .engines.clients import stock_transformers_misloads
from .errors import ExpqError, Interrupted, SourceError, UsageError, option, resumable
from .formats import FORMATS
from .interrupts import as_interrupted, interrupted_outside_run
from .layouts import Layout
from .io import files
from .io.hashing import sha256_file
from .io.index import INDEX_NAME, index_json
from .manifest import CONFIG, MANIFEST, FileRecord, Manifest
from .options import DEFAULT_MAX_SHARD, parse_size
from .pipeline import RunStats
from .plan import Plan, make_plan
from .source import Source, local_identity
from .version import __version__
from .output import faults
from .output.outdir import OutputDir, is_fresh
from .output.shards import config_json


@dataclass
class ConvertReport:
    """What ``convert`` did. Sizes in bytes, time in seconds.

    ``tensors_quantized`` counts source tensors holding routed experts, ``matrices_quantized`` the expert projection
    matrices (layers x experts x 3); ``tensors_copied`` every other tensor: ``tensors_byte_identical`` copied byte
    for byte plus ``tensors_decoded_not_quantized`` (a quantized source's other weights, written decoded); ``zero_rows`` rows were all zero (scale 0); ``underflow_rows`` had a scale that
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
    tensors_byte_identical: int
    tensors_decoded_not_quantized: int
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


def plan_conversion(source: Source, *, layout: str | Path | Layout | None, dtype: str, max_shard_size: str | int,
                    format: str, allow_random_experts: bool, background_checks: bool = False) -> Plan:
    """``plan.make_plan``, then the refusal of a format stock transformers would load with random experts
    (``refuse_random_experts``). ``background_checks``: as ``make_plan``'s (then ``Plan.finish_checks`` before the
    commit).

    Raises:
        as ``make_plan`` (a bad ``dtype`` or ``max_shard_size`` as UsageError); UsageError: see
        ``refuse_random_experts``.
    """
    try:
        plan = make_plan(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format,
                         background_checks=background_checks)
    except ValueError as e:
        raise UsageError(str(e)) from None
    refuse_random_experts(plan, allowed=allow_random_experts)
    return plan


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


def run_settings(plan: Plan, *, dtype: str, allow_nonfinite: bool, identity: list[list] | None = None,
                 pending: bool = False) -> dict:
    """What makes two conversions the same (recorded in the journal and expq.json; resume and the no-op re-run
    compare it): expq's version, the options, the layout's text, and the source's identity (``source_identity``;
    ``identity``: a directory's list when it was computed elsewhere, by ``source.local_identity``: with ``--ray`` a
    task reads those bytes, not the driver; ``pending``: not known yet, ``BackgroundIdentity`` hashes it while
    the run writes). Deterministic: no paths, no times."""
    src = plan.source
    return {"expq_version": __version__, "format": plan.format.name, "dtype": dtype,
            "compute_dtype": str(plan.compute_dtype).removeprefix("torch."), "max_shard_size": plan.max_shard_size,
            "layout_sha256": hashlib.sha256(plan.layout.source_text.encode()).hexdigest(),
            "allow_nonfinite": allow_nonfinite,
            "source": {"pending": True} if pending else source_identity(src, identity)}


IDENTITY_IN_BACKGROUND_BYTES = 1 << 30
"""A directory source of at least this many bytes, converted into a fresh OUT (``output.outdir.is_fresh``), is
hashed while the conversion runs (``BackgroundIdentity``), not before it: hashing first delays the first write by
the largest shard's sha256 (1.2 GB/s per core, a file per thread: ~4 s for a 5 GB shard, over a minute for a
DeepSeek-V3-sized source's 163 shards on 8 threads). Below it, hashing takes well under a second and comes first."""


def hash_in_background(src: Source, out: str | Path) -> bool:
    """Whether ``src``'s identity is hashed while the run writes (``IDENTITY_IN_BACKGROUND_BYTES``): a directory
    source that large, and an OUT holding no earlier run whose settings need it now."""
    if src.repo_id and src.commit:
        return False  # a Hub repo's identity is its metadata: nothing to hash
    return sum(sh.size for sh in src.shards) >= IDENTITY_IN_BACKGROUND_BYTES and is_fresh(out)


class BackgroundIdentity:
    """``source.local_identity`` of a directory source on a thread of its own while the pipelines write a fresh
    OUT; ``on_done`` (``OutputDir.settle`` of the final settings) is called with it from that thread, so that an
    interrupted run resumes from then on. ``stamps`` (``source_stamps``, taken before the run read anything) are
    checked once the hash is done, before ``on_done``: the pipelines may have read a file before it was hashed, so
    a file written in between would give an identity that does not describe what was converted, and a resume would
    keep shards of the old bytes under the new identity (an uninterrupted run's commit sees it anyway). They still
    guard the commit too."""

    def __init__(self, src: Source, stamps: dict[str, tuple], on_done: Callable[[list[list]], None],
                 stop: threading.Event):
        self.cancel = threading.Event()
        self._identity: list[list] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(src, stamps, on_done, stop), name="expq-identity",
                                        daemon=True)
        self._thread.start()

    def _main(self, src: Source, stamps: dict[str, tuple], on_done: Callable[[list[list]], None],
              stop: threading.Event) -> None:
        try:
            identity = local_identity(src, cancel=self.cancel)
            check_unchanged(src, stamps)  # a file written since the run began: the identity vouches for nothing
            faults.hit("settle")
            if stop.is_set() or self.cancel.is_set():
                return  # the run is stopping: it keeps nothing it cannot vouch for (``keep_or_discard``)
            on_done(identity)
            self._identity = identity
        except BaseException as e:  # noqa: BLE001 - raised by ``wait``
            self._error = e

    def wait(self, stop: threading.Event) -> list[list]:
        """The identity, once hashed and settled.

        Raises:
            SourceError: a source file could not be read, or was written since the run began; OutputError: the journal could not be written;
            Interrupted: ``stop`` was set while waiting (the hashing is stopped).
        """
        while self._thread.is_alive():
            if stop.is_set():
                self.stop()
                raise stop.interrupted()
            self._thread.join(0.1)
        if self._error is not None:
            raise self._error
        if self._identity is None:  # it saw the stop first
            raise stop.interrupted()
        return self._identity

    def stop(self) -> None:
        """Stop hashing (the run failed or was interrupted) and wait for the thread (at most a chunk's read)."""
        self.cancel.set()
        self._thread.join()


def source_identity(src: Source, identity: list[list] | None = None) -> dict:
    """What any changed byte of the source changes: for a Hub repo, its commit and the Hub's own sha256 (LFS oid)
    of every shard, as the download's metadata gives them (no byte is read); for a directory, every shard's and
    side file's size and full sha256 (``source.local_identity``, or ``identity`` when it was computed elsewhere)."""
    if src.repo_id and src.commit:
        return {"repo_id": src.repo_id, "commit": src.commit, "shards_sha256": dict(sorted(src.hub_sha256.items()))}
    return {"files": identity if identity is not None else local_identity(src)}


def source_stamps(src: Source) -> dict[str, tuple]:
    """(size, mtime_ns, ctime_ns, inode) of every source file of a directory (empty for a Hub repo: its files are
    pinned by commit and sha256): taken with the identity, compared before the commit (``check_unchanged``)."""
    if src.repo_id and src.commit:
        return {}
    out = {}
    for rel in ["config.json", *(sh.file for sh in src.shards), *src.side_files]:
        out[rel] = files.stamp((src.root / rel).stat())
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


def keep_or_discard(e: BaseException, plan: Plan, outdir: OutputDir, kept: int) -> None:
    """After a failed run: keep staging and journal when the same command resumes (``errors.resumable``; after an
    interrupt, raises ``Interrupted`` saying how many of the plan's shards are kept), else remove them; after the
    commit, nothing (an interrupt then says that OUT is complete). An interrupt's line promises a resume only as far
    as the plan's checks allow (``Plan.checks_verdict``): one that found a problem makes it say the refusal a re-run
    would meet (nothing is kept), one not yet done makes the resume conditional. The caller re-raises ``e``."""
    stop = as_interrupted(e)
    if outdir.committed:
        if stop is not None:
            raise interrupted_outside_run(stop, committed=True) from None
        return
    verdict = plan.checks_verdict() if stop is not None else True
    refused = verdict if isinstance(verdict, ExpqError) else None  # the error the run would have stopped for
    if resumable(e) and outdir.settled and refused is None:
        outdir.release()  # staging and journal stay: the same command resumes
        if stop is not None:
            resume = "re-run the same command to resume" if verdict is True else (
                "re-run the same command to resume it if the check of the output against transformers' model "
                "class, not finished when the signal came, passes")
            raise Interrupted(stop.signum, f"interrupted by {_name(stop)}; {kept} of {len(plan.shard_names)} "
                                           f"shards are kept: {resume}") from None
    else:
        outdir.discard()
        if refused is not None:
            raise Interrupted(stop.signum, f"interrupted by {_name(stop)}; nothing is kept, as the same command "
                                           f"would be refused: {refused}") from None
        if stop is not None:  # before the source's identity was settled: nothing a re-run could trust
            raise Interrupted(stop.signum, f"interrupted by {_name(stop)} before the source's identity was "
                                           "recorded; nothing is kept: re-run the same command to start again") from None


def _name(stop: Interrupted) -> str:
    return signal.Signals(stop.signum).name


def make_report(plan: Plan, outdir: OutputDir, man: Manifest, devices: list, seconds: float, *,
                stream_peak_bytes: int | None = None, up_to_date: bool = False) -> ConvertReport:
    """The report of a conversion into ``outdir`` (committed, or found up to date), from its manifest."""
    em, src, findings = plan.experts, plan.source, man.rows
    return ConvertReport(
        out=str(outdir.out), source=src.id, revision=src.revision, commit=src.commit,
        architecture=plan.architecture, model_type=plan.model_type, layout=plan.layout.name, format=plan.format.name,
        compute_dtype=str(plan.compute_dtype).removeprefix("torch."), layers=em.num_layers,
        moe_layers=em.moe_layers, dense_layers=em.dense_layers, experts=em.num_experts,
        tensors_quantized=len(em.tensors), tensors_copied=len(plan.unquantized),
        tensors_byte_identical=len(plan.copied), tensors_decoded_not_quantized=len(plan.decoded), matrices_quantized=len(em.matrices),
        side_files_copied=len(src.side_files), shards=len(plan.shard_names), bytes_in=plan.bytes_in,
        bytes_out=plan.bytes_out, seconds=round(seconds, 3), devices=[str(d) for d in devices],
        zero_rows=findings.zero, underflow_rows=findings.underflow, nonfinite_rows=findings.nonfinite,
        underflow_examples=list(findings.underflow_examples), nonfinite_examples=list(findings.nonfinite_examples),
        up_to_date=up_to_date, shards_resumed=len(outdir.kept_files), stream_peak_bytes=stream_peak_bytes,
        warnings=list(outdir.warnings))


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
    if plan.max_shard_size != parse_size(DEFAULT_MAX_SHARD):
        parts += ["--max-shard-size", str(plan.max_shard_size)]
    if layout_given:
        parts += ["--layout", Path(plan.layout.path).name]
    if allow_nonfinite:
        parts.append("--allow-nonfinite")
    return shlex.join(parts)


def write_and_commit(plan: Plan, outdir: OutputDir, stats: RunStats, *, allow_nonfinite: bool, command: str,
                     stamps: dict[str, tuple], stop: threading.Event) -> Manifest:
    """The end of every conversion into OUT, on this machine or from a Ray driver: the small files and expq.json
    (``write_side_files``), the check that no source file changed (``check_unchanged``), a last look at ``stop``,
    and the one commit. Called inside the run's ``interrupts.stop_on_signals``, so that a signal during the commit
    only sets ``stop``: the commit completes (or fails) whole, and the interrupt is raised after it, saying that OUT
    is the complete new checkpoint (``keep_or_discard``).

    Raises:
        as ``write_side_files``, ``check_unchanged`` and ``OutputDir.commit``; Interrupted: ``stop`` was set before
        the commit (nothing committed).
    """
    man = write_side_files(plan, outdir, stats, allow_nonfinite, outdir.fingerprint, command)
    check_unchanged(plan.source, stamps)
    if stop.is_set():  # a signal after the run's last look: not committed
        raise stop.interrupted()
    outdir.commit()
    return man


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

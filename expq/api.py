"""The public entry points ``convert`` and ``inspect``: source -> plan -> pipeline -> output (``--ray``: the
same steps from a Ray driver, ``cluster.convert_on_ray``)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

from . import cluster
from .conversion import (BackgroundIdentity, ConvertReport, command_line, hash_in_background, keep_or_discard,
                         make_report, plan_conversion, run_settings, source_stamps, write_and_commit)
from .devices import parse_devices, warm_up
from .errors import UsageError, resumable
from .interrupts import committed_now, conversion_committed, interrupted_outside_run, stop_on_signals
from .layouts import Layout
from .options import DEFAULT_MAX_SHARD, check_convert, check_inspect
from .pipeline import run_plan
from .plan import DEFAULT_FORMAT, Plan, make_plan
from .source import resolve_source
from .hub.stream import streamed
from .output.outdir import OutputDir, check_out_location
from .output.shards import ShardSet

__all__ = ["ConvertReport", "convert", "inspect"]


def inspect(src: str | Path, *, revision: str | None = None, layout: str | Path | Layout | None = None,
            dtype: str = "auto", max_shard_size: str | int = DEFAULT_MAX_SHARD, token: str | None = None,
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
            device: str = "auto", revision: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD,
            overwrite: bool = False, layout: str | Path | Layout | None = None, allow_nonfinite: bool = False,
            token: str | None = None, fsync: bool = True, stream: bool = False, ray: str | None = None,
            to_hub: str | None = None, private: bool = False, allow_random_experts_in_transformers: bool = False,
            on_plan: Callable[[Plan], None] | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Convert a MoE checkpoint: routed experts to experts_int8 codes and scales, everything else byte for byte.

    Steps: parse the devices; open the source (with ``stream``, its headers only); plan (every check before a byte
    is written, but for the check of the format against transformers' model class: on a cold cache that one runs
    beside the conversion, ``plan.ModelCheck``, and stops it before the commit); take OUT (staging and lock); run
    the plan through the devices (with ``stream``, downloading the shards as they are needed); wait for the
    plan's check; write config, index, side files and ``expq.json``; commit.

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
            cache (peak disk: OUT + 3 source shards; see ``hub.stream``). A killed run resumes from that folder.
        ray: run on a Ray cluster (``local``: a new one on this machine; ``auto``: the one this machine belongs
            to; ``HOST:PORT`` or ``ray://HOST:PORT``; an already initialised Ray is used as it is): the driver
            plans from headers only, one task per group of output shards converts them where the cluster puts it
            (a directory SRC and OUT must be on a filesystem every node sees; a Hub SRC is downloaded by the tasks,
            each its own shards), and the driver records, writes the small files and commits. The output is
            byte-identical. See ``cluster``.
        to_hub: with ``ray``, publish to this Hub model repo instead of writing ``out`` (None): each task uploads
            its shards, the driver makes one commit with them, config, index, ``expq.json`` and the model card
            (``hub.card.model_card``), then checks every remote file's size and sha256. ``private``: create it private.
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
    conversion_committed(False)
    if ray is not None:
        return cluster.convert_on_ray(src, out, ray, to_hub=to_hub, private=private, format=format, dtype=dtype,
                                      device=device, revision=revision, max_shard_size=max_shard_size,
                                      overwrite=overwrite, layout=layout, allow_nonfinite=allow_nonfinite,
                                      token=token, fsync=fsync,
                                      allow_random_experts=allow_random_experts_in_transformers, on_plan=on_plan,
                                      on_progress=on_progress, t0=t0)
    devices = parse_devices(device)
    outdir = plan = None
    try:
        with warm_up(devices), _opened_source(src, out, stream=stream, revision=revision, token=token) as (source,
                                                                                                        feeder):
            plan = plan_conversion(source, layout=layout, dtype=dtype, max_shard_size=max_shard_size, format=format,
                                   allow_random_experts=allow_random_experts_in_transformers,
                                   background_checks=True)
            stamps = source_stamps(source)  # before hashing: a write while it hashes shows at the commit
            later = hash_in_background(source, out)
            settings = run_settings(plan, dtype=dtype, allow_nonfinite=allow_nonfinite, pending=later)
            outdir = OutputDir(out, fingerprint=settings, overwrite=overwrite, src_root=source.root,
                               settled=not later)
            if _up_to_date(outdir):
                return make_report(plan, outdir, outdir.existing.record, devices, time.perf_counter() - t0,
                                   stream_peak_bytes=_peak(feeder), up_to_date=True)
            outdir.start()
            shards = identity = None
            try:
                shards = ShardSet(plan, outdir, fsync=fsync)
                with stop_on_signals() as stop:
                    if later:
                        identity = BackgroundIdentity(source, stamps, lambda ident: outdir.settle(run_settings(
                            plan, dtype=dtype, allow_nonfinite=allow_nonfinite, identity=ident)), stop)
                    if on_plan:
                        on_plan(plan)
                    stats = run_plan(plan, shards, devices, allow_nonfinite=allow_nonfinite, on_progress=on_progress,
                                     done_jobs=outdir.done_jobs, stop=stop, feeder=feeder)
                    if identity is not None:
                        identity.wait(stop)
                    plan.finish_checks(stop)
                    man = write_and_commit(plan, outdir, stats, allow_nonfinite=allow_nonfinite, stamps=stamps,
                                           command=command_line(plan, dtype, allow_nonfinite, layout is not None),
                                           stop=stop)
                shards.close_all()  # every shard is closed and hashed by now: this stops the idle hasher thread
            except BaseException as e:
                if identity is not None:
                    identity.stop()
                if shards is not None:
                    shards.close_all()
                keep_or_discard(e, plan, outdir, len(shards.closed) if shards is not None else 0)
                raise
        return make_report(plan, outdir, man, devices, time.perf_counter() - t0, stream_peak_bytes=_peak(feeder))
    except KeyboardInterrupt as e:  # a signal outside the run (cli: ``interrupts.raise_on_signals``)
        raise interrupted_outside_run(e, committed=committed_now()) from None
    finally:
        if plan is not None:
            plan.cancel_checks()  # a conversion that ended early leaves no check running


def _up_to_date(outdir: OutputDir) -> bool:
    """Whether OUT already holds this conversion (then the partial run of the same settings is dropped and the lock
    given up); the lock is given up after an error too."""
    try:
        if not outdir.up_to_date():
            return False
        outdir.finish_up_to_date()
        return True
    except BaseException:
        outdir.release()
        raise


def _peak(feeder) -> int | None:
    """``--stream``: the most bytes its folder held at once (``StreamFeeder.peak_bytes``); else None."""
    return feeder.peak_bytes if feeder is not None else None


@contextlib.contextmanager
def _opened_source(src: str | Path, out: str | Path, *, stream: bool, revision: str | None, token: str | None):
    """(the Source, the StreamFeeder that feeds its shards, or None): ``resolve_source``, or with ``stream``
    ``hub.stream.streamed`` (the stream folder is removed after a success and after an error that is not
    ``resumable``)."""
    if not stream:
        yield resolve_source(src, revision=revision, token=token), None
        return
    with streamed(str(src), out, revision=revision, token=token, keep=resumable) as opened:
        yield opened



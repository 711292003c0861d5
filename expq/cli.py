"""The ``expq`` command line: parse, call the Python API, render with rich. No work happens here that the API does
not expose.

Exit statuses are the README's ("Promises, and exit statuses"): 0 success; 1 a failed check or a conversion error
(one line naming file/tensor/expert/row); 2 usage errors and unreadable input; 3-7 the Hub's answers; 128 + the
signal when interrupted. Set ``EXPQ_DEBUG=1`` to see tracebacks.

Output: user text (paths, tensor names, prompts, generated text, error messages) is always printed literally, never
as rich markup. On a terminal, rich tables and bars; when stdout or stderr is not a terminal, plain lines that are
never wrapped or truncated (tables become a title line and tab-separated rows), and progress on stderr as plain
lines every ``EXPQ_PROGRESS_INTERVAL`` seconds (see ``expq.progress``). ``--json`` output and ``expq run``'s
generated text never go through rich when piped.
"""

from __future__ import annotations

if __name__ == "__main__":  # ``python -m expq.cli``: from its first line (``console`` takes over once imported)
    from expq.interrupts import guard_start

    guard_start()

import contextlib
import errno
import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Iterable, Optional, Sequence

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand

from . import options
from .options import format_size
from .errors import ExpqError, cli_options, visible
from .interrupts import (STOP, as_interrupted, committed_now, end_on_signals, ending_at_once,
                         interrupted_outside_run, raise_on_signals)
from .formats import AUTO, FORMATS
from .progress import ProgressLines, interactive, interval, is_tty, quiet_hub_bars


class _Command(TyperCommand):
    """A command whose usage line names its arguments the usual way (``SRC [OUT]``: required bare, optional in
    brackets), not as typer writes a required one (``{src}``)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument):
                pieces.append(p.display_name_raw if p.required else f"[{p.display_name_raw}]")
        return pieces


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact experts-only int8 (vLLM experts_int8) conversion of Hugging Face MoE checkpoints.")
command = functools.partial(app.command, cls=_Command)
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

Cell = str | Text


def _cell(c: Cell) -> Text:
    return Text(visible(c.plain), style=c.style) if isinstance(c, Text) else Text(visible(str(c)))


def _say(text: Cell, *, stderr: bool = False, style: str | None = None, exact: bool = False) -> None:
    """Print one line of user text literally (``visible``, unless ``exact``: a model's generated text, which
    ``run`` prints as it is): a rich ``Text`` (no markup, never wrapped) on a terminal, a plain ``print`` when the
    stream is redirected."""
    stream = sys.stderr if stderr else sys.stdout
    plain = text.plain if isinstance(text, Text) else text
    plain = plain if exact else visible(plain)
    try:
        if is_tty(stream):
            t = Text(plain, style=text.style if isinstance(text, Text) else style or "")
            (err if stderr else out).print(t, soft_wrap=True)
        else:
            print(plain, file=stream, flush=True)
    except (OSError, ValueError):  # ValueError: a closed stream
        if not stderr:
            raise
        # stderr cannot be written (closed, a full disk, a hung-up terminal): its lines are lost, the work goes on


def _stdout_failed(e: BaseException) -> None:
    """stdout could not be written (a broken pipe, a full disk, closed): one ``WARNING:`` line on stderr naming it;
    stdout then goes to /dev/null, so that nothing later (the interpreter's own flush) fails on it again. The exit
    status stays the command's own (README: "Promises, and exit statuses")."""
    reason = f"[Errno {e.errno}] {e.strerror}" if isinstance(e, OSError) and e.errno else str(e) or type(e).__name__
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    _warn([f"cannot write to <stdout>: {reason}; the output was lost, the work itself was done"])


def _to_stdout(write, *args) -> None:
    """``write(*args)``: a command's printing of its result on stdout. stdout that cannot be written (closed from
    the start, a broken pipe, a full disk) is ``_stdout_failed``'s one line, never an error of the command, whose
    work and exit status stand."""
    try:
        if sys.stdout is None:  # started with descriptor 1 closed: print() would drop everything silently
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        write(*args)
        sys.stdout.flush()
    except (OSError, ValueError) as e:
        _stdout_failed(e)


def _table(title: str | None, columns: Sequence[str] | None, rows: Iterable[Sequence[Cell]], *,
           no_wrap: Sequence[str] = (), **table_kw) -> None:
    """Print a table on stdout. On a terminal a rich ``Table`` whose every cell is a literal ``Text``; otherwise
    the title on its own line, then the header (if ``columns``) and each row as tab-separated cells, in full (a
    line break or tab in user text shown escaped: one line per row, one column per cell)."""
    rows = list(rows)
    if not is_tty(sys.stdout):
        lines = ([visible(title, one_line=True)] if title else []) + (["\t".join(columns)] if columns else [])
        lines += ["\t".join(visible(_cell(c).plain, one_line=True) for c in r) for r in rows]
        print("\n".join(lines), flush=True)
        return
    t = Table(show_header=bool(columns), title=Text(visible(title)) if title else None, title_justify="left",
              **table_kw)
    for col in columns or [""] * (len(rows[0]) if rows else 0):
        t.add_column(col, no_wrap=col in no_wrap, min_width=len(col) if col in no_wrap else None)
    for r in rows:
        t.add_row(*(_cell(c) for c in r))
    out.print(t)


@contextlib.contextmanager
def errors_to_exit_codes(interrupted=as_interrupted):
    """The one error handler: an ``ExpqError`` becomes its one line and its exit status; a signal (a
    ``KeyboardInterrupt`` raised by ``interrupts.raise_on_signals``, or Python's Ctrl-C) ``interrupted(e)``'s line
    (default: which signal) and 128 + the signal; anything else one line and 1 (``EXPQ_DEBUG=1`` re-raises, for
    the traceback). User text is printed literally, never as markup. Messages made inside name options as this
    command line's flags (``errors.cli_options``)."""
    try:
        with cli_options():
            yield
    except (typer.Exit, SystemExit) as e:
        if (cause := _typer_interrupt(e)) is None:
            raise
        _fail(interrupted(cause))
    except BaseException as e:  # noqa: BLE001
        if os.environ.get("EXPQ_DEBUG"):
            raise
        if not isinstance(e, (KeyboardInterrupt, ExpqError)) and STOP.is_set():
            e = KeyboardInterrupt()  # an error a signal caused (one landing in an import: RecursionError...)
        _fail(interrupted(e) if isinstance(e, KeyboardInterrupt) else e)


def _typer_interrupt(e: BaseException | None) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` that typer turned into a silent exit 130 (``Exit(130) from`` it, then
    ``SystemExit``), or None."""
    while e is not None:
        if isinstance(e.__cause__, KeyboardInterrupt):
            return e.__cause__
        e = e.__context__
    return None


def _fail(e: BaseException) -> None:
    """``errors_to_exit_codes``'s line for ``e`` on stderr (one line: a line break in user text shown escaped), and
    its exit status (``typer.Exit``)."""
    if isinstance(e, ExpqError):
        line, code = f"error: {e}", e.exit_code
    elif isinstance(e, MemoryError):
        line, code = "error: out of memory", 1
    else:
        msg = str(e).splitlines()[0] if str(e) else ""
        line, code = f"error: {type(e).__name__}: {msg} (EXPQ_DEBUG=1 shows the traceback)", 1
    _say(Text(visible(line, one_line=True), style="bold red"), stderr=True, exact=True)  # one line, always
    raise typer.Exit(code) from None


def _warn(warnings: Iterable[str]) -> None:
    """Warnings a user must not miss: one bold line each on stderr (line breaks in user text shown escaped)."""
    for w in warnings:
        _say(Text(visible(f"WARNING: {w}", one_line=True), style="bold red"), stderr=True, exact=True)


@command()
def convert(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Source checkpoint: a local directory or a Hub repo id.")],
    out_dir: Annotated[Optional[str], typer.Argument(metavar="OUT", help="Output directory (must not exist or "
                                                      "be empty); omitted with --to-hub.")] = None,
    format: Annotated[str, typer.Option("--format", help=f"Output format: {AUTO} (the family's default; inspect says "
                                        f"which and why), {' or '.join(FORMATS)}.")] = AUTO,
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto (vLLM's --dtype auto rule), bfloat16, float16, "
                                            "float32.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or cuda:0,cuda:1,...")] = "auto",
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 500MB.")] = options.DEFAULT_MAX_SHARD,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a checkpoint already in OUT.")] = False,
    layout: Annotated[Optional[Path], typer.Option(help="Layout file for an architecture expq does not know "
                                                        "(see configs/README.md).")] = None,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Quantize rows holding NaN/inf as vLLM "
                                                                            "would, instead of refusing.")] = False,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or your login).",
                                                 show_default=False)] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Hub repos only: plan from the shard headers, then "
                                                          "download the shards a few at a time into "
                                                          ".<OUT>.expq-stream/ beside OUT and delete each once "
                                                          "converted (peak disk: OUT + 3 source shards; no Hub "
                                                          "cache). A killed run resumes.")] = False,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="local|auto|ADDRESS",
                                               help="Run on a Ray cluster: local (a new one on this machine), auto "
                                                    "(the one this machine belongs to) or HOST:PORT / "
                                                    "ray://HOST:PORT. One task per group of output shards; the same "
                                                    "bytes as without.")] = None,
    to_hub: Annotated[Optional[str], typer.Option("--to-hub", metavar="REPO",
                                                  help="With --ray: publish to this Hub model repo instead of OUT "
                                                       "(the tasks upload their shards; one commit).")] = None,
    private: Annotated[bool, typer.Option("--private", help="With --to-hub: create the repo private.")] = False,
    allow_random_experts_in_transformers: Annotated[bool, typer.Option(
        "--allow-random-experts-in-transformers",
        help="Write a --format that stock transformers would load with randomly initialised experts for this "
             "family (one stock transformers reads, where the family's layout says [clients] transformers = false; "
             "inspect warns), for a checkpoint only meant for vLLM or expq; refused without this flag. verify and "
             "the model card say so.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Convert SRC to OUT: routed experts to experts_int8 int8 codes + scales, everything else byte for byte."""
    # a signal that no handler of the API saw (before it started, or as it returned) says what OUT holds
    with errors_to_exit_codes(lambda e: interrupted_outside_run(e, committed=committed_now())):
        # usage errors first: before torch is imported and the source opened
        options.check_convert(src, out_dir, format=format, dtype=dtype, device=device, max_shard_size=max_shard_size,
                              stream=stream, ray=ray, to_hub=to_hub)
        interval()
        if not stream and ray is None and os.path.isdir(src):  # hashed while torch imports (``io.early_hash``)
            from .io import early_hash
            early_hash.start(src)
        with ending_at_once():  # nothing written yet; a signal inside torch's start-up must not raise there
            from .api import convert as api_convert

        quiet_hub_bars()
        with _ConvertProgress(enabled=not as_json) as bar:
            report = api_convert(src, out_dir, format=format, dtype=dtype, device=device, revision=revision,
                                 max_shard_size=max_shard_size, overwrite=overwrite, layout=layout,
                                 allow_nonfinite=allow_nonfinite, token=token, stream=stream, ray=ray,
                                 to_hub=to_hub, private=private,
                                 allow_random_experts_in_transformers=allow_random_experts_in_transformers,
                                 on_plan=bar.on_plan, on_progress=bar.on_progress)
        _warn(report.warnings)
        _to_stdout(_print_convert, report, as_json)  # OUT is committed whatever happens to its summary


def _print_convert(report, as_json: bool) -> None:
    """convert's result on stdout: the report as one JSON object, or its table (underflow examples on stderr).

    Raises:
        OSError: stdout cannot be written."""
    if as_json:
        print(json.dumps(report.to_dict()), flush=True)
        return
    rows = [
        ("architecture", f"{report.architecture} ({report.layout} layout)"),
        ("MoE layers / dense", f"{len(report.moe_layers)} / {len(report.dense_layers)} of {report.layers}"),
        ("routed experts per layer", str(report.experts)),
        ("matrices quantized", f"{report.matrices_quantized} ({report.tensors_quantized} source tensors)"),
        ("tensors copied byte for byte", str(report.tensors_byte_identical)),
        *([("tensors decoded, not quantized", str(report.tensors_decoded_not_quantized))]
          if report.tensors_decoded_not_quantized else []),
        ("compute dtype", report.compute_dtype),
        ("size", f"{format_size(report.bytes_in)} -> {format_size(report.bytes_out)} "
                 f"({report.shards} shard{'s' if report.shards != 1 else ''})"),
        ("time", f"{report.seconds:.1f} s on {', '.join(report.devices)}"),
        ("zero rows (scale 0)", str(report.zero_rows)),
        ("rows with underflowed scale", str(report.underflow_rows)),
    ]
    if report.nonfinite_rows:
        rows.append(("non-finite rows (allowed)", str(report.nonfinite_rows)))
    if report.ray_tasks is not None:
        rows.append(("ray tasks", f"{len(report.ray_tasks)} (writing {sum(map(len, report.ray_tasks))} shards)"))
    for url in report.hub_commits or []:
        rows.append(("commit", url))
    if report.stream_peak_bytes is not None:
        rows.append(("stream folder at most", format_size(report.stream_peak_bytes)))
    if report.up_to_date:
        rows.append(("status", "up to date: OUT already holds this conversion (every file's sha256 checked)"))
    elif report.shards_resumed:
        rows.append(("resumed", f"{report.shards_resumed} shards kept from the interrupted run (content checked)"))
    _table(f"expq convert -> {report.out}", None, rows)
    for ex in report.underflow_examples[:5]:
        _say(f"  underflow: {ex}", stderr=True)


class _ConvertProgress:
    """Convert's progress on stderr, fed by ``convert``'s ``on_plan`` / ``on_progress`` callbacks: a one-line
    description of the plan, then a rich bar on an interactive terminal, or plain lines every
    ``EXPQ_PROGRESS_INTERVAL`` seconds and one at the end when stderr is redirected or ``CI`` is set."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        self.task = None
        self.lines: ProgressLines | None = None
        self.shards = 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.lines is not None and exc_type is None:
            self.lines.finish()

    def on_plan(self, plan) -> None:
        """Describe the plan and start the bar (or the plain lines)."""
        if not self.enabled:
            return
        em = plan.experts
        _say(f"{plan.source.id}: {plan.architecture or plan.model_type} ({plan.layout.name} layout), "
             f"{len(em.moe_layers)} MoE layers x {em.num_experts} experts, compute dtype "
             f"{str(plan.compute_dtype).removeprefix('torch.')}", stderr=True)
        self.shards = len(plan.shard_names)
        if not interactive():
            self.lines = ProgressLines(plan.bytes_in, self.shards, write=lambda line: _say(line, stderr=True))
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.progress = Progress(TextColumn("converting", style="bold blue"), BarColumn(), DownloadColumn(),
                                 TextColumn("{task.fields[shards]}", markup=False), TransferSpeedColumn(),
                                 TimeRemainingColumn(), console=err, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("convert", total=plan.bytes_in, shards=f"0/{self.shards} shards")

    def on_progress(self, nbytes: int, shards_done: int) -> None:
        """One source tensor done (called from worker threads)."""
        if self.progress is not None:
            self.progress.update(self.task, advance=nbytes, shards=f"{shards_done}/{self.shards} shards")
        elif self.lines is not None:
            self.lines.advance(nbytes, shards_done)


@command()
def inspect(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Source checkpoint: a local directory or a Hub repo id.")],
    revision: Annotated[Optional[str], typer.Option(help="Hub revision.")] = None,
    layout: Annotated[Optional[Path], typer.Option(help="Layout file (see configs/README.md).")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype (as for convert).")] = "auto",
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard.")] = options.DEFAULT_MAX_SHARD,
    format: Annotated[str, typer.Option("--format", help="Output format (as for convert).")] = AUTO,
    token: Annotated[Optional[str], typer.Option(help="Hub token.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor and what happens to it.")] = False,
) -> None:
    """Show what convert would do, without writing anything."""
    with errors_to_exit_codes():
        options.check_inspect(src, format=format, dtype=dtype, max_shard_size=max_shard_size)
    with ending_at_once():
        from .api import inspect as api_inspect

    quiet_hub_bars()
    with errors_to_exit_codes():
        plan = api_inspect(src, revision=revision, layout=layout, dtype=dtype, max_shard_size=max_shard_size,
                           token=token, format=format)
    s = plan.summary()
    if tensors:
        s["tensors"] = plan.tensor_table()
    _to_stdout(_print_inspect, s, as_json, tensors)


def _print_inspect(s: dict, as_json: bool, tensors: bool) -> None:
    """inspect's result on stdout: the plan's summary as one JSON object, or its tables (warnings on stderr).

    Raises:
        OSError: stdout cannot be written."""
    if as_json:
        print(json.dumps(s))
        return
    rows = [("architecture", f"{s['architecture']} (model_type {s['model_type']})"),
            ("source format", s["source_format"]),
            ("layout", f"{s['layout']} ({s['layout_rule']}), detected by {s['detected_by']}"),
            ("config keys", ", ".join(f"{k} <- {v}" for k, v in s["config_keys"].items())),
            ("layers", f"{s['num_layers']}: MoE {s['moe_layers']}, dense {s['dense_layers']}")]
    if s["extra_expert_layers_copied"]:
        rows.append(("expert layers past num_layers (copied)", str(s["extra_expert_layers_copied"])))
    n = s["output_shards"]
    rows += [("routed experts per layer", f"{s['routed_experts_per_layer']} (top_k {s['top_k']})"),
             ("compute dtype", f"{s['compute_dtype']}: {s['compute_dtype_reason']}"),
             ("to quantize", f"{s['matrices_quantized']} matrices from {s['source_tensors_quantized']} tensors "
                             f"({format_size(s['bytes_quantized_in'])})"),
             _not_quantized_row(s),
             ("output format", f"{s['format']}: {s['format_reason']}"),
             *(row for c in s["clients"] for row in
               [(f"  {c['engine']}", c["command"] if c["loads"] else f"cannot: {c['note']}")]
               + [(f"    {v['when']}", v["command"]) for v in c["commands"]]),
             ("size", f"{format_size(s['bytes_in'])} -> {format_size(s['bytes_out'])} in {n} shard{'s' if n != 1 else ''}")]
    for how, n in s["decoded_as"].items():
        rows.append(("decoded from the source format", f"{n} {how}"))
    if s["skipped_files"]:
        rows.append(("not copied (other weight formats)", ", ".join(s["skipped_files"][:6])))
    _table(f"expq inspect {s['source']}", None, rows)
    _warn(s["warnings"])
    if tensors:  # on a terminal, long names fold onto the next line rather than being cut
        _table(None, ("tensor", "dtype", "shape", "action"),
               ((Text(row["name"], overflow="fold"), row["dtype"], str(row["shape"]),
                 row["action"] + (f" ({row['decoded']})" if row["decoded"] else "")) for row in s["tensors"]))


def _not_quantized_row(s: dict) -> tuple[str, str]:
    """inspect's row for the tensors not quantized: copied byte for byte, and decoded where the source is quantized."""
    n_copy, n_dec = s["source_tensors_byte_identical"], s["source_tensors_decoded_not_quantized"]
    files = f"({format_size(s['bytes_copied'])}), {len(s['side_files'])} side files"
    if not n_dec:
        return "to copy", f"{n_copy} tensors {files}"
    return "not quantized", f"{n_copy} tensors copied byte for byte and {n_dec} decoded {files}"


@command()
def verify(
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    source: Annotated[Optional[str], typer.Option(help="Source checkpoint (directory or Hub repo id): adds the "
                                                       "bit-for-bit and byte-for-byte checks.")] = None,
    device: Annotated[str, typer.Option(help="Where the kernel check runs: auto, cpu, cuda, cuda:N.")] = "auto",
    tokens: Annotated[int, typer.Option(help="Random tokens per MoE layer for the kernel check.")] = 64,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of --source.")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token for --source (default: HF_TOKEN or your login).",
                                                 show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Prove a converted checkpoint right: structure, bits against the source, and the int8 fused-MoE kernel.
    Exit 0 if every check passes, 1 if any fails, 2 on usage errors or unreadable input."""
    with errors_to_exit_codes():
        options.check_verify(device=device, tokens=tokens, out=out_dir)
    with ending_at_once():
        from .verifier import verify as api_verify

    quiet_hub_bars()
    with errors_to_exit_codes():
        report = api_verify(out_dir, source=source, device=device, tokens=tokens, revision=revision, token=token)
    # the verdict is the exit status, whatever happens to the report
    _to_stdout(lambda: print(json.dumps(report.to_dict())) if as_json else _print_verify(report))
    raise typer.Exit(report.exit_code)


def _print_verify(report) -> None:
    """The verify report: per-layer table, checks table, legend and verdict (problems on stderr)."""
    from rich import box

    fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    passed = lambda ok: Text("pass", style="green") if ok else Text("FAIL", style="red")  # noqa: E731
    rows = []
    for r in report.layers:
        bits = "-" if r.codes_differ is None else ("equal" if r.codes_differ == r.scales_differ == 0 else
                                                   f"{r.codes_differ}c/{r.scales_differ}s")
        rows.append((str(r.layer), f"{r.experts_exercised}/{r.experts}", bits,
                     "-" if r.max_row_error_steps is None else f"{r.max_row_error_steps:.2f}",
                     fmt(r.kernel_rel_err), fmt(r.kernel_worst_token_err), fmt(r.source_rel_err), passed(r.ok)))
    cols = ("layer", "experts", "bits", "row err", "kernel", "worst tok", "vs src", "result")
    _table(f"expq verify {report.out}", cols, rows, no_wrap=cols, box=box.SIMPLE_HEAD, pad_edge=False,
           padding=(0, 1))
    _table("checks", ("check", "result", "detail"), ((ch.name, passed(ch.ok), ch.detail) for ch in report.checks))
    _say(f"row err: worst |w - q*s| over rows, in steps s ({report.activation_dtype} allows "
         f"{report.row_error_limit:.2f}: w/s is rounded to {report.activation_dtype} before round()); "
         "kernel / worst tok: relative error against the fp32 reference (layer / worst token); "
         "vs src: against the source experts")
    _say(f"kernel: {report.backend} on {report.device}, {report.activation_dtype} activations, "
         f"{report.tokens} tokens per layer; {report.seconds:.1f} s")
    for p in report.problems[:10]:
        _say(Text("  problem: ", style="red") + Text(p), stderr=True)
    _warn(report.warnings)
    _say(Text(report.verdict, style="bold green" if report.ok else "bold red"))


@command()
def run(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    prompt: Annotated[str, typer.Option(help="Prompt text (or space-separated token ids if the checkpoint has no "
                                             "tokenizer).")] = "Hello",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (greedy).")] = 20,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N (default: CUDA if available).")] = None,
) -> None:
    """Smoke-test a converted model: load it with int8 experts (expq.load_model) and generate greedily."""
    with errors_to_exit_codes():
        options.check_run(device=device, max_new_tokens=max_new_tokens, prompt=prompt)
    with ending_at_once():
        from .runtime import generate

    quiet_hub_bars()
    with errors_to_exit_codes():
        g = generate(out_dir, prompt, max_new_tokens=max_new_tokens, device=device)
    _say(f"{g.model_class}: routed experts int8 in memory ({format_size(g.experts_bytes)}), "
         f"rest {format_size(g.other_bytes)}, on {g.device}", stderr=True)
    if g.text is not None:  # the generated text, exactly: the one output not escaped (``visible``)
        _say(g.text, exact=True)
        _say(f"token ids: {g.new_ids}", stderr=True)
    else:
        _say(" ".join(str(t) for t in g.new_ids))


@command()
def push(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    repo_id: Annotated[str, typer.Argument(metavar="REPO_ID", help="Hub model repo, namespace/name (created if "
                                                                   "needed).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created if missing).")] = None,
    create_pr: Annotated[bool, typer.Option("--create-pr", help="Open a pull request instead.")] = False,
    commit_message: Annotated[Optional[str], typer.Option(help="Commit message.")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or your login).",
                                                 show_default=False)] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Push without verifying first.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the files and the model card; no network.")] = False,
    install: Annotated[Optional[str], typer.Option(
        "--install", metavar="COMMAND",
        help="The command the card gives to install expq, e.g. "
             "'pip install \"expq @ git+https://HOST/ORG/expq@COMMIT\"' (default: $EXPQ_INSTALL, else derived from how "
             "this expq was installed; a warning when unknown).",
        show_default=False)] = None,
    base_model: Annotated[Optional[str], typer.Option(
        "--base-model", metavar="REPO_ID", help="The card's base_model: the source's Hub repo id, for a checkpoint "
        "converted from a local directory (default: the repo convert recorded).", show_default=False)] = None,
    license: Annotated[Optional[str], typer.Option(
        "--license", metavar="ID", help="The card's licence, a Hub licence id such as apache-2.0 (default: the "
        "source card's).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Publish a converted checkpoint to the Hub with a model card (verify first; resumable; checked after)."""
    with errors_to_exit_codes():
        options.check_repo_id(repo_id)
    with ending_at_once():
        from .hub.push import push as api_push
        from .hub.push import report_json

    quiet_hub_bars()
    with errors_to_exit_codes():
        res = api_push(out_dir, repo_id, private=private, revision=revision, create_pr=create_pr,
                       commit_message=commit_message, token=token, skip_verify=skip_verify, dry_run=dry_run,
                       install=install, base_model=base_model, license=license)
    _warn(res.warnings)
    if as_json:
        print(report_json(res))
        return
    if dry_run:
        _table(f"expq push --dry-run: would upload to {repo_id}", ("file", "size"),
               ((Text(f["path"], overflow="fold"), format_size(f["size"])) for f in res.files))
        _say(f"{len(res.files)} files, {format_size(res.bytes)}; verify: {res.verify_verdict or 'skipped'}")
        sys.stdout.write("\n--- README.md (model card) ---\n\n" + res.card + "\n")
        return
    _say(Text(f"pushed {len(res.files)} files ({format_size(res.bytes)}) to {repo_id}"
                   f"{' (' + res.revision + ')' if res.revision else ''}; remote sizes and hashes match"))
    for url in (res.pr_url, res.commit_url):
        if url:
            _say(url)


def main() -> None:
    """The command line in this process: runs ``expq`` on ``sys.argv`` and ends with ``SystemExit`` (its exit
    status). When stdout or stderr is not a terminal, usage errors and help are click's plain text (typer's rich
    panels would wrap them at 80 columns)."""
    try:
        with errors_to_exit_codes(_between_steps):
            if not (is_tty(sys.stdout) and is_tty(sys.stderr)):
                app.rich_markup_mode = None
            app(prog_name="expq")  # also under python -m expq.cli (the demo)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)


def _between_steps(e: BaseException):
    """A signal no command's own handler saw (typer parsing the command line, or a command returning): re-running
    the same command is always right (a conversion resumes, or finds OUT up to date); after a conversion's commit
    the line says that OUT is complete."""
    if committed_now():
        return interrupted_outside_run(e, committed=True)
    stop = as_interrupted(e)
    return as_interrupted(e, f"interrupted by {signal.Signals(stop.signum).name}; re-run the same command")


def console() -> None:
    """The command line (the ``expq`` console script, through ``launch.main``, and ``python -m expq.cli``): ``main``,
    then, once its output is flushed, the process ends at once (``os._exit``) instead of tearing the interpreter
    down, which costs a conversion about a second (measured on a 2-core CPU: 0.9 s after a small conversion; every
    module, torch's included, finalised for a process that is about to end). Everything a command writes is committed before it returns. The normal
    exit is kept where something still runs or must be finalised: a thread that is not a daemon, Ray (its atexit
    hooks stop its workers), or an exit status that is not a number.

    Signals: while the command runs, SIGINT, SIGTERM and SIGHUP end it with one line and 128 + the signal
    (``interrupts.raise_on_signals``); once it has returned, its outcome is printed and decided, and a signal ends
    the process at once with that status. Output that cannot be flushed (stdout closed, a broken pipe, a full
    disk) is one ``WARNING:`` line on stderr; the status stays the command's."""
    raise_on_signals()
    for fd in (0, 1, 2):  # a descriptor the process was started without gets /dev/null, never a file expq opens
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)
    code = _run_main()
    try:
        if sys.stdout is not None:  # None: the process was started with descriptor 1 closed
            sys.stdout.flush()
    except (OSError, ValueError) as e:
        _stdout_failed(e)
    with contextlib.suppress(OSError, ValueError):
        if sys.stderr is not None:
            sys.stderr.flush()
    if not _may_end_at_once(code):
        sys.exit(code)
    os._exit(code or 0)


def _run_main():
    """``main``'s exit status. Once it is known the outcome is decided: a signal then ends the process at once
    with it (``end_on_signals``). A signal that escaped every handler of the command (as ``main`` returned) is its
    one line and 128 + the signal, the line saying what a conversion's OUT holds."""
    code = None
    try:
        try:
            main()
            code = 0
        except SystemExit as ex:
            code = ex.code
        if isinstance(code, int) and not isinstance(code, bool):
            end_on_signals(status=code)
    except KeyboardInterrupt as e:
        if code is not None:  # the command's outcome was decided before the signal: it stands
            end_on_signals(status=code if isinstance(code, int) else None)
            return code
        stop = _between_steps(e)
        end_on_signals(status=stop.exit_code)
        _say(Text(f"error: {stop}", style="bold red"), stderr=True)
        return stop.exit_code
    return code


def _may_end_at_once(code) -> bool:
    import threading

    alive = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    return (code is None or (isinstance(code, int) and not isinstance(code, bool))) and not alive \
        and "ray" not in sys.modules


if __name__ == "__main__":
    console()

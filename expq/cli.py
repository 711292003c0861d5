"""The ``expq`` command line: parse, call the Python API, render with rich. No work happens here that the API does
not expose.

Exit status: 0 success; 1 a failed check or a conversion error (one line naming file/tensor/expert/row); 2 usage
errors and unreadable input. Set ``EXPQ_DEBUG=1`` to see tracebacks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import ExpqError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact experts-only int8 (vLLM experts_int8) conversion of Hugging Face MoE checkpoints.")
err = Console(stderr=True)
out = Console()


def _fail(e: BaseException) -> None:
    if os.environ.get("EXPQ_DEBUG"):
        raise e
    if isinstance(e, ExpqError):
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code)
    if isinstance(e, KeyboardInterrupt):
        err.print("[bold red]interrupted[/]")
        raise typer.Exit(130)
    if isinstance(e, MemoryError):
        err.print("[bold red]error:[/] out of memory")
        raise typer.Exit(1)
    msg = str(e).splitlines()[0] if str(e) else ""
    err.print(f"[bold red]error:[/] {type(e).__name__}: {msg} (EXPQ_DEBUG=1 shows the traceback)", highlight=False,
              soft_wrap=True)
    raise typer.Exit(1)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Source checkpoint: a local directory or a Hub repo id.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory (must not exist or be empty).")],
    format: Annotated[str, typer.Option("--format", help="Output format.")] = "compressed-tensors",
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto (vLLM's --dtype auto rule), bfloat16, float16, "
                                            "float32.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or cuda:0,cuda:1,...")] = "auto",
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 500MB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a checkpoint already in OUT.")] = False,
    layout: Annotated[Optional[Path], typer.Option(help="Layout file for an architecture expq does not know "
                                                        "(see configs/README.md).")] = None,
    allow_nonfinite: Annotated[bool, typer.Option("--allow-nonfinite", help="Quantize rows holding NaN/inf as vLLM "
                                                                            "would, instead of refusing.")] = False,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or your login).",
                                                 show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")] = False,
) -> None:
    """Convert SRC to OUT: routed experts to experts_int8 int8 codes + scales, everything else byte for byte."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    from .api import convert as api_convert

    progress = None
    state: dict = {}

    def on_plan(plan) -> None:
        nonlocal progress
        if as_json:
            return
        err.print(f"[bold]{plan.source.id}[/]: {plan.architecture or plan.model_type} ({plan.layout.name} layout), "
                  f"{len(plan.moe_layers)} MoE layers x {plan.num_experts} experts, compute dtype "
                  f"{str(plan.compute_dtype).removeprefix('torch.')}", highlight=False)
        progress = Progress(TextColumn("[bold blue]converting"), BarColumn(), DownloadColumn(),
                            TextColumn("{task.fields[shards]}"), TransferSpeedColumn(), TimeRemainingColumn(),
                            console=err, transient=False)
        progress.start()
        state["task"] = progress.add_task("convert", total=plan.bytes_in, shards=f"0/{len(plan.shard_names)} shards")
        state["n"] = len(plan.shard_names)

    def on_progress(nbytes: int, shards_done: int) -> None:
        if progress is not None:
            progress.update(state["task"], advance=nbytes, shards=f"{shards_done}/{state['n']} shards")

    try:
        report = api_convert(src, out_dir, format=format, dtype=dtype, device=device, revision=revision,
                             max_shard_size=max_shard_size, overwrite=overwrite, layout=layout,
                             allow_nonfinite=allow_nonfinite, token=token, on_plan=on_plan, on_progress=on_progress)
    except BaseException as e:  # noqa: BLE001
        if progress is not None:
            progress.stop()
        _fail(e)
        return
    if progress is not None:
        progress.stop()
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    t = Table(title=f"expq convert -> {report.out}", show_header=False, title_justify="left")
    rows = [
        ("architecture", f"{report.architecture} ({report.layout} layout)"),
        ("MoE layers / dense", f"{len(report.moe_layers)} / {len(report.dense_layers)} of {report.layers}"),
        ("routed experts per layer", str(report.experts)),
        ("matrices quantized", f"{report.matrices_quantized} ({report.tensors_quantized} source tensors)"),
        ("tensors copied byte for byte", str(report.tensors_copied)),
        ("compute dtype", report.compute_dtype),
        ("size", f"{_human(report.bytes_in)} -> {_human(report.bytes_out)} "
                 f"({report.shards} shard{'s' if report.shards != 1 else ''})"),
        ("time", f"{report.seconds:.1f} s on {', '.join(report.devices)}"),
        ("zero rows (scale 0)", str(report.zero_rows)),
        ("rows with underflowed scale", str(report.underflow_rows)),
    ]
    if report.nonfinite_rows:
        rows.append(("non-finite rows (allowed)", str(report.nonfinite_rows)))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    for ex in report.underflow_examples[:5]:
        err.print(f"  underflow: {ex}", highlight=False)


@app.command()
def inspect(
    src: Annotated[str, typer.Argument(help="Source checkpoint: a local directory or a Hub repo id.")],
    revision: Annotated[Optional[str], typer.Option(help="Hub revision.")] = None,
    layout: Annotated[Optional[Path], typer.Option(help="Layout file (see configs/README.md).")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype (as for convert).")] = "auto",
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard.")] = "5GB",
    token: Annotated[Optional[str], typer.Option(help="Hub token.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor and what happens to it.")] = False,
) -> None:
    """Show what convert would do, without writing anything."""
    from .api import inspect as api_inspect

    try:
        plan = api_inspect(src, revision=revision, layout=layout, dtype=dtype, max_shard_size=max_shard_size,
                           token=token)
    except BaseException as e:  # noqa: BLE001
        _fail(e)
        return
    s = plan.summary()
    if tensors:
        s["tensors"] = [{"name": j.source.name, "file": j.source.file, "dtype": j.source.dtype,
                         "shape": list(j.source.shape), "action": j.kind,
                         "outputs": [o.name for o in j.outputs]} for j in plan.jobs]
    if as_json:
        print(json.dumps(s))
        return
    t = Table(title=f"expq inspect {s['source']}", show_header=False, title_justify="left")
    t.add_row("architecture", f"{s['architecture']} (model_type {s['model_type']})")
    t.add_row("layout", f"{s['layout']} ({s['layout_rule']}), detected by {s['detected_by']}")
    t.add_row("config keys", ", ".join(f"{k} <- {v}" for k, v in s["config_keys"].items()))
    t.add_row("layers", f"{s['num_layers']}: MoE {s['moe_layers']}, dense {s['dense_layers']}")
    if s["extra_expert_layers_copied"]:
        t.add_row("expert layers past num_layers (copied)", str(s["extra_expert_layers_copied"]))
    t.add_row("routed experts per layer", f"{s['routed_experts_per_layer']} (top_k {s['top_k']})")
    t.add_row("compute dtype", f"{s['compute_dtype']}: {s['compute_dtype_reason']}")
    t.add_row("to quantize", f"{s['matrices_quantized']} matrices from {s['source_tensors_quantized']} tensors "
                             f"({_human(s['bytes_quantized_in'])})")
    t.add_row("to copy", f"{s['source_tensors_copied']} tensors ({_human(s['bytes_copied'])}), "
                         f"{len(s['side_files'])} side files")
    n = s["output_shards"]
    t.add_row("size", f"{_human(s['bytes_in'])} -> {_human(s['bytes_out'])} in {n} shard{'s' if n != 1 else ''}")
    if s["skipped_files"]:
        t.add_row("not copied (other weight formats)", ", ".join(s["skipped_files"][:6]))
    out.print(t)
    if tensors:
        tt = Table("tensor", "dtype", "shape", "action")
        for row in s["tensors"]:
            tt.add_row(row["name"], row["dtype"], str(row["shape"]), row["action"])
        out.print(tt)


@app.command()
def verify(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    source: Annotated[Optional[str], typer.Option(help="Source checkpoint (directory or Hub repo id): adds the "
                                                       "bit-for-bit and byte-for-byte checks.")] = None,
    device: Annotated[str, typer.Option(help="Where the kernel check runs: auto, cpu, cuda, cuda:N.")] = "auto",
    tokens: Annotated[int, typer.Option(help="Random tokens per MoE layer for the kernel check.")] = 64,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision of --source.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Prove a converted checkpoint right: structure, bits against the source, and the int8 fused-MoE kernel.
    Exit 0 if every check passes, 1 if any fails, 2 on usage errors or unreadable input."""
    from .verifier import verify as api_verify

    try:
        report = api_verify(out_dir, source=source, device=device, tokens=tokens, revision=revision)
    except ExpqError as e:
        if not isinstance(e, UsageError):
            e.exit_code = 2  # unreadable input
        _fail(e)
        return
    except BaseException as e:  # noqa: BLE001
        _fail(e)
        return
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        from rich import box

        t = Table(title=f"expq verify {report.out}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1))
        for col in ("layer", "experts", "bits", "row err", "kernel", "worst tok", "vs src", "result"):
            t.add_column(col, no_wrap=True, min_width=len(col))
        fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
        for r in report.layers:
            bits = "-" if r.codes_differ is None else ("equal" if r.codes_differ == r.scales_differ == 0 else
                                                       f"{r.codes_differ}c/{r.scales_differ}s")
            t.add_row(str(r.layer), f"{r.experts_exercised}/{r.experts}", bits,
                      "-" if r.max_row_error_steps is None else f"{r.max_row_error_steps:.2f}",
                      fmt(r.kernel_rel_err), fmt(r.kernel_worst_token_err), fmt(r.source_rel_err),
                      "[green]pass[/]" if r.ok else "[red]FAIL[/]")
        out.print(t)
        c = Table("check", "result", "detail", title="checks", title_justify="left")
        for ch in report.checks:
            c.add_row(ch.name, "[green]pass[/]" if ch.ok else "[red]FAIL[/]", ch.detail)
        out.print(c)
        out.print(f"row err: worst |w - q*s| over rows, in steps s ({report.activation_dtype} allows "
                  f"{report.row_error_limit:.2f}: w/s is rounded to {report.activation_dtype} before round()); "
                  "kernel / worst tok: relative error against the fp32 reference (layer / worst token); "
                  "vs src: against the source experts", highlight=False)
        out.print(f"kernel: {report.backend} on {report.device}, {report.activation_dtype} activations, "
                  f"{report.tokens} tokens per layer; {report.seconds:.1f} s", highlight=False)
        for p in report.problems[:10]:
            err.print(f"  [red]problem:[/] {p}", highlight=False)
        out.print(("[bold green]" if report.ok else "[bold red]") + report.verdict + "[/]", highlight=False)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def run(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    prompt: Annotated[str, typer.Option(help="Prompt text (or space-separated token ids if the checkpoint has no "
                                             "tokenizer).")] = "Hello",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (greedy).")] = 20,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N (default: CUDA if available).")] = None,
) -> None:
    """Smoke-test a converted model: load it with int8 experts (expq.load_model) and generate greedily."""
    import torch

    from .runtime import experts_nbytes, load_model

    try:
        if max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if not prompt.strip():
            raise UsageError("--prompt is empty")
        if device is not None:
            from .pipeline import parse_devices

            parse_devices(device)  # a clear error for a device that is not there
        model = load_model(out_dir, device=device)
        tok = None
        if any((out_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json",
                                                  "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(out_dir)
        dev = next(model.parameters()).device
        vocab = model.get_input_embeddings().weight.shape[0]
        if tok is not None:
            ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
        else:
            try:
                ids = torch.tensor([[int(x) for x in prompt.replace(",", " ").split()]], device=dev)
            except ValueError:
                raise UsageError("this checkpoint has no tokenizer: give --prompt as token ids, e.g. '1 2 3'") \
                    from None
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise UsageError(f"token ids must lie in [0, {vocab})")
        if ids.shape[1] == 0:
            raise UsageError("the prompt encodes to no tokens")
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0)
    except BaseException as e:  # noqa: BLE001
        _fail(e)
        return
    new = gen[0, ids.shape[1]:].tolist()
    nb = experts_nbytes(model)
    err.print(f"{type(model).__name__}: routed experts int8 in memory ({_human(nb['experts'])}), "
              f"rest {_human(nb['other'])}, on {dev}", highlight=False)
    if tok is not None:
        out.print(prompt + tok.decode(new, skip_special_tokens=True), highlight=False)
        err.print(f"token ids: {new}", highlight=False)
    else:
        out.print(" ".join(str(t) for t in new), highlight=False)


@app.command()
def push(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="Converted checkpoint directory.")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo, namespace/name (created if needed).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created if missing).")] = None,
    create_pr: Annotated[bool, typer.Option("--create-pr", help="Open a pull request instead.")] = False,
    commit_message: Annotated[Optional[str], typer.Option(help="Commit message.")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or your login).",
                                                 show_default=False)] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Push without verifying first.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the files and the model card; no network.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON summary object.")] = False,
) -> None:
    """Publish a converted checkpoint to the Hub with a model card (verify first; resumable; checked after)."""
    from .hub import push as api_push
    from .hub import report_json

    try:
        res = api_push(out_dir, repo_id, private=private, revision=revision, create_pr=create_pr,
                       commit_message=commit_message, token=token, skip_verify=skip_verify, dry_run=dry_run)
    except BaseException as e:  # noqa: BLE001
        _fail(e)
        return
    if as_json:
        print(report_json(res))
        return
    if dry_run:
        t = Table("file", "size", title=f"expq push --dry-run: would upload to {repo_id}", title_justify="left")
        for f in res.files:
            t.add_row(f["path"], _human(f["size"]))
        out.print(t)
        out.print(f"{len(res.files)} files, {_human(res.bytes)}; verify: {res.verify_verdict or 'skipped'}",
                  highlight=False)
        sys.stdout.write("\n--- README.md (model card) ---\n\n" + res.card + "\n")
        return
    out.print(f"pushed {len(res.files)} files ({_human(res.bytes)}) to {repo_id}"
              f"{' (' + res.revision + ')' if res.revision else ''}; remote sizes and hashes match",
              highlight=False)
    for url in (res.pr_url, res.commit_url):
        if url:
            out.print(url, highlight=False)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        try:
            _fail(e)
        except typer.Exit as ex:
            sys.exit(ex.exit_code)


if __name__ == "__main__":
    main()

"""The model card of a converted checkpoint: the README.md ``push`` uploads and ``--to-hub`` publishes.

Everything it says comes from what ``convert`` recorded in ``expq.json`` and what the checkpoint holds
(``checkpoint.ConvertedCheckpoint``): the scheme, what was quantized and kept, how it was made, the verify results,
how each engine loads it (``engines.clients``). ``publishing_warnings`` says what it cannot say truly.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import ConvertedCheckpoint
from ..engines.clients import stock_transformers_misloads
from ..errors import UsageError, option
from ..layouts import shared_facts
from ..manifest import DECODED_OTHERS, MANIFEST, Manifest
from ..options import format_size
from ..version import __version__

TAGS = ["moe", "int8", "experts_int8", "expq"]  # plus the output format's name

INSTALL_ENV = "EXPQ_INSTALL"  # the card's install command, when push is not given one


@dataclass(frozen=True)
class Install:
    """The command a reader of the card runs to install expq (it is on no package index), and whether it is known
    to work (``why`` says how it was found, or why it is a placeholder)."""

    command: str
    runnable: bool
    why: str


def install_line(install: str | None = None) -> Install:
    """How the card tells its readers to install expq: ``install`` if given, else ``$EXPQ_INSTALL``, else a
    ``pip install "expq @ git+URL@COMMIT"`` line derived from how this expq was installed (pip's
    ``direct_url.json`` of a git or archive install; for a checkout, its git remote and a commit that remote holds),
    else a placeholder with this version's commit that a push warns about."""
    given = install or os.environ.get(INSTALL_ENV, "").strip()
    if given:
        return Install(given, True, "given" if install else f"from ${INSTALL_ENV}")
    url, commit = _installed_from()
    if url:
        return Install(f'pip install "expq @ {url}"', True, "from where this expq was installed")
    ref = commit[:12] if commit else f"v{__version__}"
    return Install(f'pip install "expq @ git+https://<the expq repository>@{ref}"', False,
                   "expq is on no package index, and this expq was installed from a directory without a public git "
                   f"remote holding its commit: pass the install command ({option('install', '...')} or "
                   f"${INSTALL_ENV})")


def _installed_from() -> tuple[str | None, str | None]:
    """(a pip requirement URL this expq can be installed from by anyone, or None; the git commit of this expq if
    known)."""
    from importlib import metadata

    info = next((json.loads(t) for d in metadata.distributions(name="expq")
                 if (t := d.read_text("direct_url.json"))), {})
    url = info.get("url", "")
    vcs = info.get("vcs_info") or {}
    if vcs.get("vcs") == "git" and vcs.get("commit_id") and not url.startswith("file:"):
        return f"git+{url}@{vcs['commit_id']}", vcs["commit_id"]
    if "archive_info" in info and url.startswith(("http://", "https://")):
        return url, None
    return _checkout_remote(Path(__file__).resolve().parents[2])


def _checkout_remote(root: Path) -> tuple[str | None, str | None]:
    """For a git checkout at ``root``: (``git+URL@COMMIT`` when a non-local remote holds HEAD, else None; HEAD)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    head = git("rev-parse", "HEAD")
    if not head:
        return None, None
    for remote in git("remote").split():
        url = git("remote", "get-url", remote)
        if url.startswith("git@") and ":" in url:  # scp-like syntax: pip wants ssh://
            url = "ssh://" + url.replace(":", "/", 1)
        if url.startswith(("https://", "http://", "ssh://")) and git("branch", "-r", "--contains", head,
                                                                     "--list", f"{remote}/*"):
            return f"git+{url}@{head}", head
    return None, head


@dataclass(frozen=True)
class Origin:
    """Where a converted checkpoint came from, as its card says: the base model's repo id (None when unknown), the
    source revision or commit, the licence (None when unknown)."""

    base_model: str | None
    revision: str | None
    license: str | None


def card_origin(m: Manifest, *, base_model: str | None = None, license: str | None = None) -> Origin:
    """The card's base model and licence: the ones given, else those ``expq.json`` recorded (the source's repo id;
    the source card's licence). The revision is the source commit (a Hub snapshot's, or the one a
    ``hf download --local-dir`` copy records) or the revision asked for."""
    return Origin(base_model or m.source.repo_id, m.source.commit or m.source.revision,
                  license or m.source_card.get("license"))


def model_card(out: str | Path, repo_id: str, verify_report=None, *, install: str | None = None,
               base_model: str | None = None, license: str | None = None) -> str:
    """The model card (README.md text) for a converted checkpoint, from what ``convert`` recorded in ``expq.json``.

    The YAML header (``huggingface_hub.ModelCardData``) carries ``base_model`` (the source repo, or ``base_model``;
    its revision is in the body), ``base_model_relation: quantized``, ``library_name`` (``transformers`` where stock
    transformers loads it right, else ``expq``), the tags, the licence (``license``, else the source card's) and the
    source card's other metadata. The body: the scheme in words, what was quantized and what was kept, how it was
    made, the verify results, how to serve it. ``install``: the command that installs expq for the card's readers
    (see ``install_line``).

    Raises:
        UsageError: OUT has no expq.json. SourceError: OUT is not a converted checkpoint, or its expq.json is not
            valid.
    """
    from huggingface_hub import ModelCard

    ck = ConvertedCheckpoint(out)
    m = ck.manifest
    if m is None:
        raise UsageError(f"no {MANIFEST} in OUT: not written by expq convert, so there is nothing true to say",
                         file=str(out))
    name = repo_id.split("/")[-1]
    how = install_line(install)
    origin = card_origin(m, base_model=base_model, license=license)
    lines = [f"# {name}", "", *_card_warning(ck), _card_intro(m, origin), "", *_card_scheme(ck, m), "",
             *_card_contents(ck, m), "",
             *_card_how_made(ck, m, name, how), "", *_card_verification(m, verify_report, origin), "",
             *_card_usage(ck, m, repo_id, how)]
    return str(ModelCard(f"---\n{_card_data(ck, m, origin).to_yaml()}\n---\n\n" + "\n".join(lines)))


def _card_data(ck: ConvertedCheckpoint, m: Manifest, origin: Origin):
    from huggingface_hub import ModelCardData

    carried = {k: v for k, v in m.source_card.items()
               if k not in ("base_model", "base_model_relation", "tags", "library_name", "model-index",
                            "quantized_by", "license")}
    tags = list(dict.fromkeys([*(m.source_card.get("tags") or []), *TAGS, ck.format.name]))
    data = ModelCardData(base_model=origin.base_model, library_name=library_name(ck), tags=tags,
                         license=origin.license, **carried)
    data.base_model_relation = "quantized"
    return data


def library_name(ck: ConvertedCheckpoint) -> str:
    """The card's ``library_name``: ``transformers`` where stock transformers loads the checkpoint with the right
    experts, else ``expq`` (stock transformers refuses experts-int8, and would run random experts for a family whose
    layout says ``[clients] transformers = false``)."""
    right = not ck.format.expq_loads and not stock_transformers_misloads(ck.format, ck.layout)
    return "transformers" if right else "expq"


def card_warnings(ck: ConvertedCheckpoint) -> list[str]:
    """What a reader of the card must not miss: stock transformers would load this checkpoint with randomly
    initialised experts (``engines.clients.stock_transformers_misloads``)."""
    return [w for w in (stock_transformers_misloads(ck.format, ck.layout),) if w]


def _card_warning(ck: ConvertedCheckpoint) -> list[str]:
    """The card's first lines: each warning as a quoted paragraph, naming the engines that do load it right."""
    loaders = [{"vLLM": "vLLM", "expq": "`expq.load_model`"}.get(c.engine, c.engine)
               for c in ck.format.clients(ck.layout, ck.experts.hidden_size) if c.loads]
    right = f" {' and '.join(loaders)} load{'s' if len(loaders) == 1 else ''} it right." if loaders else ""
    return [line for w in card_warnings(ck)
            for line in (f"> **Warning: do not load this checkpoint with stock transformers.** {w[0].upper() + w[1:]}."
                         + right, "")]


def _card_intro(m: Manifest, origin: Origin) -> str:
    src, dec = m.source, m.decoded
    decoded = "" if dec is None else (
        f" The source is published as {dec.source_format}; expq decoded it to {m.plan.compute_dtype} first, exactly "
        "as the vendor's own conversion does, so the result equals converting the unquantized release ("
        + ", ".join(f"{n} {how}" for how, n in dec.tensors_decoded.items()) + ").")
    return _card_intro_text(src, origin) + decoded


def _card_intro_text(src, origin: Origin) -> str:
    if origin.base_model:
        rev = f"revision `{origin.revision}`" if origin.revision else "a revision expq did not record"
        return (f"[{origin.base_model}](https://huggingface.co/{origin.base_model}) at {rev} "
                "with its **routed experts quantized to int8** exactly as vLLM's "
                "`experts_int8` method quantizes them at load time, so you download, store and load about half the "
                "expert bytes and skip the online step. Everything else is byte-for-byte the original.")
    return (f"`{src.name}` with its **routed experts quantized to int8** exactly as vLLM's `experts_int8` method "
            "quantizes them at load time. Everything else is byte-for-byte the original.")


def _card_scheme(ck: ConvertedCheckpoint, m: Manifest) -> list[str]:
    p = m.plan
    return ["## Quantization scheme", "",
            f"Per routed-expert weight matrix `w` [out, in], in the compute dtype `{p.compute_dtype}` "
            f"({p.compute_dtype_reason}): `scale = amax(|w|, dim=1) / 127` (one scale per output row), "
            "`q = clamp(round(w / scale), -127, 127)` with round-half-to-even: symmetric int8, per-channel, "
            "weight-only (activations stay 16-bit, W8A16). The codes and scales are bit-identical to vLLM's "
            f"`experts_int8` on CUDA. All-zero rows get scale 0 and codes 0. {ck.format.describe()}"]


def _card_contents(ck: ConvertedCheckpoint, m: Manifest) -> list[str]:
    p = m.plan
    return ["## What was quantized and what was kept", "", "| | |", "|---|---|",
            f"| architecture | `{p.architecture}` (`{p.model_type}`, {p.layout} layout) |",
            f"| routed experts | {len(p.moe_layers)} MoE layers x {p.routed_experts_per_layer} experts x 3 "
            f"projections (gate, up, down) = {p.matrices_quantized} matrices, int8 |",
            *_card_kept_rows(ck, m),
            f"| experts | {format_size(p.bytes_quantized_in)} -> {format_size(m.quantized_bytes_out)} |",
            f"| whole checkpoint | {format_size(p.bytes_in)} -> {format_size(p.bytes_out)} |",
            f"| zero rows / underflowed scales | {m.rows.zero} / {m.rows.underflow} |"]


def _card_kept_rows(ck: ConvertedCheckpoint, m: Manifest) -> list[str]:
    """The card's rows for the tensors not quantized: kept byte-identical, and, from a quantized source, those
    decoded to the compute dtype."""
    p = m.plan
    kinds = _kept_summary(ck, p.dense_layers, p.extra_expert_layers_copied)
    decoded = m.decoded.count(DECODED_OTHERS) if m.decoded is not None else 0
    if not decoded:
        return [f"| kept as they were (byte-identical) | {p.source_tensors_copied} tensors: {kinds} |"]
    return [f"| not quantized | {p.source_tensors_copied} tensors: {kinds} |",
            f"| of which kept as they were (byte-identical) | {p.source_tensors_copied - decoded} tensors |",
            f"| of which decoded from {m.decoded.source_format} to {p.compute_dtype} | {decoded} tensors |"]


def _card_how_made(ck: ConvertedCheckpoint, m: Manifest, name: str, how: Install) -> list[str]:
    command = m.command or "expq convert SRC OUT"
    if not m.source.repo_id:  # a local source: its folder name alone is not a path a reader has
        placeholder = shlex.quote(f"path/to/{m.source.name}")
        command = command.replace(f" {shlex.quote(m.source.name)} OUT", f" {placeholder} OUT", 1)
    if card_warnings(ck):  # the acknowledgement convert asks for before writing such a checkpoint
        command += " --allow-random-experts-in-transformers"
    return ["## How it was made", "", "```bash", how.command, command.replace(" OUT", " " + name, 1), "```", "",
            f"expq {m.expq_version}, output format {ck.format.name}" + (
                f" ({ck.format.quant_method} config version {ck.quantization_config['version']})."
                if "version" in ck.quantization_config else ".")]


def _card_verification(m: Manifest, report, origin: Origin) -> list[str]:
    lines = ["## Verification", ""]
    if report is None:
        source = shlex.join([origin.base_model, *(["--revision", origin.revision] if origin.revision else [])]) \
            if origin.base_model else shlex.quote(f"path/to/{m.source.name}")
        return lines + [f"Not verified at push time (`--skip-verify`). Run `expq verify . --source {source}` to "
                        "check it."]
    lines += [f"`expq verify` at push time: **{report.verdict}**", "", "| check | result |", "|---|---|"]
    lines += [f"| {c.name} | {'pass' if c.ok else 'FAIL'} |" for c in report.checks]
    errs = [r.kernel_rel_err for r in report.layers if r.kernel_rel_err is not None]
    if errs:
        lines += ["", f"Fused-MoE int8 kernel ({report.backend}, {report.activation_dtype}) against an fp32 "
                      f"reference, every expert exercised: worst layer relative error {max(errs):.2e}."]
    return lines


def _card_usage(ck: ConvertedCheckpoint, m: Manifest, repo_id: str, how: Install) -> list[str]:
    """Per engine, the command that loads this checkpoint, or why that engine cannot (``engines.clients``); first,
    how to install expq, which the commands that import it need."""
    lay = ck.layout
    lines = ["## How to use it", "", _card_format(ck), "",
             "expq is not on a package index; where a command below uses it, install it first:", "", "```bash",
             how.command, "```"]
    for c in ck.format.clients(lay, m.plan.hidden_size):
        lines += ["", f"### {c.engine}", ""]
        if c.loads:
            lines += [f"```{c.language}", c.for_model(repo_id, how.command), "```"] + (["", c.note] if c.note else [])
            lines += (["", "Per version and GPU:", ""] + [f"- {when}: `{cmd}`" for when, cmd in
                                                          c.variant_lines(repo_id)]) if c.variants else []
        else:
            lines.append((c.note if c.note[:1].isupper() or c.note.startswith("vLLM") else
                          c.note[0].upper() + c.note[1:]) + ".")
    return lines + [""]


def _card_format(ck: ConvertedCheckpoint) -> str:
    """The format, and why, in terms of this checkpoint (not of the output another format would have been)."""
    fmt, lay = ck.format, ck.layout
    line = f"Format: **{fmt.name}**"
    if fmt.name != lay.default_format:
        return line + "."
    if fmt.expq_loads and not lay.stock_transformers:
        return line + (" (this family's default: stock transformers cannot map per-expert quantized tensors onto "
                       "this family's stacked experts, so from a checkpoint it reads it would run randomly "
                       "initialised experts; it refuses this one with an error, and transformers after `import expq` "
                       "and expq.load_model load it).")
    return line + (f" ({lay.format_reason})." if lay.format_reason else ".")


def _kept_summary(ck: ConvertedCheckpoint, dense: list, extra: list) -> str:
    """What the copied tensors are, by kind (``configs/_shared.toml``'s kept_kinds), with counts, from the tensor
    names actually in OUT."""
    kinds = shared_facts().kept_kinds
    counts: dict[str, int] = {}
    for name in ck.tensors:
        if ck.format.classify(name) is not None:
            continue
        label = next((k.label for k in kinds if any(c in name for c in k.contains)), "other")
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{lab} ({n})" for lab, n in counts.items()]
    if dense:
        parts.append(f"dense layers {dense}")
    if extra:
        parts.append(f"expert layers past the decoder, e.g. MTP {extra}")
    return ", ".join(parts)


def publishing_warnings(m: Manifest, install: str | None, base_model: str | None, license: str | None) -> list[str]:
    """What the card cannot say truly: where to install expq from, which model it quantizes, its licence."""
    out = []
    how = install_line(install)
    if not how.runnable:
        out.append(f"the card's install line is a placeholder ({how.command}): {how.why}")
    origin = card_origin(m, base_model=base_model, license=license)
    src = m.source
    if origin.base_model is None:
        copy = (f", a `hf download --local-dir` copy of commit {src.commit} (which does not record the repo id)"
                if src.commit else "")
        out.append(f"the card has no base_model: the source was the local directory {src.name}{copy}; pass "
                   f"{option('base_model', 'ORG/NAME')}")
    elif src.repo_id and origin.base_model != src.repo_id:
        out.append(f"the card's base_model is {origin.base_model}, but expq.json records the source {src.repo_id}")
    if origin.license is None:
        out.append(f"the card has no licence (the source card has none): pass {option('license', 'ID')}, a Hub "
                   "licence id such as apache-2.0")
    return out

"""``push``: publish a converted checkpoint to the Hugging Face Hub with a model card that tells the truth.

Built on ``huggingface_hub`` alone: ``create_repo(exist_ok=True)``, the library's resumable upload (``upload_folder``
on huggingface_hub >= 2, which splits large folders into several commits and resumes when re-run; ``upload_large_folder``
on 1.x), then a check that the remote files have the local sizes and hashes. The token comes from ``token=``,
``HF_TOKEN`` or the huggingface_hub login, and is never printed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__
from .checkpoint import ConvertedCheckpoint
from .errors import ExpqError, UsageError
from .writer import MANIFEST, STAGING

TAGS = ["moe", "int8", "experts_int8", "compressed-tensors", "expq"]
# Never uploaded: caches, staging and temporary files, VCS folders.
IGNORE = [f"{STAGING}/*", f"{STAGING}/**", ".cache/*", ".cache/**", ".git/*", ".git/**", "**/.DS_Store",
          "*.tmp", "*.partial", "*.lock", "__pycache__/*"]
class PushError(ExpqError):
    """A push failed: no token, no permission, a repo of another type, a network failure, a mismatch after upload."""


@dataclass
class PushReport:
    """What ``push`` did (or, with ``dry_run``, would do). Sizes in bytes."""

    repo_id: str
    revision: str | None
    dry_run: bool
    files: list[dict]
    bytes: int
    verified: bool | None
    verify_verdict: str | None
    commit_url: str | None = None
    pr_url: str | None = None
    card: str = ""
    checked_remote: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def local_files(out: Path) -> list[dict]:
    """Files a push uploads (relative path, size, sha256), caches / staging / temp files excluded."""
    import fnmatch

    files = []
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(out).as_posix()
        if any(fnmatch.fnmatch(rel, pat) for pat in IGNORE) or rel.startswith(".") or "/." in rel:
            continue
        files.append({"path": rel, "size": p.stat().st_size, "sha256": _sha256(p)})
    return files


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(p: Path) -> str:
    h = hashlib.sha1()
    h.update(f"blob {p.stat().st_size}\0".encode())
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def model_card(out: str | Path, repo_id: str, verify_report=None) -> str:
    """The model card (README.md text) for a converted checkpoint, from what ``convert`` recorded in ``expq.json``.

    The YAML header (``huggingface_hub.ModelCardData``) carries ``base_model`` (the source repo; its revision is in
    the body), ``base_model_relation: quantized``, ``library_name``, the tags, and the source card's licence and other
    metadata. The body gives the scheme in words, what was quantized and what was kept, sizes, the exact expq command
    and version, the verify results and how to serve it.
    """
    from huggingface_hub import ModelCard, ModelCardData

    ck = ConvertedCheckpoint(out)
    m = ck.manifest
    if not m:
        raise UsageError(f"no {MANIFEST} in OUT: not written by expq convert, so there is nothing true to say",
                         file=str(out))
    plan = m.get("plan", {})
    src = m.get("source", {})
    carried = {k: v for k, v in (m.get("source_card") or {}).items()
               if k not in ("base_model", "base_model_relation", "tags", "library_name", "model-index",
                            "quantized_by")}
    src_tags = (m.get("source_card") or {}).get("tags") or []
    tags = list(dict.fromkeys([*src_tags, *TAGS]))
    data = ModelCardData(base_model=src.get("repo_id") or None, library_name="transformers", tags=tags, **carried)
    data.base_model_relation = "quantized"
    name = repo_id.split("/")[-1]
    fam = plan.get("layout", "?")
    E = plan.get("routed_experts_per_layer")
    moe = plan.get("moe_layers", [])
    dense = plan.get("dense_layers", [])
    extra = plan.get("extra_expert_layers_copied", [])
    rows = m.get("rows", {})
    bytes_in, bytes_out = plan.get("bytes_in", 0), plan.get("bytes_out", 0)
    q_in, q_out = plan.get("bytes_quantized_in", 0), m.get("quantized_bytes_out", 0)
    base = src.get("repo_id") or src.get("name")
    rev = f" at revision `{src.get('commit') or src.get('revision')}`" if src.get("repo_id") else ""
    lines = [
        f"# {name}",
        "",
        f"[{base}](https://huggingface.co/{base}){rev} with its **routed experts quantized to int8** exactly as "
        "vLLM's `experts_int8` method quantizes them at load time, so you download, store and load about half the "
        "expert bytes and skip the online step. Everything else is byte-for-byte the original." if src.get("repo_id")
        else f"`{base}` with its **routed experts quantized to int8** exactly as vLLM's `experts_int8` method "
             "quantizes them at load time. Everything else is byte-for-byte the original.",
        "",
        "## Quantization scheme",
        "",
        f"Per routed-expert weight matrix `w` [out, in], in the compute dtype `{plan.get('compute_dtype')}` "
        f"({plan.get('compute_dtype_reason')}): `scale = amax(|w|, dim=1) / 127` (one scale per output row), "
        "`q = clamp(round(w / scale), -127, 127)` with round-half-to-even: symmetric int8, per-channel, weight-only "
        "(activations stay 16-bit, W8A16). The codes and scales are bit-identical to vLLM's `experts_int8` on CUDA. "
        "All-zero rows get scale 0 and codes 0. Stored as compressed-tensors `pack-quantized` (8-bit int, "
        "`strategy: channel`, `group_size: -1`): per expert projection `weight_packed` int32, `weight_scale` "
        f"[out, 1] in {plan.get('compute_dtype')}, `weight_shape`.",
        "",
        "## What was quantized and what was kept",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | `{plan.get('architecture')}` (`{plan.get('model_type')}`, {fam} layout) |",
        f"| routed experts | {len(moe)} MoE layers x {E} experts x 3 projections (gate, up, down) = "
        f"{plan.get('matrices_quantized')} matrices, int8 |",
        f"| kept as they were (byte-identical) | {plan.get('source_tensors_copied')} tensors: "
        f"{_kept_summary(ck, dense, extra)} |",
        f"| experts | {_human(q_in)} -> {_human(q_out)} |",
        f"| whole checkpoint | {_human(bytes_in)} -> {_human(bytes_out)} |",
        f"| zero rows / underflowed scales | {rows.get('zero', 0)} / {rows.get('underflow', 0)} |",
        "",
        "## How it was made",
        "",
        "```bash",
        f"pip install expq=={m.get('expq_version', __version__)}",
        (m.get("command") or "expq convert SRC OUT").replace(" OUT", " " + name, 1),
        "```",
        "",
        f"expq {m.get('expq_version')}, compressed-tensors config version "
        f"{ck.quantization_config.get('version', '?')}.",
        "",
        "## Verification",
        "",
    ]
    if verify_report is None:
        lines.append("Not verified at push time (`--skip-verify`). Run `expq verify . --source "
                     f"{base}` to check it.")
    else:
        lines.append(f"`expq verify` at push time: **{verify_report.verdict}**")
        lines.append("")
        lines.append("| check | result |")
        lines.append("|---|---|")
        for c in verify_report.checks:
            lines.append(f"| {c.name} | {'pass' if c.ok else 'FAIL'} |")
        errs = [r.kernel_rel_err for r in verify_report.layers if r.kernel_rel_err is not None]
        if errs:
            lines.append("")
            lines.append(f"Fused-MoE int8 kernel ({verify_report.backend}, {verify_report.activation_dtype}) against "
                         f"an fp32 reference, every expert exercised: worst layer relative error {max(errs):.2e}.")
    lines += ["", "## How to use it", "", "### vLLM", ""]
    hidden = plan.get("hidden_size")
    if ck.layout.stock_vllm:
        lines.append(f"Stock vLLM cannot serve this family in this format: {ck.layout.stock_vllm}. Use "
                     "`expq.load_model` below, or vLLM's online `--quantization experts_int8` on the base model.")
    elif hidden and hidden % 128:
        lines.append(f"vLLM runs this format's int8 experts through Marlin, which needs the hidden size to be a "
                     f"multiple of 128; this model's is {hidden}, so stock vLLM cannot serve it. Use "
                     "`expq.load_model` below, or vLLM's online `--quantization experts_int8` on the base model.")
    else:
        lines += ["```bash", f"vllm serve {repo_id}", "```", "",
                  "vLLM reads the `quantization_config` and runs the experts through its W8A16 MoE path (Marlin, "
                  "which needs the hidden size to be a multiple of 128). On H100/H200 with vLLM 0.32-0.33 add "
                  "`--moe-backend marlin` (the default backend choice rejects channel-wise int8 there). The scales "
                  "are full-row, which matches vLLM's own experts_int8 at any tensor-parallel size from vLLM 0.28 "
                  "on. ROCm has no Marlin and no channel-wise int8 MoE path."]
        if ck.layout.vllm_note:
            lines += ["", f"Note: {ck.layout.vllm_note}."]
    lines += ["", "### transformers", ""]
    if not ck.layout.stock_transformers:
        lines.append("Stock transformers cannot map per-expert compressed tensors onto this family's stacked "
                     "experts (it would leave them randomly initialised): use `expq.load_model`.")
    else:
        lines += ["```python", "from transformers import AutoModelForCausalLM",
                  f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")  # experts dequantized to 16-bit at load',
                  "```"]
    lines += ["", "### expq (experts kept int8 in memory)", "", "```python", "import expq",
              "from huggingface_hub import snapshot_download",
              f'model = expq.load_model(snapshot_download("{repo_id}"))  # int8 experts, fused-MoE kernel',
              "```", ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    return str(card)


KEPT_KINDS = (  # (label, substrings of a tensor name), first match wins
    ("routers / gates", (".gate.", ".router.", "router.", "shared_expert_gate", "e_score_correction_bias")),
    ("shared experts", ("shared_expert", "shared_mlp")),
    ("expert biases", ("_bias",)),
    ("attention", ("attn", "attention", "Wqkv")),
    ("embeddings", ("embed", "wte")),
    ("lm_head", ("lm_head",)),
    ("norms", ("norm", "ln_")),
    ("dense MLP", ("mlp.", "feed_forward.", "ffn.")),
)


def _kept_summary(ck: ConvertedCheckpoint, dense: list, extra: list) -> str:
    """What the copied tensors are, by kind, with counts (from the tensor names actually in OUT)."""
    counts: dict[str, int] = {}
    for name in ck.tensors:
        if name.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale", "weight_shape"):
            continue
        label = next((lab for lab, keys in KEPT_KINDS if any(k in name for k in keys)), "other")
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{lab} ({n})" for lab, n in counts.items()]
    if dense:
        parts.append(f"dense layers {dense}")
    if extra:
        parts.append(f"expert layers past the decoder, e.g. MTP {extra}")
    return ", ".join(parts)


def _token(token: str | None) -> str:
    from huggingface_hub import get_token

    tok = token or get_token()
    if not tok:
        raise PushError("no Hugging Face token: pass --token, set HF_TOKEN or run `hf auth login`")
    return tok


def _scrub(msg: str, token: str | None) -> str:
    return msg.replace(token, "***") if token else msg


def push(out: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         create_pr: bool = False, commit_message: str | None = None, token: str | None = None,
         skip_verify: bool = False, dry_run: bool = False, device: str = "auto") -> PushReport:
    """Publish a converted checkpoint to the Hub.

    Args:
        out: a directory written by ``expq convert``.
        repo_id: ``namespace/name`` of a model repo (created if needed).
        private: create the repo private. revision: the branch to push to (created from main if missing).
        create_pr: open a pull request instead of committing to the branch. commit_message: defaults to one naming
            expq and the source.
        token: Hub token (default: ``HF_TOKEN`` or the huggingface_hub login).
        skip_verify: push even if ``verify`` fails (or without running it).
        dry_run: print what would be uploaded and the card; no network, nothing written.
        device: where the verification's kernel check runs (``auto``, ``cpu``, ``cuda``...).

    Returns:
        PushReport.

    Raises:
        PushError: verification failed, no token, no permission, the id names a repo of another type, a network
            failure (re-run to resume: finished files are not uploaded again), or the remote files differ after upload.
        UsageError: a bad repo id, or OUT has no expq.json. SourceError: OUT is not a converted checkpoint.
    """
    out = Path(out)
    if repo_id.startswith(("datasets/", "spaces/")) or repo_id.count("/") != 1:
        raise UsageError(f"{repo_id!r} is not a model repo id (namespace/name)")
    ck = ConvertedCheckpoint(out)  # raises if OUT is not a converted checkpoint
    del ck
    report = None
    notes = []
    if not skip_verify:
        from .verifier import verify

        report = verify(out, device=device, tokens=16)
        if not report.ok:
            raise PushError(f"verify failed, refusing to push: {report.verdict.removeprefix('FAIL: ')}",
                            hint="fix the checkpoint, or pass --skip-verify")
    card = model_card(out, repo_id, report)
    files = local_files(out)
    if not any(f["path"] == "README.md" for f in files):
        files.append({"path": "README.md", "size": len(card.encode()), "sha256": ""})
    total = sum(f["size"] for f in files)
    res = PushReport(repo_id=repo_id, revision=revision, dry_run=dry_run, files=files, bytes=total,
                     verified=None if report is None else report.ok,
                     verify_verdict=None if report is None else report.verdict, card=card, notes=notes)
    if dry_run:
        return res
    tok = _token(token)  # before anything is written
    (out / "README.md").write_text(card)
    files = local_files(out)
    res.files, res.bytes = files, sum(f["size"] for f in files)
    try:
        _upload(out, repo_id, res, private=private, revision=revision, create_pr=create_pr,
                commit_message=commit_message or f"Upload experts-int8 checkpoint made with expq {__version__}",
                token=tok)
    except ExpqError as e:
        e.message = _scrub(e.message, tok)
        raise
    except Exception as e:  # noqa: BLE001
        raise _translate(e, repo_id, tok) from None
    return res


def _translate(e: Exception, repo_id: str, token: str) -> PushError:
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    status = getattr(getattr(e, "response", None), "status_code", None)
    text = _scrub(str(e).splitlines()[0] if str(e) else type(e).__name__, token)
    if isinstance(e, RepositoryNotFoundError) or status == 404:
        return PushError(f"repo {repo_id} not found or not accessible with this token: {text}")
    if status == 401:
        return PushError(f"the Hub rejected the token (401): {text}", hint="check --token / HF_TOKEN")
    if status == 403:
        return PushError(f"no write permission to {repo_id} with this token (403)",
                         hint="use a token with write access to this namespace")
    if isinstance(e, HfHubHTTPError) and status is not None:
        return PushError(f"the Hub answered {status}: {text}",
                         hint="re-run the same command to resume; finished files are not uploaded again")
    return PushError(f"network failure talking to the Hub ({type(e).__name__}: {text})",
                     hint="re-run the same command to resume; finished files are not uploaded again")


def _upload(out: Path, repo_id: str, res: PushReport, *, private: bool, revision: str | None, create_pr: bool,
            commit_message: str, token: str) -> None:
    import huggingface_hub
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    if not api.repo_exists(repo_id, repo_type="model"):
        for other in ("dataset", "space"):
            if api.repo_exists(repo_id, repo_type=other):
                raise PushError(f"{repo_id} exists as a {other} repo, not a model repo; expq pushes models",
                                hint="pick another name")
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision and revision != "main" and not create_pr:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    major = int(huggingface_hub.__version__.split(".")[0])
    if major >= 2 or create_pr or not hasattr(api, "upload_large_folder"):
        info = api.upload_folder(repo_id=repo_id, folder_path=out, repo_type="model", revision=revision,
                                 create_pr=create_pr or None, commit_message=commit_message,
                                 ignore_patterns=IGNORE)
        res.commit_url = getattr(info, "commit_url", None)
        res.pr_url = getattr(info, "pr_url", None)
        remote_rev = getattr(info, "pr_revision", None) or revision
    else:  # huggingface_hub 1.x: the resumable multi-commit uploader
        api.upload_large_folder(repo_id=repo_id, folder_path=out, repo_type="model", revision=revision,
                                private=private, ignore_patterns=IGNORE)
        remote_rev = revision
    res.revision = remote_rev
    _compare_remote(api, out, repo_id, remote_rev, res)


def _compare_remote(api, out: Path, repo_id: str, revision: str | None, res: PushReport) -> None:
    """The remote files must have the local sizes and hashes (LFS sha256, or the git blob id for small files)."""
    paths = [f["path"] for f in res.files]
    remote = {}
    for i in range(0, len(paths), 50):
        for item in api.get_paths_info(repo_id, paths[i:i + 50], expand=False, revision=revision):
            remote[item.path] = item
    bad = []
    for f in res.files:
        r = remote.get(f["path"])
        if r is None:
            bad.append(f"{f['path']}: missing on the Hub")
            continue
        if r.size != f["size"]:
            bad.append(f"{f['path']}: {r.size} bytes on the Hub, {f['size']} here")
            continue
        lfs = getattr(r, "lfs", None)
        if lfs is not None:
            sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            if sha != f["sha256"]:
                bad.append(f"{f['path']}: sha256 on the Hub differs")
        elif getattr(r, "blob_id", None) and r.blob_id != _git_blob_sha1(out / f["path"]):
            bad.append(f"{f['path']}: content on the Hub differs")
    res.checked_remote = len(res.files) - len(bad)
    if bad:
        raise PushError(f"after upload, {len(bad)} files differ on the Hub: {bad[0]}",
                        hint="re-run the push; if it persists, check the repo")


def report_json(res: PushReport) -> str:
    d = res.to_dict()
    d.pop("card")
    return json.dumps(d)



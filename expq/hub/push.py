"""``push``: publish a converted checkpoint to the Hugging Face Hub with a model card that tells the truth.

Steps: list OUT's files (refusing links), verify, make the card (``hub.card``), put it in place, create the repo,
upload, compare. Built on ``huggingface_hub`` alone: ``create_repo(exist_ok=True)``, the library's resumable upload
(``upload_folder`` on huggingface_hub >= 2, which splits large folders into several commits and resumes when re-run;
``upload_large_folder`` on 1.x), then a check that the remote files have the local sizes and hashes. The token comes
from ``token=``, ``HF_TOKEN`` or the huggingface_hub login, and is never printed. A failure of the Hub is named by
``hub.errors.translate``, as on a download (the same exit status for the same answer).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint import open_checkpoint
from ..errors import ExpqError, option, scrub_tokens
from ..io import files
from ..io.hashing import git_blob_id, sha256_file
from ..options import check_repo_id
from ..version import __version__
from ..output.outdir import reading
from .card import card_warnings, model_card, publishing_warnings
from .errors import translated

# Never uploaded: caches, staging and temporary files, VCS folders.
IGNORE = [".cache/*", ".cache/**", ".git/*", ".git/**", "**/.DS_Store",
          "*.tmp", "*.partial", "*.lock", "__pycache__/*"]


class PushError(ExpqError):
    """A push failed on expq's side (exit status 1): verify failed, no token, the name is a dataset or Space repo,
    or the remote files differ after upload. What the Hub answers is a ``HubError`` (``hub.errors.translate``:
    3 not found, 4 no write access, 5 the token rejected, 6 the Hub cannot be used, 1 another answer)."""


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
    warnings: list[str] = field(default_factory=list)  # said loudly by the CLI; also at the top of the card

    def to_dict(self) -> dict:
        return asdict(self)


def local_files(out: Path) -> list[dict]:
    """Files a push uploads (relative path, size, sha256): the regular files of OUT, hidden ones (a name starting
    with ``.``, or inside such a folder) and caches / staging / temp files excluded. Exactly these are uploaded.

    Raises:
        LinkRefused: OUT holds a symbolic link or a special file where it would be uploaded (named): push reads
            and writes nothing through a link.
    """
    import fnmatch

    found = []
    for rel, st in files.walk(out):
        if rel.startswith(".") or "/." in rel or any(fnmatch.fnmatch(rel, pat) for pat in IGNORE):
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            what = f"a symbolic link (to {os.readlink(out / rel)})" if stat.S_ISLNK(st.st_mode) else "a special file"
            raise files.LinkRefused(f"{what} in OUT; push uploads only regular files and reads or writes nothing "
                                    "through a link", file=str(out / rel), hint="replace it with the file itself")
        found.append({"path": rel, "size": st.st_size, "sha256": sha256_file(out / rel, follow_links=False)})
    return sorted(found, key=lambda f: f["path"].split("/"))


def hub_token(token: str | None) -> str:
    """The token a push (or ``--to-hub``) writes with: ``token``, else ``HF_TOKEN`` or the huggingface_hub login.

    Raises:
        PushError: there is none.
    """
    from huggingface_hub import get_token

    tok = token or get_token()
    if not tok:
        raise PushError(f"no Hugging Face token: pass {option('token', 'TOKEN')}, set HF_TOKEN or run `hf auth login`")
    return tok


def push(out: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         create_pr: bool = False, commit_message: str | None = None, token: str | None = None,
         skip_verify: bool = False, dry_run: bool = False, device: str = "auto",
         install: str | None = None, base_model: str | None = None, license: str | None = None) -> PushReport:
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
        install: the command the card gives its readers to install expq (default ``$EXPQ_INSTALL``, else derived
            from how this expq was installed; see ``install_line``). When none is known to work, the card holds a
            placeholder and the report's ``warnings`` say so.
        base_model: the card's ``base_model`` (the source's Hub repo id), for a checkpoint converted from a local
            directory (default: the repo id ``expq.json`` records; a warning when there is none).
        license: the card's licence (a Hub licence id such as ``apache-2.0``; default: the source card's; a warning
            when there is none).

    Returns:
        PushReport.

    Raises:
        PushError: verification failed, no token, the id names a repo of another type, or the remote files differ
            after upload.
        HubError: the Hub refused or failed (``hub.errors.translate``: HubNotFoundError 3, HubAccessError 4 (no
            write access), HubAuthError 5 (the token rejected), HubOfflineError 6 (offline, no network, an outage),
            HubError 1 (another answer)); re-run to resume: finished files are not uploaded again.
        UsageError: a bad repo id, or OUT has no expq.json. SourceError: OUT is not a converted checkpoint.
    """
    out = Path(out)
    check_repo_id(repo_id)
    with reading(out):  # a conversion into OUT does not swap it during the push
        return _push(out, repo_id, private=private, revision=revision, create_pr=create_pr,
                     commit_message=commit_message, token=token, skip_verify=skip_verify, dry_run=dry_run,
                     device=device, install=install, base_model=base_model, license=license)


def _push(out: Path, repo_id: str, *, private: bool, revision: str | None, create_pr: bool,
          commit_message: str | None, token: str | None, skip_verify: bool, dry_run: bool, device: str,
          install: str | None, base_model: str | None, license: str | None) -> PushReport:
    """``push``'s steps: list OUT's files (refusing links), open and verify the checkpoint, make the card; then
    put the card in place and upload exactly the listed files."""
    listed = local_files(out)
    ck = open_checkpoint(out)  # raises if OUT is not a converted checkpoint
    report = None if skip_verify else _verify_before_push(out, device)
    card = model_card(out, repo_id, report, install=install, base_model=base_model, license=license)
    uploads = with_card(listed, card)
    res = PushReport(repo_id=repo_id, revision=revision, dry_run=dry_run, files=uploads,
                     bytes=sum(f["size"] for f in uploads), verified=None if report is None else report.ok,
                     verify_verdict=None if report is None else report.verdict, card=card,
                     warnings=card_warnings(ck) + publishing_warnings(ck.manifest, install, base_model, license))
    if dry_run:
        return res
    tok = hub_token(token)  # before anything is written
    with card_in_place(out / "README.md", card):  # the previous README.md comes back if the push fails
        try:
            with translated(repo=repo_id, revision=revision, token=tok, action="write"):
                _upload(out, repo_id, res, private=private, revision=revision, create_pr=create_pr,
                        commit_message=commit_message or f"Upload {ck.format.name} checkpoint made with expq "
                                                         f"{__version__}", token=tok)
        except ExpqError as e:
            e.message = scrub_tokens(e.message, tok)
            Exception.__init__(e, e._line())  # the line printed is the scrubbed one
            raise
    return res


def _verify_before_push(out: Path, device: str):
    from ..verifier import verify

    report = verify(out, device=device, tokens=16)
    if not report.ok:
        raise PushError(f"verify failed, refusing to push: {report.verdict.removeprefix('FAIL: ')}",
                        hint=f"fix the checkpoint, or pass {option('skip_verify')}")
    return report


def with_card(files: list[dict], card: str) -> list[dict]:
    """The files a push uploads: OUT's, with README.md being the card (its size and sha256), not what OUT holds
    under that name now (the source's card, or an earlier one)."""
    import hashlib

    data = card.encode()
    entry = {"path": "README.md", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return [entry if f["path"] == "README.md" else f for f in files] + \
        ([] if any(f["path"] == "README.md" for f in files) else [entry])


@contextlib.contextmanager
def card_in_place(path: Path, card: str):
    """Put the card at ``path`` (OUT/README.md) for the upload, each change a single rename of a file made here
    (never written through a link: a link at ``path`` is refused); if the block raises (or is interrupted), put
    back the bytes that were there before, or nothing.

    Raises:
        LinkRefused: ``path``, or the temporary ``.README.md.expq-card`` beside it, is a link or a special file.
    """
    tmp = path.with_name(f".{path.name}.expq-card")
    old = files.read_bytes(path) if files.lstat(path) is not None else None
    _put(tmp, path, card.encode())
    try:
        yield
    except BaseException:
        if old is not None:
            _put(tmp, path, old)
        else:
            files.remove_file(path)
        raise


def _put(tmp: Path, path: Path, data: bytes) -> None:
    """``data`` into a new file ``tmp``, flushed, renamed over ``path`` (the name itself, never a link's target)."""
    fd = files.create_replacing_stale(tmp, "remove it: push makes it itself")
    try:
        files.write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_model_repo(api, repo_id: str, *, private: bool) -> None:
    """Create model repo ``repo_id`` if it does not exist (``private``), after checking the name is not a dataset
    or Space.

    Raises:
        PushError: the name is taken by a dataset or Space repo (huggingface_hub errors pass through).
    """
    if not api.repo_exists(repo_id, repo_type="model"):
        for other in ("dataset", "space"):
            if api.repo_exists(repo_id, repo_type=other):
                raise PushError(f"{repo_id} exists as a {other} repo, not a model repo; expq pushes models",
                                hint="pick another name")
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)


def _upload(out: Path, repo_id: str, res: PushReport, *, private: bool, revision: str | None, create_pr: bool,
            commit_message: str, token: str) -> None:
    import huggingface_hub
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    ensure_model_repo(api, repo_id, private=private)
    if revision and revision != "main" and not create_pr:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    major = int(huggingface_hub.__version__.split(".")[0])
    exactly = [glob.escape(f["path"]) for f in res.files]  # the listing, and nothing else (no dotfiles, no links)
    if major >= 2 or create_pr or not hasattr(api, "upload_large_folder"):
        info = api.upload_folder(repo_id=repo_id, folder_path=out, repo_type="model", revision=revision,
                                 create_pr=create_pr or None, commit_message=commit_message,
                                 allow_patterns=exactly)
        res.commit_url = getattr(info, "commit_url", None)
        res.pr_url = getattr(info, "pr_url", None)
        remote_rev = getattr(info, "pr_revision", None) or revision
    else:  # huggingface_hub 1.x: the resumable multi-commit uploader
        api.upload_large_folder(repo_id=repo_id, folder_path=out, repo_type="model", revision=revision,
                                private=private, allow_patterns=exactly)
        remote_rev = revision
    res.revision = remote_rev
    compare_remote(api, out, repo_id, remote_rev, res)


def compare_remote(api, out: Path, repo_id: str, revision: str | None, res: PushReport) -> None:
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
        elif getattr(r, "blob_id", None) and r.blob_id != git_blob_id(out / f["path"], follow_links=False):
            bad.append(f"{f['path']}: content on the Hub differs")
    res.checked_remote = len(res.files) - len(bad)
    if bad:
        raise PushError(f"after upload, {len(bad)} files differ on the Hub: {bad[0]}",
                        hint="re-run the push; if it persists, check the repo")


def report_json(res: PushReport) -> str:
    """``push --json``: the report as one JSON object, the card included."""
    return json.dumps(res.to_dict())



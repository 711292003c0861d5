"""``convert --ray --to-hub``: the Hub side of a conversion whose tasks upload their own shards.

Steps: ``prepare_repo`` (the driver creates the model repo, as ``push`` does) → ``upload_shards`` (each task puts
its shards into the repo's LFS storage with ``preupload_lfs_files``: no commit yet; ``upload_settings`` is what it
needs to do so as the driver would) → ``publish`` (the driver commits the shards and the small files, the model card
among them, and checks every remote file's size and hash, as ``push`` does). A failure of the Hub is named by
``hub.errors.translate``, as for ``push`` and for a download.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HubError
from ..io.hashing import sha256_file
from .errors import translated
from .push import PushReport, compare_remote, ensure_model_repo

if TYPE_CHECKING:
    from ..cluster import ShardResult
    from ..plan import Plan

MAX_FILES_PER_COMMIT = 100  # more files than this are committed in several commits, the small files last


def prepare_repo(repo_id: str, token: str, *, private: bool) -> None:
    """Create the target model repo if needed (before the tasks upload into it), as ``expq push`` does.

    Raises:
        PushError: the name is taken by a dataset or Space repo. HubError: the Hub refused or failed
            (``hub.errors.translate``).
    """
    from huggingface_hub import HfApi

    with translated(repo=repo_id, token=token, action="write"):
        ensure_model_repo(HfApi(token=token), repo_id, private=private)


def upload_settings(repo_id: str, token: str) -> dict:
    """What a task needs to upload into ``repo_id`` as this process would (``upload_shards``' keywords): the
    token, this process's Hub (``HF_ENDPOINT``) and whether it uses Xet (``HF_HUB_DISABLE_XET``)."""
    from huggingface_hub import constants

    return {"repo_id": repo_id, "token": token, "revision": None, "endpoint": constants.ENDPOINT,
            "disable_xet": bool(constants.HF_HUB_DISABLE_XET)}


def upload_shards(folder: Path, names: list[str], *, repo_id: str, token: str, revision: str | None,
                  endpoint: str | None, disable_xet: bool) -> list:
    """Upload shard files ``folder/name`` to the repo's LFS storage (``preupload_lfs_files``: no commit yet).

    Returns:
        their ``CommitOperationAdd``, content dropped (only path, size and sha256 travel back; the driver commits).

    Raises:
        HubError: the Hub refused or failed (``hub.errors.translate``), or wants a shard as a regular (non-LFS) file.
    """
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in names]
    xet_before = constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_DISABLE_XET = disable_xet  # the driver's choice, for this task (a worker runs one at a time)
    try:
        with translated(repo=repo_id, revision=revision, token=token, action="write"):
            HfApi(endpoint=endpoint, token=token).preupload_lfs_files(repo_id, additions=ops, revision=revision,
                                                                      free_memory=True)
    finally:
        constants.HF_HUB_DISABLE_XET = xet_before
    for op in ops:
        if op._upload_mode != "lfs":
            raise HubError("the Hub wants this shard as a regular (non-LFS) file; expq uploads shards through LFS "
                           "only", repo=repo_id, file=op.path_in_repo)
        op.path_or_fileobj = b""
    return ops


def publish(small: Path, plan: Plan, results: dict[str, ShardResult], repo_id: str, token: str, *,
            commit_message: str) -> tuple[list[str], int]:
    """Commit the uploaded shards and the small files of ``small`` (a finished output folder whose shards are
    stand-ins; its README.md is the model card) to ``repo_id``: one commit, or for more than
    ``MAX_FILES_PER_COMMIT`` files, the shards in batches first and the small files (index, config, expq.json,
    card) last, so that the repo is a loadable checkpoint only once all of it is there. Then every remote file's
    size and hash is checked against what was made (``push.compare_remote``).

    Returns:
        (the commit URLs, the files checked).

    Raises:
        HubError: the Hub refused or failed (``hub.errors.translate``). PushError: a remote file differs.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    shard_ops = [results[n].operation for n in plan.shard_names]
    files = [{"path": r.name, "size": r.size, "sha256": r.sha256} for r in (results[n] for n in plan.shard_names)]
    small_ops = []
    for p in sorted(small.rglob("*")):
        rel = p.relative_to(small).as_posix()
        if p.is_file() and rel not in results:
            small_ops.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p)))
            files.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    ops = shard_ops + small_ops
    batches = [ops] if len(ops) <= MAX_FILES_PER_COMMIT else (
        [shard_ops[i:i + MAX_FILES_PER_COMMIT] for i in range(0, len(shard_ops), MAX_FILES_PER_COMMIT)]
        + [small_ops])
    urls = []
    with translated(repo=repo_id, token=token, action="write"):
        for i, batch in enumerate(batches):
            part = f" ({i + 1}/{len(batches)})" if len(batches) > 1 else ""
            info = api.create_commit(repo_id, operations=batch, commit_message=commit_message + part)
            urls.append(getattr(info, "commit_url", None) or "")
        res = PushReport(repo_id=repo_id, revision=None, dry_run=False, files=files,
                         bytes=sum(f["size"] for f in files), verified=None, verify_verdict=None)
        compare_remote(api, small, repo_id, None, res)
    return urls, res.checked_remote

"""The local Hub server (tests/hub_server.py) against the real huggingface_hub client, offline."""

import hashlib
import os

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")

from huggingface_hub import (  # noqa: E402
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

try:
    from hub_server import HubServer, configure_hf_client, set_hf_offline
except ImportError:  # tests/ is a package
    from tests.hub_server import HubServer, configure_hf_client, set_hf_offline

REPO = "test-user/tiny-moe"
# huggingface_hub's LFS upload passes a file object as `data=` to httpx(2), which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tree(root, files: dict[str, bytes]):
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def seeded(hub_server, tmp_path):
    """REPO with a main branch (text + LFS files) and a v2 branch with one more commit."""
    files = {
        "config.json": b'{"model_type": "tiny"}',
        "README.md": b"# tiny\n",
        "model.safetensors": os.urandom(4096),  # LFS through the default .gitattributes
        "sub/tokenizer.json": b'{"vocab": {}}',
    }
    hub_server.add_repo(REPO, _tree(tmp_path / "seed", files))
    hub_server.commit_files(REPO, {"config.json": b'{"model_type": "tiny", "v": 2}'}, revision="v2")
    return files


def test_whoami_and_create_repo(hub_server):
    api = HfApi()
    assert api.whoami()["name"] == "test-user"

    url = api.create_repo(REPO)
    assert url.repo_id == REPO and url.startswith(hub_server.url)
    assert hub_server.repo_exists(REPO)
    assert list(hub_server.list_files(REPO)) == [".gitattributes"]  # like the Hub: an initial commit

    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)
    assert err.value.response.status_code == 409
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO

    ds = api.create_repo("test-user/data", repo_type="dataset", private=True)
    assert ds.repo_type == "dataset" and hub_server.repos[("dataset", "test-user/data")].private
    # module-level functions use huggingface_hub's import-time HfApi instance: patched as well
    assert huggingface_hub.list_repo_files(REPO) == [".gitattributes"]


def test_snapshot_download_revisions_patterns_and_offline(hub_server, seeded, tmp_path, monkeypatch):
    path = snapshot_download(REPO)
    assert os.path.basename(path) == hub_server.head(REPO)
    got = {
        os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/")
        for d, _, fs in os.walk(path)
        for f in fs
    }
    assert got == set(seeded) | {".gitattributes"}
    for rel, data in seeded.items():
        with open(os.path.join(path, rel), "rb") as f:
            assert f.read() == data

    v2 = snapshot_download(REPO, revision="v2", allow_patterns=["*.json"])
    assert os.path.basename(v2) == hub_server.head(REPO, "v2") != os.path.basename(path)
    assert sorted(os.listdir(v2)) == ["config.json", "sub"]
    with open(os.path.join(v2, "config.json"), "rb") as f:
        assert b'"v": 2' in f.read()

    local = snapshot_download(REPO, ignore_patterns=["*.safetensors", "sub/*"], local_dir=tmp_path / "local")
    assert sorted(p for p in os.listdir(local) if not p.startswith(".")) == ["README.md", "config.json"]

    by_commit = snapshot_download(REPO, revision=hub_server.head(REPO))
    assert by_commit == path

    # Offline: served from the cache, no request reaches the server.
    seen = len(hub_server.requests)
    set_hf_offline(monkeypatch)
    assert snapshot_download(REPO) == path
    assert snapshot_download(REPO, revision="v2", allow_patterns=["*.json"]) == v2
    assert hf_hub_download(REPO, "config.json").startswith(path)
    assert len(hub_server.requests) == seen
    with pytest.raises(Exception):  # noqa: B017 - never downloaded => not in the cache (the client's error)
        snapshot_download("test-user/other")


def test_range_requests_and_served_bytes(hub_server, seeded):
    """Range: bytes=a-b / a- / -n answer 206 with Content-Range (clipped to the file), past the end 416; the
    transfers are listed with their byte ranges; serve_instead sends other bytes under the same listing."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    data = seeded["model.safetensors"]
    url = hf_hub_url(REPO, "model.safetensors")

    def get(rng):
        return get_session().get(url, headers={**build_hf_headers(), "Range": rng})

    for rng, first, last in (("bytes=0-7", 0, 7), ("bytes=100-", 100, 4095), ("bytes=-10", 4086, 4095),
                             ("bytes=4000-9999", 4000, 4095)):
        r = get(rng)
        assert r.status_code == 206 and r.content == data[first:last + 1], rng
        assert r.headers["Content-Range"] == f"bytes {first}-{last}/4096"
        assert int(r.headers["Content-Length"]) == last - first + 1
    r = get("bytes=4096-")
    assert r.status_code == 416 and r.headers["Content-Range"] == "bytes */4096"
    whole = get_session().get(url, headers=build_hf_headers())
    assert whole.status_code == 200 and whole.content == data
    assert hub_server.transfers(REPO) == [("model.safetensors", 206, 0, 8), ("model.safetensors", 206, 100, 3996),
                                          ("model.safetensors", 206, 4086, 10),
                                          ("model.safetensors", 206, 4000, 96), ("model.safetensors", 200, 0, 4096)]
    # a corrupt copy: the listing (size, sha256) stays, the bytes sent differ
    hub_server.serve_instead(REPO, "model.safetensors", data[:1000])
    listed = {s.rfilename: s for s in HfApi().model_info(REPO, files_metadata=True).siblings}["model.safetensors"]
    assert listed.size == 4096 and listed.lfs.sha256 == _sha256(data)
    r = get("bytes=990-")
    assert r.status_code == 206 and r.content == data[990:1000] and r.headers["Content-Range"] == "bytes 990-999/1000"


def test_upload_folder_regular_and_lfs_files(hub_server, tmp_path):
    hub_server.lfs_threshold = 1024 * 1024  # text files >= 1 MiB go through LFS, like >= 10 MiB on the Hub
    hub_server.multipart_chunk_size = 1024 * 1024  # and LFS objects > 1 MiB use the multipart transfer
    files = {
        "config.json": b'{"a": 1}',
        "notes/readme.txt": b"hello\n",
        "empty.txt": b"",
        "model-00001-of-00002.safetensors": os.urandom(300_000),  # .gitattributes pattern => LFS, basic transfer
        "big.bin": os.urandom(2_500_000),  # LFS, multipart: 3 parts
        "big-text.jsonl": b'{"x": 1}\n' * 150_000,  # 1.35 MB of text: LFS by size
    }
    api = HfApi()
    api.create_repo(REPO)
    info = api.upload_folder(repo_id=REPO, folder_path=_tree(tmp_path / "out", files), commit_message="push")
    assert info.oid == hub_server.head(REPO) and len(info.oid) == 40
    assert hub_server.history(REPO)[0].title == "push"

    remote = hub_server.list_files(REPO)
    for rel, data in files.items():
        assert remote[rel]["size"] == len(data) and remote[rel]["sha256"] == _sha256(data)
        assert hub_server.read_file(REPO, rel) == data
    lfs = {rel for rel, meta in remote.items() if meta["lfs"]}
    assert lfs == {"model-00001-of-00002.safetensors", "big.bin", "big-text.jsonl"}
    assert sorted(hub_server.uploaded_oids) == sorted(_sha256(files[rel]) for rel in lfs)
    assert hub_server.stats["lfs_upload"] == 1  # the .safetensors shard: one PUT (basic transfer)
    assert hub_server.stats["lfs_part"] == 3 + 2  # big.bin: 3 parts, big-text.jsonl: 2 parts (multipart)
    assert hub_server.stats["lfs_complete"] == 2 and hub_server.stats["commit"] == 1

    # Same folder again: the client sees unchanged files (preupload oids) and makes no commit or upload.
    hub_server.reset_stats()
    api.upload_folder(repo_id=REPO, folder_path=tmp_path / "out")
    assert hub_server.stats["commit"] == 0 and hub_server.uploaded_oids == []
    assert hf_hub_download(REPO, "big.bin") and open(hf_hub_download(REPO, "big.bin"), "rb").read() == files["big.bin"]


def test_resumed_push_does_not_reupload_finished_files(hub_server, tmp_path):
    files = {f"model-{i:05d}.safetensors": os.urandom(50_000 + i) for i in range(4)}
    files["config.json"] = b"{}"
    folder = _tree(tmp_path / "out", files)
    api = HfApi()
    api.create_repo(REPO)

    # Two LFS uploads go through, then every upload fails with a status the client does not retry.
    hub_server.inject_fault("upload", after=2, status=507)
    with pytest.raises(Exception):  # noqa: B017 - the client's error for a 507; what the server kept is the test
        api.upload_folder(repo_id=REPO, folder_path=folder)
    assert len(hub_server.uploaded_oids) == 2 and hub_server.stats["commit"] == 0
    assert list(hub_server.list_files(REPO)) == [".gitattributes"]  # nothing committed
    finished = set(hub_server.uploaded_oids)

    # Resume: the LFS batch API reports the finished objects as present, so only the others are sent.
    hub_server.clear_faults()
    hub_server.reset_stats()
    api.upload_folder(repo_id=REPO, folder_path=folder)
    assert hub_server.stats["lfs_upload"] == 2 and not finished & set(hub_server.uploaded_oids)
    assert {meta["sha256"] for meta in hub_server.list_files(REPO).values()} >= {_sha256(d) for d in files.values()}

    # The commit itself fails (after the uploads): the next push uploads nothing again.
    hub_server.commit_files(REPO, {f: None for f in files})  # back to an empty tree, objects are kept
    hub_server.reset_stats()
    hub_server.inject_fault("commit", status=507, times=1)
    with pytest.raises(HfHubHTTPError) as err:
        api.upload_folder(repo_id=REPO, folder_path=folder)
    assert err.value.response.status_code == 507
    api.upload_folder(repo_id=REPO, folder_path=folder)
    assert hub_server.uploaded_oids == [] and hub_server.stats["commit"] == 2
    assert set(files) <= set(hub_server.list_files(REPO))


def test_transient_faults_are_retried_or_surfaced(hub_server, tmp_path):
    api = HfApi()
    api.create_repo(REPO)
    data = os.urandom(20_000)
    # One 503 on the LFS upload: the client retries (after 1 s) and the push succeeds.
    # (2.x also retries 500/502/504/408/429; 1.0 only 503.)
    hub_server.inject_fault("upload", status=503, times=1)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.bin", repo_id=REPO)
    assert hub_server.stats["lfs_upload"] == 2 and hub_server.read_file(REPO, "w.bin") == data
    # A dropped connection on the commit is not retried by the client: the error surfaces, nothing is committed.
    head = hub_server.head(REPO)
    hub_server.inject_fault("commit", mode="drop", times=1)
    with pytest.raises(Exception):  # noqa: B017 - the client's error for a dropped connection
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO)
    assert hub_server.head(REPO) == head
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO)
    assert hub_server.read_file(REPO, "x.txt") == b"x"


@pytest.mark.skipif(not hasattr(HfApi, "upload_large_folder"), reason="no upload_large_folder in this version")
@pytest.mark.filterwarnings("ignore:(?s).*upload_large_folder. is DEPRECATED:FutureWarning")
def test_upload_large_folder(hub_server, tmp_path, monkeypatch):
    module = pytest.importorskip("huggingface_hub._upload_large_folder")
    if hasattr(module, "WAITING_TIME_IF_NO_TASKS"):  # idle workers poll every 10 s in some 1.x versions
        monkeypatch.setattr(module, "WAITING_TIME_IF_NO_TASKS", 0.1)
    files = {f"shard-{i}.safetensors": os.urandom(10_000) for i in range(3)} | {"config.json": b"{}"}
    HfApi().upload_large_folder(repo_id=REPO, folder_path=_tree(tmp_path / "out", files), repo_type="model")
    remote = hub_server.list_files(REPO)
    assert all(remote[rel]["sha256"] == _sha256(data) for rel, data in files.items())


def test_list_files_tree_and_paths_info(hub_server, seeded):
    api = HfApi()
    assert sorted(api.list_repo_files(REPO)) == sorted(set(seeded) | {".gitattributes"})

    root = {e.path: e for e in api.list_repo_tree(REPO)}
    assert set(root) == {".gitattributes", "README.md", "config.json", "model.safetensors", "sub"}
    assert type(root["sub"]).__name__ == "RepoFolder"

    full = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}
    st = full["model.safetensors"]
    assert st.size == 4096 and st.lfs.sha256 == _sha256(seeded["model.safetensors"]) and st.lfs.size == 4096
    assert full["config.json"].lfs is None and full["config.json"].size == len(seeded["config.json"])
    assert full["config.json"].blob_id == hub_server.list_files(REPO)["config.json"]["blob_id"]
    assert [e.path for e in api.list_repo_tree(REPO, path_in_repo="sub")] == ["sub/tokenizer.json"]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="nope"))

    hub_server.tree_page_size = 2  # pagination through the Link header
    hub_server.reset_stats()
    assert {e.path for e in api.list_repo_tree(REPO, recursive=True)} == set(full)
    assert hub_server.stats["tree"] == 3

    infos = {e.path: e for e in api.get_paths_info(REPO, ["model.safetensors", "sub", "missing.txt"], expand=True)}
    assert set(infos) == {"model.safetensors", "sub"}
    assert infos["model.safetensors"].lfs.sha256 == _sha256(seeded["model.safetensors"])
    assert infos["model.safetensors"].last_commit.oid == hub_server.history(REPO)[0].oid
    v2 = api.get_paths_info(REPO, "config.json", revision="v2")[0]
    assert v2.size == len(b'{"model_type": "tiny", "v": 2}')


def test_model_and_dataset_info(hub_server, seeded, tmp_path):
    api = HfApi()
    info = api.model_info(REPO)
    assert info.id == REPO and info.sha == hub_server.head(REPO) and info.private is False
    assert {s.rfilename for s in info.siblings} == set(seeded) | {".gitattributes"}
    meta = {s.rfilename: s for s in api.model_info(REPO, revision="v2", files_metadata=True).siblings}
    assert meta["model.safetensors"].size == 4096
    assert meta["model.safetensors"].lfs.sha256 == _sha256(seeded["model.safetensors"])
    assert api.model_info(REPO, revision="v2").sha == hub_server.head(REPO, "v2")
    assert api.repo_exists(REPO) and not api.repo_exists("test-user/nope")
    assert api.file_exists(REPO, "sub/tokenizer.json") and not api.file_exists(REPO, "nope.txt")

    hub_server.add_repo("test-user/ds", _tree(tmp_path / "ds", {"data.csv": b"a,b\n1,2\n"}), repo_type="dataset")
    assert api.dataset_info("test-user/ds").sha == hub_server.head("test-user/ds", repo_type="dataset")
    assert api.repo_info("test-user/ds", repo_type="dataset").id == "test-user/ds"
    path = hf_hub_download("test-user/ds", "data.csv", repo_type="dataset")
    assert open(path, "rb").read() == b"a,b\n1,2\n"
    out = api.upload_file(path_or_fileobj=os.urandom(1000), path_in_repo="x.parquet", repo_id="test-user/ds",
                          repo_type="dataset")
    assert out.repo_url.repo_type == "dataset" and out.oid == hub_server.head("test-user/ds", repo_type="dataset")
    assert hub_server.list_files("test-user/ds", repo_type="dataset")["x.parquet"]["lfs"]


def test_create_commit_pr_branch_and_deletes(hub_server, seeded):
    api = HfApi()
    main = hub_server.head(REPO)
    pr = api.create_commit(
        REPO,
        [CommitOperationAdd("extra.txt", b"from a PR"), CommitOperationDelete("README.md")],
        commit_message="Add extra",
        create_pr=True,
    )
    assert pr.pr_revision == "refs/pr/1" and pr.pr_num == 1 and pr.pr_url.endswith("/discussions/1")
    assert hub_server.head(REPO) == main  # main untouched
    assert hub_server.head(REPO, "refs/pr/1") == pr.oid
    files = hub_server.list_files(REPO, "refs/pr/1")
    assert "extra.txt" in files and "README.md" not in files
    assert open(hf_hub_download(REPO, "extra.txt", revision="refs/pr/1"), "rb").read() == b"from a PR"
    assert api.create_commit(REPO, [CommitOperationAdd("b.txt", b"b")], commit_message="2", create_pr=True).pr_num == 2

    api.create_branch(REPO, branch="dev")
    api.create_branch(REPO, branch="dev", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_branch(REPO, branch="dev")
    assert err.value.response.status_code == 409
    out = api.create_commit(
        REPO, [CommitOperationDelete("sub/", is_folder=True)], commit_message="rm sub", revision="dev"
    )
    assert out.oid == hub_server.head(REPO, "dev") and hub_server.head(REPO) == main
    assert "sub/tokenizer.json" not in hub_server.list_files(REPO, "dev")
    assert "sub/tokenizer.json" in hub_server.list_files(REPO)

    api.create_tag(REPO, tag="v1.0", revision="dev")
    api.create_tag(REPO, tag="v1.0", exist_ok=True)
    assert api.model_info(REPO, revision="v1.0").sha == hub_server.head(REPO, "dev")
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {b.name for b in refs.branches} == {"main", "v2", "dev"} and [t.name for t in refs.tags] == ["v1.0"]
    assert {p.ref for p in refs.pull_requests} == {"refs/pr/1", "refs/pr/2"}
    assert [c.title for c in api.list_repo_commits(REPO, revision="dev")][:2] == ["rm sub", "Upload folder"]

    with pytest.raises(HfHubHTTPError) as err:  # stale parent commit
        api.create_commit(REPO, [CommitOperationAdd("c.txt", b"c")], commit_message="c", parent_commit="0" * 40)
    assert err.value.response.status_code == 412
    with pytest.raises(RemoteEntryNotFoundError):
        api.create_commit(REPO, [CommitOperationDelete("nope.txt")], commit_message="rm")
    with pytest.raises(RevisionNotFoundError):
        api.create_commit(REPO, [CommitOperationAdd("c.txt", b"c")], commit_message="c", revision="no-such-branch")


def test_error_cases(hub_server, seeded, tmp_path):
    api = HfApi()
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("test-user/nope")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("test-user/nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("test-user/nope", "config.json")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="nope")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="nope")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.json")

    # Repo type mismatch: the repo exists as a dataset only.
    hub_server.add_repo("test-user/only-ds", _tree(tmp_path / "ds", {"d.txt": b"d"}), repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("test-user/only-ds")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("test-user/only-ds")
    with pytest.raises(RepositoryNotFoundError):
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id="test-user/only-ds")
    assert snapshot_download("test-user/only-ds", repo_type="dataset")

    # 403: the token is valid but has no write access to the repo / namespace.
    hub_server.deny_write(REPO, "other-org")
    with pytest.raises(HfHubHTTPError) as err:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=REPO)
    assert err.value.response.status_code == 403 and not isinstance(err.value, RepositoryNotFoundError)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("other-org/model")
    assert err.value.response.status_code == 403
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO  # exists: 403 on create is fine with exist_ok
    assert api.model_info(REPO).sha  # reads still work

    # Private repo read without a token.
    hub_server.add_repo("test-user/secret", _tree(tmp_path / "s", {"s.txt": b"s"}), private=True)
    assert api.model_info("test-user/secret").private is True
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("test-user/secret", token=False)

    # 401: the token is rejected.
    hub_server.reject_tokens = True
    with pytest.raises(HfHubHTTPError) as err:
        api.whoami()
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        api.model_info(REPO)
    assert err.value.response.status_code == 401 and not isinstance(err.value, RepositoryNotFoundError)
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("test-user/new-one")
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        snapshot_download("test-user/never-downloaded")
    assert err.value.response.status_code == 401
    assert api.model_info(REPO, token=False).sha  # anonymous read of a public repo still works


def test_standalone_server_without_auth_and_constructor_faults(tmp_path, monkeypatch):
    files = {f"shard-{i}.safetensors": os.urandom(1000 + i) for i in range(3)}
    folder = _tree(tmp_path / "out", files)
    with HubServer(tmp_path / "srv", token=None, fail_after_uploads=1, fail_status=507) as server:
        configure_hf_client(monkeypatch, server.url, tmp_path / "home", token=None)
        api = HfApi()
        assert api.create_repo("someone/x").repo_id == "someone/x"  # no auth: every request is allowed
        with pytest.raises(Exception):  # noqa: B017 - the client's error for a 507; what the server kept is the test
            api.upload_folder(repo_id="someone/x", folder_path=folder)
        assert len(server.uploaded_oids) == 1
        server.clear_faults()
        api.upload_folder(repo_id="someone/x", folder_path=folder)
        assert sorted(server.uploaded_oids) == sorted(_sha256(d) for d in files.values())  # each one once
        assert server.history("someone/x")[0].oid == api.model_info("someone/x").sha

"""Hub errors, through the real huggingface_hub client and the local Hub-compatible server (tests/hub_server.py):
only the files a conversion needs are downloaded, every way of not getting them has its own exit status and a
one-line message naming the repo (and the file), never the token; and the same answer of the Hub is the same exit
status for a download (convert, inspect) as for an upload (push)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import example
from hub_server import configure_hf_client, set_hf_offline
from typer.testing import CliRunner

from expq.cli import app

REPO = "org/junk"
# Files the test repo holds that a conversion must never fetch: other formats, subfolders, unindexed root weights.
JUNK = ["onnx/model.onnx", "onnx/config.json", "metal/model.safetensors", "original/params.json",
        "model.safetensors", "consolidated.safetensors", "extra-00001-of-00001.safetensors", "pytorch_model.bin"]
SIDE = ["README.md", "LICENSE", "tokenizer_config.json", "chat_template.jinja", "modeling_custom.py"]


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def storage() -> Path:
    return Path(os.environ["HF_HUB_CACHE"]) / ("models--" + REPO.replace("/", "--"))


@pytest.fixture
def junk_repo(hub_server, tmp_path, tmp_path_factory):
    """A tiny sharded Mixtral published as org/junk with root side files and every kind of file not to fetch.
    Returns (folder, commit, the files a conversion needs)."""
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    shard = sorted(folder.glob("model-*.safetensors"))[0].read_bytes()
    for name, data in [("README.md", b"# junk\n"), ("LICENSE", b"Apache-2.0\n"),
                       ("tokenizer_config.json", b"{}"), ("chat_template.jinja", b"{{ messages }}"),
                       ("modeling_custom.py", b"# remote code\n"), ("onnx/model.onnx", b"\0onnx"),
                       ("onnx/config.json", b"{}"), ("metal/model.safetensors", shard),
                       ("original/params.json", b"{}"), ("model.safetensors", shard),
                       ("consolidated.safetensors", shard), ("extra-00001-of-00001.safetensors", shard),
                       ("pytorch_model.bin", b"\0bin")]:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
    commit = hub_server.add_repo(REPO, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    needed = sorted({p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - set(JUNK))
    assert all("/" not in f for f in needed) and {"config.json", "tokenizer.json", *SIDE} <= set(needed)
    assert set(index["weight_map"].values()) == {f for f in needed if f.endswith(".safetensors")}
    assert len(set(index["weight_map"].values())) >= 3
    return folder, commit, needed


def snapshot_files(commit: str) -> list[str]:
    snap = storage() / "snapshots" / commit
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if not p.is_dir())


# --- what is downloaded ---------------------------------------------------------------------------------------------
def test_only_indexed_shards_and_root_side_files_are_downloaded(hub_server, junk_repo, tmp_path):
    folder, commit, needed = junk_repo
    out = tmp_path / "out"
    code, text = run("convert", REPO, out, "--device", "cpu", "--json", "--max-shard-size", "40KB")
    assert code == 0, text
    assert json.loads(text)["commit"] == commit and (out / "model.safetensors.index.json").is_file()
    assert sorted(set(hub_server.downloaded(REPO))) == needed  # nothing else was sent by the server
    assert snapshot_files(commit) == needed
    assert len(list((storage() / "blobs").iterdir())) == len(needed)
    # snapshot files are links into blobs/, and the conversion read them
    snap = storage() / "snapshots" / commit
    assert all((snap / f).is_symlink() and (snap / f).resolve().parent == (storage() / "blobs").resolve()
               for f in needed)
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert not written & set(JUNK) and not any(p.startswith(("onnx", "metal", "original")) for p in written)
    assert set(SIDE) - {"README.md"} <= written and "tokenizer.json" in written
    assert (out / "modeling_custom.py").read_bytes() == b"# remote code\n"


def test_offline_after_a_filtered_download(hub_server, junk_repo, tmp_path, monkeypatch):
    # the cached file list names the junk files too: offline, their absence is not an "incomplete cache"
    _, commit, needed = junk_repo
    code, text = run("inspect", REPO)
    assert code == 0, text
    set_hf_offline(monkeypatch)
    hub_server.reset_stats()
    code, text = run("convert", REPO, tmp_path / "out", "--device", "cpu", "--json")
    assert code == 0, text
    assert json.loads(text)["commit"] == commit and sum(hub_server.stats.values()) == 0
    assert snapshot_files(commit) == needed


# --- errors: one exit status each -----------------------------------------------------------------------------------
def both(tmp_path, *args):
    """(exit code, output) of `expq convert` and of `expq inspect` on the same arguments."""
    src, *rest = args
    conv = run("convert", src, tmp_path / "x", "--device", "cpu", *rest)
    insp = run("inspect", src, *rest)
    assert not (tmp_path / "x").exists()
    return conv, insp


def assert_error(results, code, *fragments, secret=None):
    for got, text in results:
        assert got == code, text
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: repo "), text
        for f in fragments:
            assert f in text, (f, text)
        assert "Traceback" not in text and "hf_test_token" not in text
        assert secret is None or secret not in text


def test_repo_not_found(hub_server, junk_repo, tmp_path):
    assert_error(both(tmp_path, "org/no-such-model"), 3, "repo org/no-such-model", "repo not found")


def test_revision_not_found(hub_server, junk_repo, tmp_path):
    assert_error(both(tmp_path, REPO, "--revision", "nope"), 3, "repo org/junk (revision nope)",
                 "revision 'nope' not found")
    assert_error(both(tmp_path, REPO, "--revision", "0" * 40), 3, "not found")


def test_index_names_a_file_the_repo_lacks(hub_server, junk_repo, tmp_path):
    folder, _, _ = junk_repo
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00009-of-00009.safetensors"
    hub_server.commit_files(REPO, {"model.safetensors.index.json": json.dumps(index)})
    hub_server.reset_stats()
    assert_error(both(tmp_path, REPO), 3, "file model-00009-of-00009.safetensors", "does not have it")
    assert not any(p.endswith(".safetensors") for p in hub_server.downloaded(REPO))  # refused before any shard


def test_404_on_a_listed_file(hub_server, junk_repo, tmp_path):
    _, commit, needed = junk_repo
    shard = [f for f in needed if f.startswith("model-")][1]
    hub_server.hide_file(REPO, shard)
    assert_error(both(tmp_path, REPO, "--revision", commit), 3, f"file {shard}", "answers 404")


def test_gated_repo(hub_server, junk_repo, tmp_path, monkeypatch):
    hub_server.gate(REPO)  # the token's user was not granted access: 403 GatedRepo
    assert_error(both(tmp_path, REPO), 4, "gated repo", "not been granted access", "accept its conditions at")
    configure_hf_client(monkeypatch, hub_server.url, tmp_path / "home2", None)  # no token: 401 GatedRepo
    assert_error(both(tmp_path, REPO), 4, "gated repo, and no token was sent", "hf auth login")
    hub_server.gate(REPO, granted=("test-user",))
    configure_hf_client(monkeypatch, hub_server.url, tmp_path / "home3", "hf_test_token")
    code, text = run("inspect", REPO)
    assert code == 0, text


def test_forbidden(hub_server, junk_repo, tmp_path):
    hub_server.deny_read(REPO)
    assert_error(both(tmp_path, REPO), 4, "access forbidden (HTTP 403: Your token does not have read access",
                 "use a token with read access")


def test_bad_token_is_rejected_and_never_printed(hub_server, junk_repo, tmp_path, capfd):
    secret = "hf_wrong_secret_value_42"
    assert_error(both(tmp_path, REPO, "--token", secret), 5, "rejected the token (401", secret=secret)
    hub_server.reject_tokens = True  # the token from HF_TOKEN, rejected
    assert_error(both(tmp_path, REPO), 5, "rejected the token")
    out = capfd.readouterr()
    assert secret not in out.out + out.err and "hf_test_token" not in out.out + out.err


def test_offline_and_not_cached(hub_server, junk_repo, tmp_path, monkeypatch):
    set_hf_offline(monkeypatch)
    assert_error(both(tmp_path, REPO), 6, "not in the local cache", "HF_HUB_OFFLINE is set")
    assert sum(hub_server.stats.values()) == 0


def test_hub_unreachable_and_not_cached(hub_server, junk_repo, tmp_path, monkeypatch):
    configure_hf_client(monkeypatch, "http://127.0.0.1:9", tmp_path / "home2", "hf_test_token")  # nothing listens
    assert_error(both(tmp_path, REPO), 6, "not in the local cache", "cannot be reached", "HF_ENDPOINT")


def test_hub_outage_uses_the_cache(hub_server, junk_repo, tmp_path):
    _, commit, _ = junk_repo
    hub_server.inject_fault("info", status=507)  # a status huggingface_hub does not retry
    assert_error(both(tmp_path, REPO), 6, "not in the local cache", "the Hub answered 507")
    hub_server.clear_faults()
    assert run("inspect", REPO)[0] == 0
    hub_server.inject_fault("info", status=507)
    code, text = run("inspect", REPO, "--json")
    assert code == 0, text
    assert json.loads(text)["commit"] == commit


@pytest.mark.parametrize("tree_cached", [True, False], ids=["file-list-cached", "no-file-list"])
def test_incomplete_cache_names_the_missing_file(hub_server, junk_repo, tmp_path, monkeypatch, tree_cached):
    _, commit, needed = junk_repo
    assert run("inspect", REPO)[0] == 0
    shard = [f for f in needed if f.startswith("model-")][-1]
    (storage() / "snapshots" / commit / shard).resolve().unlink()  # the blob: the link dangles
    if not tree_cached:
        shutil.rmtree(storage() / "trees")
    set_hf_offline(monkeypatch)
    assert_error(both(tmp_path, REPO), 7, f"file {shard}", f"missing from the cached snapshot {commit}",
                 "network access")


def test_cache_without_refs_suggests_the_commit(hub_server, junk_repo, tmp_path, monkeypatch):
    _, commit, _ = junk_repo
    assert run("inspect", REPO)[0] == 0
    shutil.rmtree(storage() / "refs")
    set_hf_offline(monkeypatch)
    for args in ((), ("--revision", "main")):
        assert_error(both(tmp_path, REPO, *args), 7, "no refs/main", f"--revision {commit}")
    code, text = run("inspect", REPO, "--revision", commit)  # and the suggestion works
    assert code == 0, text


# --- both ways: the same answer of the Hub is the same exit status for a download and for an upload ----------------
@pytest.fixture
def int8_out(tmp_path, tmp_path_factory):
    """A converted checkpoint to push, converted from a local directory (no Hub call)."""
    import expq

    out = tmp_path / "int8"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu")
    return out


def down_and_up(out, *args):
    """(exit code, output) of a download (`expq inspect org/junk`) and of an upload (`expq push OUT me/up`)."""
    return [run("inspect", REPO, *args), run("push", out, "me/up", "--skip-verify", *args)]


@pytest.mark.parametrize("status,code,says", [(404, 3, "the Hub answered 404"), (403, 4, "(HTTP 403: Injected"),
                                              (507, 6, "the Hub answered 507"), (400, 1, "the Hub answered 400")])
def test_the_same_answer_is_the_same_exit_status_both_ways(hub_server, junk_repo, int8_out, status, code, says):
    hub_server.inject_fault("*", status=status)  # every request, of either direction, gets this answer
    assert_error(down_and_up(int8_out), code, says)
    assert {"info"} <= set(hub_server.stats) and not hub_server.repo_exists("me/up")


def test_a_rejected_token_is_5_both_ways(hub_server, junk_repo, int8_out):
    secret = "hf_wrong_secret_value_42"
    assert_error(down_and_up(int8_out, "--token", secret), 5, "the Hub rejected the token (401",
                 "check --token TOKEN, HF_TOKEN or hf auth login", secret=secret)


def test_an_unreachable_hub_is_6_both_ways(hub_server, junk_repo, int8_out, tmp_path, monkeypatch):
    configure_hf_client(monkeypatch, "http://127.0.0.1:9", tmp_path / "home2", "hf_test_token")  # nothing listens
    assert_error(down_and_up(int8_out), 6, "the Hub at http://127.0.0.1:9 cannot be reached")


def test_offline_mode_is_6_both_ways(hub_server, junk_repo, int8_out, monkeypatch):
    set_hf_offline(monkeypatch)
    assert_error(down_and_up(int8_out), 6, "HF_HUB_OFFLINE is set")
    assert sum(hub_server.stats.values()) == 0

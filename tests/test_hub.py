"""The Hub, through a Hub-compatible server on 127.0.0.1 (tests/hub_server.py): converting from a repo id, and
expq push (full push, resume, refusal, the card, errors, no token leaks)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import yaml
from helpers import example, tree_digest
from hub_server import set_hf_offline
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import ExpqError, HubOfflineError, SourceError
from expq.hub import PushError, push

TOKEN = "hf_test_token"
SOURCE_CARD = """---
license: apache-2.0
language:
- en
pipeline_tag: text-generation
tags:
- mixtral
- tiny
---

# tiny mixtral

A test model.
"""


@pytest.fixture
def hub_src(hub_server, tmp_path, tmp_path_factory):
    """A tiny Mixtral with a model card and a stray .bin file, published on the test Hub as org/tiny-mixtral."""
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    (folder / "README.md").write_text(SOURCE_CARD)
    (folder / "pytorch_model.bin").write_bytes(b"not needed: the safetensors hold the weights")
    commit = hub_server.add_repo("org/tiny-mixtral", folder)
    return folder, commit


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


# --- convert from a repo id -----------------------------------------------------------------------------------------
def test_convert_from_repo_id(hub_server, hub_src, tmp_path):
    folder, commit = hub_src
    code, text = run("convert", "org/tiny-mixtral", tmp_path / "out", "--json", "--device", "cpu")
    assert code == 0, text
    rep = json.loads(text)
    assert rep["source"] == "org/tiny-mixtral" and rep["commit"] == commit and rep["revision"] == "main"
    # same bytes as converting the local copy; the .bin was never downloaded
    expq.convert(folder, tmp_path / "local", device="cpu")
    a, b = tree_digest(tmp_path / "out"), tree_digest(tmp_path / "local")
    records = ("expq.json", "config.json")  # expq.json records the source; config.json records expq.json's hash
    assert {k: v for k, v in a.items() if k not in records} == {k: v for k, v in b.items() if k not in records}
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("out", "local"))
    assert ca.pop("expq_manifest_sha256") != cb.pop("expq_manifest_sha256") and ca == cb
    assert not any("pytorch_model.bin" in p for _, p, *_ in hub_server.requests)
    manifest = json.loads((tmp_path / "out" / "expq.json").read_text())
    assert manifest["source"]["repo_id"] == "org/tiny-mixtral" and manifest["source"]["commit"] == commit
    assert manifest["command"].startswith(f"expq convert org/tiny-mixtral OUT --revision {commit}")
    assert manifest["source_card"]["license"] == "apache-2.0"


def test_convert_revision_and_offline(hub_server, hub_src, tmp_path, monkeypatch):
    folder, first = hub_src
    # a second commit on main changes the config; --revision picks the first one
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 3.25e-6
    hub_server.commit_files("org/tiny-mixtral", {"config.json": json.dumps(cfg)})
    r = expq.convert("org/tiny-mixtral", tmp_path / "old", revision=first, device="cpu")
    assert r.commit == first
    assert json.loads((tmp_path / "old" / "config.json").read_text()).get("rms_norm_eps") != 3.25e-6
    r2 = expq.convert("org/tiny-mixtral", tmp_path / "new", device="cpu")
    assert r2.commit != first
    # offline: served from the cache, no request reaches the server
    set_hf_offline(monkeypatch)
    hub_server.reset_stats()
    expq.convert("org/tiny-mixtral", tmp_path / "offline", revision=first, device="cpu")
    assert sum(hub_server.stats.values()) == 0
    with pytest.raises(SourceError, match="not in the local cache"):
        expq.convert("org/never-downloaded", tmp_path / "x", device="cpu")


def test_convert_repo_errors(hub_server, hub_src, tmp_path):
    with pytest.raises(SourceError, match="repo not found"):
        expq.convert("org/no-such-model", tmp_path / "x", device="cpu")
    with pytest.raises(SourceError, match="revision 'nope' not found"):
        expq.convert("org/tiny-mixtral", tmp_path / "x", revision="nope", device="cpu")
    code, text = run("convert", "org/no-such-model", tmp_path / "x")
    assert code == 3 and "org/no-such-model" in text and "Traceback" not in text
    assert not (tmp_path / "x").exists()


# --- push -----------------------------------------------------------------------------------------------------------
@pytest.fixture
def converted(hub_server, hub_src, tmp_path):
    out = tmp_path / "tiny-mixtral-int8"
    expq.convert("org/tiny-mixtral", out, device="cpu", max_shard_size="40KB")
    return out


def card_yaml(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_full_push(hub_server, converted, hub_src):
    _, commit = hub_src
    res = push(converted, "me/tiny-mixtral-int8")
    remote = hub_server.list_files("me/tiny-mixtral-int8")
    local = {f["path"]: f for f in res.files}
    assert set(local) <= set(remote) and "README.md" in local
    for path, f in local.items():
        assert remote[path]["size"] == f["size"] and remote[path]["sha256"] == f["sha256"], path
    assert not any(p.startswith(".expq") for p in remote)
    assert res.verified is True and res.checked_remote == len(local)
    # the card written in OUT is the one on the Hub
    card = (converted / "README.md").read_text()
    assert hub_server.read_file("me/tiny-mixtral-int8", "README.md").decode() == card
    meta = card_yaml(card)
    assert meta["base_model"] == "org/tiny-mixtral" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers"
    assert {"moe", "int8", "experts_int8", "compressed-tensors", "expq", "mixtral"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]  # carried from the source card
    assert meta["pipeline_tag"] == "text-generation"
    body = card.split("---\n", 2)[2]
    assert f"revision `{commit}`" in body
    assert f"expq convert org/tiny-mixtral tiny-mixtral-int8 --revision {commit} --max-shard-size 40000" in body
    assert "expq 0.1.0" in body and "PASS" in body
    assert "2 MoE layers x 4 experts x 3 projections (gate, up, down) = 24 matrices" in body
    assert "expq.load_model" in body
    # hidden 64 is not a multiple of 128: the card says Marlin cannot serve it instead of offering `vllm serve`
    assert "vllm serve" not in body and "multiple of 128; this model's is 64" in body
    # pushing again changes nothing and uploads nothing
    hub_server.reset_stats()
    push(converted, "me/tiny-mixtral-int8")
    assert hub_server.uploaded_oids == []


def test_interrupted_push_resumes(hub_server, converted):
    n = len(list(converted.glob("*.safetensors")))
    assert n >= 3
    readme = (converted / "README.md").read_bytes()
    hub_server.inject_fault("lfs_upload", after=2, times=1, status=507)
    with pytest.raises(HubOfflineError, match="the Hub answered 507.*re-run the same command to resume"):
        push(converted, "me/resumed")
    assert (converted / "README.md").read_bytes() == readme  # the failed push's card is not left in OUT
    first = list(hub_server.uploaded_oids)
    assert 0 < len(first) < n  # uploads run in parallel: the others finished before the failure surfaced
    hub_server.reset_stats()
    res = push(converted, "me/resumed")
    assert not set(first) & set(hub_server.uploaded_oids), "finished files were uploaded again"
    assert len(hub_server.uploaded_oids) == n - len(first)
    remote = hub_server.list_files("me/resumed")
    assert all(remote[f["path"]]["sha256"] == f["sha256"] for f in res.files)


def test_push_refuses_failing_checkpoint(hub_server, converted):
    from safetensors.torch import load_file, save_file

    idx = json.loads((converted / "model.safetensors.index.json").read_text())
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"
    t = load_file(converted / idx["weight_map"][name])
    t[name].zero_()  # bytes 0 = code -128: outside the scheme's range
    save_file(t, converted / idx["weight_map"][name], metadata={"format": "pt"})
    with pytest.raises(PushError, match="verify failed, refusing to push.*(sha256 differs|layer 1 expert 0 down)") as ei:
        push(converted, "me/bad")
    assert "or pass skip_verify=True)" in str(ei.value) and "--" not in str(ei.value)  # Python's words
    assert not hub_server.repo_exists("me/bad")
    code, text = run("push", converted, "me/bad")
    assert code == 1 and "refusing to push" in text and "or pass --skip-verify)" in text  # the CLI's
    res = push(converted, "me/bad", skip_verify=True)
    assert res.verified is None and "Not verified at push time" in (converted / "README.md").read_text()


def test_dry_run_touches_no_network(hub_server, converted, monkeypatch):
    before = tree_digest(converted)
    from hub_server import configure_hf_client

    configure_hf_client(monkeypatch, "http://127.0.0.1:9", hub_server.root / "home2", None)  # nothing listens
    code, text = run("push", converted, "me/dry", "--dry-run")
    assert code == 0, text
    assert "model-00001-of-" in text and "base_model: org/tiny-mixtral" in text and "expq.load_model" in text
    assert tree_digest(converted) == before  # nothing written either
    r = CliRunner().invoke(app, ["push", str(converted), "me/dry", "--dry-run", "--json"])
    rep = json.loads(r.stdout)  # stdout is the JSON alone (warnings go to stderr)
    assert rep["dry_run"] and rep["verified"]
    # README.md is listed as the card that would be uploaded, not the source's card OUT holds now
    (card_file,) = [f for f in rep["files"] if f["path"] == "README.md"]
    card = rep["card"].encode()
    assert card_file == {"path": "README.md", "size": len(card), "sha256": hashlib.sha256(card).hexdigest()}
    assert (converted / "README.md").stat().st_size != len(card)
    assert rep["bytes"] == sum(f["size"] for f in rep["files"])


def test_push_create_pr_and_branch(hub_server, converted):
    push(converted, "me/prs")
    (converted / "NOTES.md").write_text("a change worth a pull request\n")
    res = push(converted, "me/prs", create_pr=True, commit_message="second look")
    assert res.revision == "refs/pr/1" and res.pr_url
    assert "NOTES.md" in hub_server.list_files("me/prs", revision="refs/pr/1")
    assert "NOTES.md" not in hub_server.list_files("me/prs")
    res = push(converted, "me/prs", revision="int8-v2")
    assert res.revision == "int8-v2"
    assert "NOTES.md" in hub_server.list_files("me/prs", revision="int8-v2")


def test_push_errors_and_no_token_leak(hub_server, converted, monkeypatch, capfd):
    readme = (converted / "README.md").read_bytes()  # the source's card, copied by convert
    assert b"expq" not in readme
    # wrong token: 401, and the token never appears in the output
    secret = "hf_super_secret_value_123"
    code, text = run("push", converted, "me/x", "--token", secret)
    assert code == 5 and "401" in text and secret not in text and "check --token TOKEN, HF_TOKEN" in text
    # no permission
    hub_server.deny_write("forbidden")
    code, text = run("push", converted, "forbidden/x")
    assert code == 4 and "no write permission" in text and TOKEN not in text
    # a dataset with that name
    hub_server.create_repo("me/data", repo_type="dataset")
    code, text = run("push", converted, "me/data")
    assert code == 1 and "exists as a dataset repo" in text
    # not a model repo id
    code, text = run("push", converted, "datasets/me/data")
    assert code == 2
    # network failure: nothing listens there
    from hub_server import configure_hf_client

    configure_hf_client(monkeypatch, "http://127.0.0.1:9", hub_server.root / "home2", TOKEN)
    code, text = run("push", converted, "me/x")
    assert code == 6 and "cannot be reached" in text and "resume" in text  # README: 6, the Hub is not reachable
    out = capfd.readouterr()
    assert TOKEN not in out.out + out.err and secret not in out.out + out.err
    # none of these failed pushes left its card in OUT: README.md is what it was
    assert (converted / "README.md").read_bytes() == readme
    assert sorted(p.name for p in converted.iterdir() if p.name.startswith(".")) == []


def test_push_without_token(hub_server, converted, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    before = tree_digest(converted)
    with pytest.raises(PushError, match="no Hugging Face token: pass token='TOKEN', set HF_TOKEN"):
        push(converted, "me/x")
    assert tree_digest(converted) == before  # nothing written before the token check


def test_push_needs_a_converted_checkpoint(hub_server, hub_src):
    folder, _ = hub_src
    with pytest.raises(ExpqError, match="quantization_config"):
        push(folder, "me/x")


def test_verify_source_with_token(hub_server, hub_src, tmp_path, monkeypatch):
    """verify --source of a private repo takes --token, as convert does."""
    folder, _ = hub_src
    hub_server.add_repo("org/private-mixtral", folder, private=True)
    out = tmp_path / "out"
    expq.convert("org/private-mixtral", out, device="cpu")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing cached: the Hub must answer
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    code, text = run("verify", out, "--source", "org/private-mixtral", "--device", "cpu", "--tokens", "8")
    assert code in (3, 4), text
    code, text = run("verify", out, "--source", "org/private-mixtral", "--device", "cpu", "--tokens", "8",
                     "--token", TOKEN)
    assert code == 0 and "PASS" in text and TOKEN not in text, text

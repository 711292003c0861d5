"""expq.json is a typed record: what convert writes loads back field for field, and a corrupt or foreign one is one
clear error naming the file (never a KeyError or JSONDecodeError), in verify, load_model and push alike."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import converted_factory
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import ExpqError, SourceError, UnreadableInputError
from expq.manifest import Manifest


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return converted_factory(tmp_path_factory, "m", max_shard_size="40KB")


def test_manifest_round_trip(outputs):
    src, out = outputs("deepseek_v3")
    text = (out / "expq.json").read_text()
    m = Manifest.load(out)
    assert m.to_json() == text  # every field read back, written again byte for byte
    assert m.plan.moe_layers == [1, 2] and m.plan.dense_layers == [0] and m.plan.routed_experts_per_layer == 4
    assert m.format == "compressed-tensors" and m.source.name == src.name and m.options.dtype == "bfloat16"
    assert m.quantized_modules == 2 * 4 * 3 == m.plan.matrices_quantized


@pytest.mark.parametrize("text,match", [
    ("{not json", "expq.json cannot be read: JSONDecodeError"),
    ("[1, 2]", "expq.json must hold a JSON object"),
    ('{"tool": "someone else", "version": 3}', "not an expq manifest"),
    ("DROP plan", "not an expq manifest: plan: Field required"),
    ("BAD moe_layers", "not an expq manifest: plan.moe_layers"),
])
def test_corrupt_or_foreign_manifest_is_one_clear_error(outputs, tmp_path, text, match):
    _, out = outputs("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    if text.startswith(("DROP", "BAD")):
        data = json.loads((out / "expq.json").read_text())
        if text.startswith("DROP"):
            del data["plan"]
        else:
            data["plan"]["moe_layers"] = "all of them"
        text = json.dumps(data)
    (bad / "expq.json").write_text(text)
    with pytest.raises(SourceError, match=match) as ei:
        Manifest.load(bad)
    assert ei.value.file.endswith("expq.json")
    with pytest.raises(UnreadableInputError, match=match):
        expq.verify(bad, device="cpu", tokens=4)
    with pytest.raises(ExpqError, match=match):
        expq.load_model(bad, device="cpu")
    r = CliRunner().invoke(app, ["verify", str(bad), "--device", "cpu"])
    assert r.exit_code == 2 and match.split(":")[0] in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["push", str(bad), "me/x", "--dry-run", "--skip-verify"])
    assert r.exit_code == 2 and "expq.json" in r.output  # unreadable input, as verify says


def test_verify_exit_status_is_on_the_report(outputs, tmp_path):
    _, out = outputs("mixtral")
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok and rep.exit_code == 0
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (next(bad.glob("model-*.safetensors"))).rename(bad / "stray.bin")  # a shard the index names is gone
    rep = expq.verify(bad, device="cpu", tokens=4)
    assert not rep.ok and rep.exit_code == 1
    r = CliRunner().invoke(app, ["verify", str(bad), "--device", "cpu", "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False


def _count_manifest_reads(monkeypatch, out) -> dict[str, int]:
    """Count, while a command runs, the reads of OUT's expq.json: calls of ``ManifestFile.read`` (the one reader),
    and every open of the file itself, by ``os.open`` or Python's ``open`` (so a reader that went around it would
    show too)."""
    import builtins
    import io
    import os
    from pathlib import Path

    from expq.manifest import ManifestFile

    target = (Path(out) / "expq.json").absolute()
    counts = {"ManifestFile.read": 0, "opens": 0}
    real_read, real_os_open, real_open = ManifestFile.read.__func__, os.open, io.open

    def is_target(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(os.fsdecode(path)).absolute() == target

    def read(cls, root):
        counts["ManifestFile.read"] += (Path(root).absolute() / "expq.json") == target
        return real_read(cls, root)

    def os_open(path, *a, **kw):
        counts["opens"] += is_target(path)
        return real_os_open(path, *a, **kw)

    def py_open(file, *a, **kw):
        counts["opens"] += is_target(file)
        return real_open(file, *a, **kw)

    monkeypatch.setattr(ManifestFile, "read", classmethod(read))
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(io, "open", py_open)
    monkeypatch.setattr(builtins, "open", py_open)
    return counts


def test_expq_json_is_read_once_per_command(outputs, tmp_path, monkeypatch):
    """A re-run of convert with nothing to do, and a verify, each read OUT's expq.json once; the report of the
    re-run still carries what it recorded."""
    src, out = outputs("mixtral")
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    counts = _count_manifest_reads(monkeypatch, mine)
    rep = expq.convert(src, mine, device="cpu", max_shard_size="40KB")
    assert rep.up_to_date and counts == {"ManifestFile.read": 1, "opens": 1}, counts
    assert (rep.zero_rows, rep.shards) == (Manifest.load(out).rows.zero, Manifest.load(out).plan.output_shards)
    counts.update({"ManifestFile.read": 0, "opens": 0})
    assert expq.verify(mine, device="cpu", tokens=4).ok
    assert counts == {"ManifestFile.read": 1, "opens": 1}, counts
    counts.update({"ManifestFile.read": 0, "opens": 0})
    Manifest.load(mine)  # the counting itself sees a read (negative control)
    assert counts == {"ManifestFile.read": 1, "opens": 1}, counts

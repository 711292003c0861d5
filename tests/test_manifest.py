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

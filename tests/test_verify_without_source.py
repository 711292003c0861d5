"""verify without --source sees any changed, missing or extra byte (expq.json records every file's size and
sha256), and load_model refuses a checkpoint with a missing tensor instead of filling it randomly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import converted_factory, edit_shard_tensors, example
from safetensors.torch import load_file

import expq
from expq.errors import ExpqError, SourceError


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return converted_factory(tmp_path_factory, "nosrc", max_shard_size="40KB")


def _code_plus_one(t, n):
    t[n].view(-1)[0] += 1


def _scale_last_bit(t, n):
    t[n].view(-1)[:1].view(torch.int16).__ixor__(1)


def _scale_doubled(t, n):
    t[n].mul_(2)


def _swap_experts(root, a, b):
    """Swap two experts' packed weights (wherever their shards are)."""
    idx = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    ta, tb = load_file(root / idx[a])[a], load_file(root / idx[b])[b]
    edit_shard_tensors(root, a, lambda t: t.__setitem__(a, tb.clone()))
    edit_shard_tensors(root, b, lambda t: t.__setitem__(b, ta.clone()))


M = "model.layers.1.block_sparse_moe.experts"
CORRUPTIONS = {
    "code changed by one": lambda r: edit_shard_tensors(r, f"{M}.2.w1.weight_packed", lambda t: _code_plus_one(t, f"{M}.2.w1.weight_packed")),
    "scale last bit": lambda r: edit_shard_tensors(r, f"{M}.0.w2.weight_scale", lambda t: _scale_last_bit(t, f"{M}.0.w2.weight_scale")),
    "scale doubled": lambda r: edit_shard_tensors(r, f"{M}.3.w3.weight_scale", lambda t: _scale_doubled(t, f"{M}.3.w3.weight_scale")),
    "two experts swapped": lambda r: _swap_experts(r, f"{M}.0.w2.weight_packed", f"{M}.1.w2.weight_packed"),
    "non-expert byte": lambda r: edit_shard_tensors(r, "model.norm.weight", lambda t: t["model.norm.weight"].view(-1)[:1].add_(1)),
    "missing non-expert tensor": lambda r: edit_shard_tensors(r, "model.norm.weight", lambda t: t.pop("model.norm.weight")),
    "extra file": lambda r: (r / "model-99999-of-99999.safetensors").write_bytes(b"x"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_verify_without_source_catches(what, outputs, tmp_path):
    _, out = outputs("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    CORRUPTIONS[what](bad)
    rep = expq.verify(bad, device="cpu", tokens=4)
    assert not rep.ok and rep.exit_code == 1
    assert any(p.startswith("file ") and ("sha256" in p or "missing" in p or "not in expq.json" in p or "bytes" in p)
               for p in rep.problems), rep.problems


def test_untouched_checkpoint_passes_and_the_file_check_is_reported(outputs):
    _, out = outputs("mixtral")
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok
    check = next(c for c in rep.checks if c.name.startswith("files match expq.json"))
    assert check.ok and check.detail.endswith("files")


def test_load_model_refuses_a_missing_tensor(outputs, tmp_path):
    _, out = outputs("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    edit_shard_tensors(bad, "model.norm.weight", lambda t: t.pop("model.norm.weight"))
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.norm.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ExpqError, match="lacks 1 tensor.*model.norm.weight.*refusing to fill them with random"):
        expq.load_model(bad, device="cpu")


def test_untied_config_without_lm_head_is_refused_at_convert(tmp_path, tmp_path_factory):
    src = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    edit_shard_tensors(src, "lm_head.weight", lambda t: t.pop("lm_head.weight"))
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["lm_head.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match="tie_word_embeddings is false but the checkpoint has no lm_head"):
        expq.convert(src, tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()

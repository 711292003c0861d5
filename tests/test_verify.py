"""expq verify: passes converted checkpoints, and fails corrupted ones naming layer / expert / tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import converted_factory
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.verifier import KERNEL_REL_TOL, SOURCE_REL_TOL

FAMILIES = ["mixtral", "deepseek_v3", "gpt_oss", "llama4_text", "dbrx", "granitemoe"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return converted_factory(tmp_path_factory, "v", max_shard_size="40KB")


def corrupt_copy(out, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(out, dst)
    return dst


def edit(dst, name, fn):
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    f = dst / idx["weight_map"][name]
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes_with_source(family, outputs):
    src, out = outputs(family)
    rep = expq.verify(out, source=src, device="cpu", tokens=16)
    assert rep.ok, rep.problems
    assert rep.backend == "torch" and rep.device == "cpu"
    assert rep.verdict.startswith("PASS")
    for r in rep.layers:
        assert r.experts_exercised == r.experts == 4
        assert r.codes_differ == 0 and r.scales_differ == 0
        assert 0.5 < r.max_row_error_steps <= 0.75 + 1e-3  # bf16: half a step + half bf16's spacing below 128
        assert 0 < r.kernel_rel_err <= KERNEL_REL_TOL[torch.bfloat16]
        assert 0 < r.source_rel_err <= SOURCE_REL_TOL
    names = {c.name for c in rep.checks}
    assert {"index and shards agree", "quantization_config", "other tensors byte-identical to the source",
            "experts: bits equal re-quantized source"} <= names
    assert all(c.ok for c in rep.checks)


def test_verify_without_source_and_json(outputs):
    src, out = outputs("mixtral")
    code, text = run("verify", out, "--device", "cpu", "--json", "--tokens", "8")
    assert code == 0, text
    rep = json.loads(text)
    assert rep["ok"] and rep["source"] is None and rep["backend"] == "torch"
    assert all(lr["codes_differ"] is None and lr["kernel_rel_err"] > 0 for lr in rep["layers"])
    code, text = run("verify", out, "--device", "cpu", "--source", src)
    assert code == 0 and "PASS" in text and "torch on cpu" in text


def test_scales_doubled_fails_naming_expert(outputs, tmp_path):
    src, out = outputs("mixtral")
    bad = corrupt_copy(out, tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"
    edit(bad, name, lambda t: t.__setitem__(name, t[name] * 2))
    rep = expq.verify(bad, source=src, device="cpu", tokens=16)
    assert not rep.ok
    msg = " ".join(rep.problems)
    assert "layer 1 expert 2 gate" in msg and "model.layers.1.block_sparse_moe.experts.2.w1" in msg
    assert "scales differ" in msg
    assert any("source experts" in p for p in rep.problems)  # the kernel check sees it too
    code, text = run("verify", bad, "--device", "cpu", "--source", src)
    assert code == 1 and "FAIL" in text


def test_codes_zeroed_fails_without_source(outputs, tmp_path):
    src, out = outputs("deepseek_v3")
    bad = corrupt_copy(out, tmp_path)
    name = "model.layers.2.mlp.experts.3.down_proj.weight_packed"
    edit(bad, name, lambda t: t.__setitem__(name, torch.full_like(t[name], 0x80808080 - (1 << 32))))  # codes 0
    rep = expq.verify(bad, device="cpu", tokens=16)
    assert not rep.ok
    assert any("layer 2 expert 3 down row 0" in p and "largest code is 0" in p for p in rep.problems), rep.problems
    code, text = run("verify", bad, "--device", "cpu")
    assert code == 1 and "layer 2 expert 3 down" in text


def test_dropped_tensor_fails(outputs, tmp_path):
    src, out = outputs("gpt_oss")
    bad = corrupt_copy(out, tmp_path)
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    edit(bad, name, lambda t: t.pop(name))
    rep = expq.verify(bad, device="cpu", tokens=8)
    assert not rep.ok
    msg = " ".join(rep.problems)
    assert name in msg and "model.safetensors.index.json" in msg
    assert "layer 0 expert 1 up" in msg
    code, _ = run("verify", bad, "--device", "cpu")
    assert code == 1


def test_wrong_index_entry_fails(outputs, tmp_path):
    src, out = outputs("llama4_text")
    bad = corrupt_copy(out, tmp_path)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.3.feed_forward.experts.0.gate_proj.weight_packed"
    files = sorted(set(idx["weight_map"].values()))
    idx["weight_map"][name] = next(f for f in files if f != idx["weight_map"][name])
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = expq.verify(bad, device="cpu", tokens=8)
    assert not rep.ok and any(name in p and "not there" in p for p in rep.problems), rep.problems


def test_stray_shard_fails(outputs, tmp_path):
    src, out = outputs("mixtral")
    bad = corrupt_copy(out, tmp_path)
    shutil.copy(next(bad.glob("model-00001-*.safetensors")), bad / "model-00001-of-00099.safetensors")
    rep = expq.verify(bad, device="cpu", tokens=8)
    assert not rep.ok and any("model-00001-of-00099.safetensors" in p and "not part of" in p for p in rep.problems)


def test_bad_quantization_config_fails(outputs, tmp_path):
    src, out = outputs("mixtral")
    bad = corrupt_copy(out, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear"]
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (bad / "config.json").write_text(json.dumps(cfg))
    rep = expq.verify(bad, device="cpu", tokens=8)
    assert not rep.ok and any("targets match" in p and "not quantized" in p for p in rep.problems)


def test_passthrough_change_fails_with_source(outputs, tmp_path):
    src, out = outputs("dbrx")
    bad = corrupt_copy(out, tmp_path)
    name = "transformer.blocks.1.ffn.router.layer.weight"
    edit(bad, name, lambda t: t[name].view(-1)[0].add_(1.0))
    rep = expq.verify(bad, source=src, device="cpu", tokens=8)
    assert not rep.ok and any(name in p and "bytes differ" in p for p in rep.problems)


def test_unreadable_and_usage(tmp_path, outputs):
    code, text = run("verify", tmp_path / "nothing", "--device", "cpu")
    assert code == 2 and "config.json" in text
    src, out = outputs("mixtral")
    code, text = run("verify", src, "--device", "cpu")  # an unconverted checkpoint
    assert code == 2 and "quantization_config" in text
    code, text = run("verify", out, "--tokens", "0")
    assert code == 2


def checks_by_name(rep) -> dict:
    return {c.name: c for c in rep.checks}


def test_each_check_reports_its_own_result_and_detail(outputs, tmp_path):
    """Expert 2's gate replaced by expert 3's, in one layer: valid codes and scales, so the structure check passes
    and the kernel matches its fp32 reference (on the weights as they are); the bits, the row error and the source
    comparison fail, each with its own line."""
    src, out = outputs("mixtral")
    bad = corrupt_copy(out, tmp_path)
    a, b = "model.layers.1.block_sparse_moe.experts.2.w1", "model.layers.1.block_sparse_moe.experts.3.w1"

    def swap(t):
        for suffix in (".weight_packed", ".weight_scale"):
            t[a + suffix] = t[b + suffix].clone()

    assert json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][a + ".weight_packed"] == \
        json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][b + ".weight_packed"]
    edit(bad, a + ".weight_packed", swap)
    rep = expq.verify(bad, source=src, device="cpu", tokens=16)
    ch = checks_by_name(rep)
    codes, bits = ch["experts: codes and scales"], ch["experts: bits equal re-quantized source"]
    rows = ch["experts: row error within half a step (+ w/scale rounding)"]
    kernel = ch["kernel (torch) vs fp32 reference"]
    assert codes.ok and codes.detail.startswith("2 layers x 4 experts: codes in [-127, 127]"), codes
    assert not bits.ok and bits.detail.startswith(f"layer 1 expert 2 gate ({a}):"), bits
    assert "codes and" in bits.detail and "scales differ" in bits.detail and bits.detail in rep.problems
    assert not rows.ok and rows.detail.startswith("layer 1: a row's dequantization error is"), rows
    assert kernel.ok and kernel.detail.startswith("worst layer"), kernel
    source = ch["kernel vs source experts"]
    assert source.ok == (rep.layers[1].source_rel_err <= SOURCE_REL_TOL)
    assert source.detail.startswith("layer 1: kernel output differs from the source experts" if not source.ok
                                    else "worst layer"), source
    code, text = run("verify", bad, "--device", "cpu", "--source", src, "--tokens", "16")
    rows_printed = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in text.splitlines() if "\t" in ln}
    assert rows_printed["experts: codes and scales"][0] == "pass"
    assert rows_printed["experts: bits equal re-quantized source"][:2] == ["FAIL", bits.detail]
    assert rows_printed["kernel (torch) vs fp32 reference"][0] == "pass"


def test_a_weakened_row_fails_the_codes_check_not_the_kernel_check(outputs, tmp_path):
    """One row's codes halved without a source: the codes check fails on that row; the kernel, which runs the weights
    as they are, passes."""
    src, out = outputs("mixtral")
    bad = corrupt_copy(out, tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight_packed"

    def halve_row(t):
        codes = t[name][5].view(torch.uint8).to(torch.int16) - 128  # row 5's words as bytes: code + 128 each
        t[name][5] = (torch.div(codes, 2, rounding_mode="trunc") + 128).to(torch.uint8).view(torch.int32)

    edit(bad, name, halve_row)
    rep = expq.verify(bad, device="cpu", tokens=16)
    ch = checks_by_name(rep)
    codes, kernel = ch["experts: codes and scales"], ch["kernel (torch) vs fp32 reference"]
    assert not codes.ok and codes.detail.startswith("layer 0 expert 1 down row 5 "), codes
    assert "largest code is 63 " in codes.detail, codes
    assert kernel.ok, kernel
    assert not rep.ok and codes.detail in rep.problems
    assert ch["files match expq.json (size, sha256)"].detail.startswith("file model-")  # and the hash sees it

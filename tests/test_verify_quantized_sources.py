"""verify --source against a quantized source decodes it the same way convert did: a conversion of an FP8-block,
MXFP4 or compressed-tensors INT4 source passes bit for bit, and one changed code fails naming the expert."""

from __future__ import annotations

import json
import shutil

import pytest
from ct_fixture import make_ct_int4_source
from fp8_fixture import make_fp8_deepseek
from helpers import example
from mxfp4_fixture import FIXTURE_OVERRIDES, make_mxfp4_gpt_oss
from safetensors.torch import load_file, save_file

import expq

SOURCES = {
    "fp8-block": lambda f, d: make_fp8_deepseek(example(f, "deepseek_v3"), d, block=(32, 32))[0],
    "mxfp4": lambda f, d: make_mxfp4_gpt_oss(example(f, "gpt_oss", **FIXTURE_OVERRIDES), d)[0],
    "compressed-tensors": lambda f, d: make_ct_int4_source(example(f, "qwen3_moe"), d)[0],
}


@pytest.mark.parametrize("fmt", list(SOURCES))
def test_verify_source_decodes_the_quantized_source(fmt, tmp_path, tmp_path_factory):
    src = SOURCES[fmt](tmp_path_factory, tmp_path / "made")
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", max_shard_size="40KB", format="compressed-tensors",
                 allow_random_experts_in_transformers=True)  # the mxfp4 source is gpt_oss
    assert json.loads((out / "expq.json").read_text())["decoded"]["source_format"] == fmt
    rep = expq.verify(out, source=src, device="cpu", tokens=8)
    assert rep.ok, rep.problems
    assert all(r.codes_differ == 0 and r.scales_differ == 0 for r in rep.layers)
    # negative control: one code of one routed expert changed by one step
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in sorted(idx) if n.endswith("experts.1.down_proj.weight_packed")
                or n.endswith("experts.1.w2.weight_packed"))
    t = load_file(bad / idx[name])
    t[name].view(-1)[3] += 1  # the lowest byte: code + 1
    save_file(t, bad / idx[name], metadata={"format": "pt"})
    rep = expq.verify(bad, source=src, device="cpu", tokens=8)
    assert not rep.ok and any("expert 1 down" in p and "codes" in p for p in rep.problems), rep.problems

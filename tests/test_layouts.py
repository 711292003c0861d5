"""What a hostile new-user pass found in the redesign and the decoders, each fixed and pinned here: NaN in a
decoded non-expert tensor, layout templates and names the schema could not see, quantized tensors with no
quantization_config, and a quantization_config that is not an object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fp8_fixture import make_fp8_deepseek
from helpers import edit_shard_tensors, example

import expq
from expq.errors import LayoutError, NonFiniteError, SourceError
from expq.layouts import parse_layout

MIXTRAL = Path("configs/mixtral.toml").read_text()


def test_nan_in_a_decoded_non_expert_tensor_is_refused(tmp_path, tmp_path_factory):
    fp8, _ = make_fp8_deepseek(example(tmp_path_factory, "deepseek_v3"), tmp_path / "made", block=(32, 32))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    edit_shard_tensors(fp8, name, lambda t: t[name].view(-1)[:1].fill_(float("nan")))
    with pytest.raises(NonFiniteError, match=r"decodes to \d+ NaN/infinite values \(from .*o_proj.weight_scale_inv") \
            as ei:
        expq.convert(fp8, tmp_path / "out", device="cpu")
    assert ei.value.tensor == "model.layers.1.self_attn.o_proj.weight" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,match", [
    ('[output]\nmodule = "block_sparse_moe.experts.{expert}.{bogus}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts.{0}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts.{expert"\n', "output.module .* is not a valid template"),
    ('[output]\nmodule = "x.{expert}.{expert}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nup = "w1"\n', "output.gate/up/down must be three different names"),
])
def test_layout_templates_and_names_are_checked(edit, match):
    with pytest.raises(LayoutError, match=match) as ei:
        parse_layout(MIXTRAL + "\n" + edit, "mine.toml")
    assert ei.value.file == "mine.toml"


def test_layout_duplicate_source_names_are_checked():
    with pytest.raises(LayoutError, match="experts.gate/up/down must be three different names"):
        parse_layout(MIXTRAL.replace('up = "w3"', 'up = "w1"'), "mine.toml")


def test_fp8_tensors_without_a_quantization_config(tmp_path, tmp_path_factory):
    fp8, _ = make_fp8_deepseek(example(tmp_path_factory, "deepseek_v3"), tmp_path / "made", block=(32, 32))
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="stored as F8_E4M3 but config.json has no quantization_config"):
        expq.inspect(fp8)
    cfg["quantization_config"] = "fp8"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="quantization_config must be a JSON object, got str"):
        expq.inspect(fp8)

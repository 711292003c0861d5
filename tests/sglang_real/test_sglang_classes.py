"""expq's compressed-tensors output inside the real SGLang (the version of this virtualenv), on a CPU: SGLang's own
``FusedMoE`` layer built with the checkpoint's ``quantization_config`` picks its compressed-tensors WNA16 MoE scheme
(Marlin, ``fused_marlin_moe``: what expq's client table promises for SiLU families), and the checkpoint's packed
codes, scales and shapes loaded by SGLang's own ``weight_loader`` equal the checkpoint bit for bit."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file

import expq
from expq.engines.clients import TESTED, sglang
from expq.examples import build_example
from expq.layouts import builtin_layout

FAMILIES = ["mixtral", "qwen3_moe"]
WIDTH = {"hidden_size": 256, "intermediate_size": 128}  # Marlin: hidden % 128, intermediate per rank % 64
SHARD = {"gate": "w1", "up": "w3", "down": "w2"}
NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


@pytest.fixture(scope="module")
def runtime():
    """SGLang's runtime context for one process: a default ServerArgs and a one-rank MoE topology."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt import runtime_context as rc
    override = rc._CONTEXT.override_server_args()
    override.install()
    rc.get_parallel().override_permanently(moe_ep_rank=0, moe_tp_rank=0, moe_ep_size=1, moe_tp_size=1)
    yield rc
    rc.get_parallel().clear_stamp()
    override.restore()


def convert(tmp_path, family):
    over = dict(WIDTH, **({"moe_intermediate_size": 128} if family == "qwen3_moe" else {}))
    src = build_example(family, tmp_path / "src", **over)
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", format="compressed-tensors")
    return out


def test_tested_version_is_this_one():
    import sglang

    assert sglang.__version__ == TESTED["SGLang"]


@pytest.mark.parametrize("family", FAMILIES)
def test_marlin_scheme_and_bit_exact_loading(family, runtime, tmp_path):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    out = convert(tmp_path, family)
    config = json.loads((out / "config.json").read_text())
    assert sglang(builtin_layout(family), config["hidden_size"]).loads
    qc = CompressedTensorsConfig.from_config(config["quantization_config"])
    E = config.get("num_local_experts") or config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    layer = FusedMoE(num_experts=E, hidden_size=config["hidden_size"], intermediate_size=inter, layer_id=0,
                     top_k=config["num_experts_per_tok"], params_dtype=torch.bfloat16, quant_config=qc,
                     prefix="model.layers.0.mlp.experts")
    scheme = layer.scheme
    assert type(scheme).__name__ == "CompressedTensorsWNA16MoE"  # SGLang logs it as its Marlin MoE method
    assert (scheme.num_bits, str(scheme.strategy.value if hasattr(scheme.strategy, "value") else scheme.strategy),
            scheme.sym) == (8, "channel", True)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    pat = re.compile(r"layers\.0\..*experts\.(\d+)\.(\w+)\.(weight_packed|weight_scale|weight_shape)$")
    by = {}
    for n, t in tensors.items():
        if (m := pat.search(n)) and m[2] in NAMES:
            e, proj, suffix = int(m[1]), NAMES[m[2]], m[3]
            param = getattr(layer, f"{'w2' if proj == 'down' else 'w13'}_{suffix}")
            layer.weight_loader(param, t.clone(), n, SHARD[proj], e)
            by[(e, proj, suffix)] = t
    assert len(by) == E * 9
    for e in range(E):
        for suffix in ("weight_packed", "weight_scale"):
            for w, parts in (("w13", ("gate", "up")), ("w2", ("down",))):
                param = getattr(layer, f"{w}_{suffix}")
                got = param.data[e]
                if getattr(param, "is_transposed", False):
                    got = got.transpose(0, 1)
                want = torch.cat([by[(e, p, suffix)] for p in parts])
                assert torch.equal(got.reshape(want.shape), want.to(got.dtype)), (family, e, w, suffix)

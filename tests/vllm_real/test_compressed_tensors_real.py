"""expq's compressed-tensors output inside the real vLLM (the version of this virtualenv): the MoE method and
backend vLLM's oracle picks on each GPU class (probes forced to SM80, SM90, SM100), with and without
``--moe-backend marlin``, against what expq tells users (``expq.engines.clients.vllm_ct_commands``); and the
checkpoint's packed codes, scales and shapes loaded by vLLM's own weight_loader, compared bit for bit."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import expq
from expq.examples import build_example

from expq.engines.clients import vllm_needs_marlin_flag

FAMILIES = ["mixtral", "qwen3_moe"]
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
# Marlin wants the hidden size a multiple of 128 and the intermediate size per rank a multiple of 64
WIDTH = {"hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 128}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    done = {}

    def get(family):
        if family not in done:
            root = tmp_path_factory.mktemp(f"vllm-real-ct-{family}")
            over = {k: v for k, v in WIDTH.items() if k != "moe_intermediate_size" or family == "qwen3_moe"}
            src = build_example(family, root / "src", **over)
            expq.convert(src, root / "out", device="cpu", format="compressed-tensors")
            done[family] = (src, root / "out")
        return done[family]

    return get


def build(h, out, sm, backend, tag):
    config = json.loads((out / "config.json").read_text())
    h.set_moe_backend(backend)
    try:
        return h.moe_layer(config, h.quant_config_of(out), f"{out.parent.name}.{tag}.layers.0.mlp.experts", sm=sm)
    finally:
        h.set_moe_backend("auto")


@pytest.mark.parametrize("backend", ["auto", "marlin"])
@pytest.mark.parametrize("sm", [80, 90, 100])
def test_method_per_gpu_class(sm, backend, converted, vllm_started):
    h = vllm_started
    _, out = converted("mixtral")
    version = ".".join(map(str, h.VERSION))
    if backend == "auto" and vllm_needs_marlin_flag(version, sm):
        with pytest.raises(AssertionError) as ei:  # Humming ranked above Marlin; the method wants strategy group
            build(h, out, sm, backend, f"sm{sm}-{backend}")
        assert any('strategy == "group"' in str(t.statement) for t in ei.traceback)
        return
    m = build(h, out, sm, backend, f"sm{sm}-{backend}").quant_method
    backend_of = getattr(getattr(m, "wna16_backend", None), "name", "MARLIN")
    # vLLM 0.24-0.26: a Marlin method class of its own; later: the WNA16 method on the MARLIN backend
    assert type(m).__name__ in ("CompressedTensorsWNA16MarlinMoEMethod", "CompressedTensorsWNA16MoEMethod")
    assert backend_of == "MARLIN"


def _per_expert(param: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e`` of a loaded parameter in the checkpoint's [out, ...] orientation."""
    t = param.data[e]
    return t.transpose(0, 1) if getattr(param, "is_transposed", False) and t.dim() == 2 else t


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_tensors_load_bit_for_bit(family, converted, vllm_started):
    h = vllm_started
    _, out = converted(family)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = json.loads((out / "config.json").read_text())
    L = next(int(m[1]) for n in tensors if (m := re.search(r"layers\.(\d+)\..*experts\.\d+\.", n)))
    layer = build(h, out, 80, "auto", f"load-{family}")
    pat = re.compile(rf"layers\.{L}\..*experts\.(\d+)\.(\w+)\.({'|'.join(SUFFIXES)})$")
    names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
    by = {}
    for n, t in tensors.items():
        if (m := pat.search(n)) and m[2] in names:
            e, proj, suffix = int(m[1]), names[m[2]], m[3]
            h.load_expert(layer, f"{'w2' if proj == 'down' else 'w13'}_{suffix}", t.clone(), n, proj, e)
            by[(e, proj, suffix)] = t
    E = config.get("num_local_experts") or config.get("num_experts")
    assert len(by) == E * 3 * len(SUFFIXES)
    for e in range(E):
        for suffix in ("weight_packed", "weight_scale"):
            w13 = _per_expert(getattr(layer, f"w13_{suffix}"), e)
            w2 = _per_expert(getattr(layer, f"w2_{suffix}"), e)
            want13 = torch.cat([by[(e, "gate", suffix)], by[(e, "up", suffix)]])
            assert torch.equal(w13.reshape(want13.shape), want13.to(w13.dtype)), (e, suffix)
            assert torch.equal(w2.reshape(by[(e, "down", suffix)].shape), by[(e, "down", suffix)].to(w2.dtype))

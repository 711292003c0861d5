"""The expq plugin inside the real vLLM (the version of this virtualenv): vLLM's own MoE layers built with the
checkpoint's quantization config, the checkpoint's tensors routed into them by the plugin's loader wrapper,
``process_weights_after_loading`` run, and every parameter compared bit for bit with the checkpoint and with what
``--quantization experts_int8`` holds after vLLM's own loader and ``_quantize_weights`` ran on the bf16 source."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import converted_factory, load_hf, model_expert_matrices

from expq.checkpoint import ConvertedCheckpoint
from expq.engines import vllm as plugin

FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]
ONLINE = {"mixtral", "qwen3_moe"}  # gpt_oss: its model loader interleaves gate/up itself (see the stand-in tests)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_factory(tmp_path_factory, "vllm-real", format="experts-int8")


def plugin_model(h, out):
    """The checkpoint's vLLM MoE layers (``vllm_harness.plugin_model``), their config the plugin's own."""
    root, layers, ck = h.plugin_model(out)
    assert type(h.quant_config_of(out)) is plugin.ExpqExpertsInt8Config
    return root, layers, ck


def checkpoint_stream(root):
    import vllm_harness

    return vllm_harness.checkpoint_stream(root)


@pytest.mark.parametrize("family", FAMILIES)
def test_plugin_layers_equal_checkpoint_and_online(family, converted, vllm_started):
    h = vllm_started
    src, out = converted(family)
    model, layers, ck = plugin_model(h, out)
    for layer in layers.values():
        assert type(layer.quant_method) is plugin.ExpqInt8MoEMethod
    model_config = SimpleNamespace(model=str(out), dtype=torch.bfloat16, revision=None)
    passed = [n for n, _ in plugin.routed_weights(checkpoint_stream(out), model_config, model)]
    assert sorted(passed) == sorted(n for n in ck.tensors if ck.format.classify(n) is None)
    for L, layer in layers.items():
        layer.quant_method.process_weights_after_loading(layer)
        lx = ck.layer_experts(L)
        got = {n: p.data for n, p in layer.named_parameters() if not n.endswith("_bias")}
        assert sorted(got) == ["w13_scale", "w13_weight", "w2_scale", "w2_weight"]
        I = lx.w2.shape[2]
        w13, s13 = got["w13_weight"], got["w13_scale"]
        if family == "gpt_oss":  # swigluoai: vLLM's layout interleaves gate (even rows) and up (odd rows)
            w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
            s13 = torch.cat([s13[:, 0::2], s13[:, 1::2]], dim=1)
        assert torch.equal(w13, lx.w13) and torch.equal(s13, lx.w13_scale)
        assert torch.equal(got["w2_weight"], lx.w2) and torch.equal(got["w2_scale"], lx.w2_scale)
        assert lx.w13.shape[1] == 2 * I
    if family in ONLINE:
        _equal_online(h, family, src, out, layers)


def _equal_online(h, family, src, out, layers):
    """The same layers built for --quantization experts_int8, the bf16 source's experts loaded by vLLM's own
    weight_loader: vLLM's online processing quantizes them; every parameter must equal the plugin's."""
    config = json.loads((out / "config.json").read_text())
    mats = model_expert_matrices(family, load_hf(src, dtype=torch.bfloat16))
    for L, mine in layers.items():
        online = h.moe_layer(config, h.online_config(), f"{out.parent.name}.online.model.layers.{L}.mlp.experts")
        E = online.global_num_experts
        for e in range(E):
            for proj in ("gate", "up", "down"):
                name = "w2_weight" if proj == "down" else "w13_weight"
                h.load_expert(online, name, mats[(L, e, proj)].clone(), f"experts.{e}.{proj}.weight", proj, e)
        if not getattr(online, "_already_called_process_weights_after_loading", False):
            online.quant_method.process_weights_after_loading(online)
        theirs = {n: p.data for n, p in online.named_parameters()}
        ours = {n: p.data for n, p in mine.named_parameters()}
        assert sorted(theirs) == sorted(ours)
        for n in ours:
            assert theirs[n].dtype == ours[n].dtype and theirs[n].shape == ours[n].shape, n
            assert torch.equal(theirs[n], ours[n]), (L, n)


def test_tensor_parallel_two_ranks(converted):
    """TP=2 with two real processes in a gloo group: each rank's plugin layer holds its slice of the checkpoint
    (w13 rows, w2 columns, full-row w2 scales), and equals the online layer's on every parameter from vLLM 0.28 on,
    which all-reduces the w2 row maximum across ranks; vLLM 0.24-0.27 take each rank's slice maximum, so there the
    w2 scales and codes may differ (expq stores the full-row ones)."""
    import subprocess
    import sys
    from pathlib import Path

    import vllm_harness as h

    src, out = converted("mixtral")
    port = h.free_port()
    script = Path(__file__).with_name("tp_rank.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(port), str(src), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("REPORT "))[7:]))
    assert [r["tp_rank"] for r in reports] == [0, 1]
    w2_all_reduced = h.VERSION >= (0, 28)
    for r in reports:
        for L, params in r["layers"].items():
            assert sorted(params) == ["w13_scale", "w13_weight", "w2_scale", "w2_weight"]
            assert all(v["checkpoint"] for v in params.values()), (r["rank"], L, params)
            assert params["w13_weight"]["online"] and params["w13_scale"]["online"], (r["rank"], L)
            if w2_all_reduced:
                assert params["w2_weight"]["online"] and params["w2_scale"]["online"], (r["rank"], L)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_ep_weight_filter_keeps_every_plugin_tensor(placement, converted, vllm_started):
    """vLLM's EP weight filter (``--enable-ep-weight-filter``) drops a non-local expert's ``.weight`` /
    ``.weight_packed`` before reading it. The experts-int8 tensors are named ``.weight_int8`` / ``.weight_scale``,
    so every one reaches the plugin, which keeps this rank's experts by the layer's own expert map; the same filter
    does drop the same experts' bf16 ``.weight`` tensors (the control)."""
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids, should_skip_weight

    _, out = converted("mixtral")
    ck = ConvertedCheckpoint(out)
    local = compute_local_expert_ids(ck.num_experts, 2, 1, placement=placement)
    assert local and len(local) < ck.num_experts
    assert not [n for n in ck.tensors if should_skip_weight(n, local)]
    dropped = [f"{ck.experts.module_name(ck.moe_layers[0], e, 'gate')}.weight" for e in range(ck.num_experts)]
    assert sum(should_skip_weight(n, local) for n in dropped) == ck.num_experts - len(local)

"""EXPQ_VLLM_KERNEL inside the real vLLM (the version of this virtualenv; CPU, Triton's interpreter): vLLM's own MoE
layers built with an experts-int8 checkpoint's quantization config and filled by the plugin's loader; after
``process_weights_after_loading`` the method's ``apply`` (called as vLLM's runner calls it) runs expq's kernel,
whose output matches the fp32 reference on the checkpoint's experts (gpt_oss: swigluoai, w13 rows re-laid from
vLLM's interleaved order); unset, the layer keeps vLLM's kernel. Needs the harness of tests/vllm_real (skipped
where vLLM or the harness is missing)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
h = pytest.importorskip("vllm_harness")

from helpers import converted_factory  # noqa: E402

from expq.engines import vllm as plugin  # noqa: E402
from expq.engines import vllm_kernel  # noqa: E402
from expq.kernels import moe_reference, tuned  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_factory(tmp_path_factory, "vllm-real-kernel", format="experts-int8")


def loaded_layers(out, tag):
    """vLLM MoE layers (fp16: the interpreter's bf16 is wrong) for every MoE layer of ``out``, filled by the
    plugin's routing and processed (``tag``: a unique part of their names: vLLM refuses a layer name twice)."""
    config = json.loads((out / "config.json").read_text())
    root, layers, ck = h.plugin_model(out, tag=tag, params_dtype=torch.float16)
    model_config = SimpleNamespace(model=str(out), dtype=torch.float16, revision=None)
    list(plugin.routed_weights(h.checkpoint_stream(out), model_config, root))
    for layer in layers.values():
        with h.gpu(90):
            layer.quant_method.process_weights_after_loading(layer)
    return layers, ck, config


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_expq_kernel_in_vllms_layer(family, converted, vllm_started, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(vllm_kernel.ENV, "expq")
    _, out = converted(family)
    layers, ck, config = loaded_layers(out, "expq")
    for L, layer in layers.items():
        method = layer.quant_method
        assert type(method.moe_kernel.prepare_finalize).__name__ == "MoEPrepareAndFinalizeNoDPEPModular"
        assert vllm_kernel.why_not(method, layer) is None and method.expq_experts is not None
        lx = ck.layer_experts(L)
        assert torch.equal(layer.w13_weight, lx.w13) and torch.equal(layer.w13_scale, lx.w13_scale)
        g = torch.Generator().manual_seed(L)
        x = torch.randn(7, lx.w13.shape[2], generator=g).half()
        tw, ti = torch.topk(torch.randn(7, lx.w13.shape[0], generator=g).softmax(-1), config["num_experts_per_tok"])
        ti = ti.to(torch.int32)
        got = method.apply(layer=layer, x=x, topk_weights=tw, topk_ids=ti, shared_experts=None,
                           shared_experts_input=None)
        bias = {k: getattr(layer, k) for k in ("w13_bias", "w2_bias") if getattr(layer, k, None) is not None}
        ref = moe_reference(x, lx.w13, lx.w2, lx.w13_scale, lx.w2_scale, tw, ti,
                            activation=layer.activation.value, **bias)
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert got.dtype == torch.float16 and rel < 8 * 2.0**-11, (L, rel)


def test_default_keeps_vllms_kernel(converted, vllm_started, monkeypatch):
    monkeypatch.delenv(vllm_kernel.ENV, raising=False)
    _, out = converted("mixtral")
    layers, _, _ = loaded_layers(out, "default")
    assert all(layer.quant_method.expq_experts is None for layer in layers.values())


def test_plugin_lines_go_to_vllms_log(capsys):
    """vLLM's own default logging (applied by vLLM's own function, its stream this test's captured stdout) prints the plugin's INFO
    lines as its own."""
    import logging

    import vllm.logger

    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate, logging.getLogRecordFactory()
    try:
        vllm.logger._configure_vllm_root_logger()  # what vLLM runs (0.24: at import; 0.30+: per engine process)
        logging.getLogger(plugin.LOGGER).info("a line of expq's plugin")
        logging.getLogger(tuned.LOGGER).warning("a line of expq's kernel")  # the tuned-table warning's logger
        logging.getLogger("expq.elsewhere").info("a line outside vLLM's tree")  # negative control: dropped
    finally:
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved[:3]
        logging.setLogRecordFactory(saved[3])
    out = capsys.readouterr()
    assert "a line of expq's plugin" in out.out and "INFO" in out.out
    assert "a line of expq's kernel" in out.out and "WARNING" in out.out
    assert "outside vLLM's tree" not in out.out + out.err

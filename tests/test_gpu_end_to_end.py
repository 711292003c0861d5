"""On CUDA (device tool; skipped without a GPU): verify runs the Triton kernel, load_model runs bf16 on the GPU with
int8 experts, and both agree with the references."""

from __future__ import annotations

import pytest
import torch
from helpers import converted_factory, dequantized_reference, rel
from test_runtime import LOGIT_REL_TOL

import expq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "llama4_text", "gpt_oss", "dbrx", "granitemoe"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return converted_factory(tmp_path_factory, "gpu", device="cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_on_gpu_runs_triton(family, outputs):
    src, out = outputs(family)
    rep = expq.verify(out, source=src, device="cuda", tokens=64)
    assert rep.ok, rep.problems
    assert rep.backend == "triton" and rep.device.startswith("cuda") and rep.activation_dtype == "bfloat16"
    assert all(r.experts_exercised == r.experts for r in rep.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_bf16_on_gpu(family, outputs):
    src, out = outputs(family)
    model = expq.load_model(out, device="cuda")
    mods = [m for m in model.modules() if getattr(m, "expq_int8", False)]
    assert mods and all(m.w13_weight.is_cuda and m.w13_weight.dtype == torch.int8 for m in mods)
    ref = dequantized_reference(family, src, out).cuda()
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert a.dtype == torch.bfloat16
    assert rel(a, b) < LOGIT_REL_TOL, rel(a, b)
    with torch.no_grad():
        g = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=1)
    assert g.shape == (1, 16)


def test_verify_negative_control_on_gpu(outputs, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = outputs("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    idx = json.loads((bad / "model.safetensors.index.json").read_text()) if (
        bad / "model.safetensors.index.json").exists() else None
    name = "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale"
    f = bad / (idx["weight_map"][name] if idx else "model.safetensors")
    t = load_file(f)
    t[name] = t[name] * 2
    save_file(t, f, metadata={"format": "pt"})
    rep = expq.verify(bad, source=src, device="cuda", tokens=64)
    assert not rep.ok and any("layer 0 expert 1 up" in p for p in rep.problems)


def test_up_to_date_convert_on_gpu_exits_cleanly(outputs, tmp_path):
    """A conversion that finds OUT up to date returns within a second, while CUDA is still starting in the
    warm-up thread: the process must wait for it and exit 0, not abort in the CUDA runtime ("terminate called
    without an active exception", seen on the H200 in bench/vllm_compare.py's second prepare)."""
    from helpers import run_cli

    src, _ = outputs("mixtral")
    out = tmp_path / "out"
    for attempt in range(2):
        code, text = run_cli("convert", src, out, "--device", "cuda", "--format", "experts-int8")
        assert code == 0, (attempt, text[-2000:])
        assert "terminate called" not in text
    assert "up to date" in text

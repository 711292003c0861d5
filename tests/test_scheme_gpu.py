"""On CUDA (run through the device tool; skipped without a GPU): expq's arithmetic equals vLLM's function run on
CUDA, bit for bit, on the CPU and on the GPU; a conversion on the GPU equals one on the CPU byte for byte."""

from __future__ import annotations

import pytest
import torch
from helpers import example, seed_reference, tree_digest
from test_scheme import adversarial_rows, random_rows

import expq
from expq import scheme

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_cpu_and_cuda_equal_seed_on_cuda(dtype, kind):
    if kind == "random":
        w = torch.cat([random_rows(dtype, rows=8192, cols=2048, seed=s) for s in range(4)])  # 67M elements
    else:
        w = adversarial_rows(dtype)
    ref_codes, ref_scales = seed_reference(w.cuda())  # the literal function, on CUDA: the target
    ref_codes, ref_scales = ref_codes.cpu(), ref_scales.cpu()
    for dev in ("cpu", "cuda"):
        codes, scales = scheme.quantize_rows(w.to(dev))
        assert torch.equal(codes.cpu(), ref_codes), f"{dev} {dtype}: {(codes.cpu() != ref_codes).sum()} codes differ"
        assert torch.equal(scales.cpu(), ref_scales), f"{dev} {dtype}: {(scales.cpu() != ref_scales).sum()} scales"


def test_cuda_scalar_division_is_a_multiplication():
    """The fact the fp32 rule rests on: CUDA's `x / 127` equals `x * fp32(1/127)`, the CPU's does not always."""
    w = random_rows(torch.float32, rows=65536, cols=8).abs().amax(dim=1)
    inv = torch.tensor(1.0) / torch.tensor(127.0)
    on_cuda = (w.cuda() / 127).cpu()
    assert torch.equal(on_cuda, w * inv)
    assert not torch.equal(w / 127, w * inv)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "dbrx"])
def test_convert_on_gpu_equals_cpu(family, tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, family)
    expq.convert(src, tmp_path / "cpu", device="cpu", max_shard_size="40KB")
    expq.convert(src, tmp_path / "gpu", device="cuda", max_shard_size="40KB")
    assert tree_digest(tmp_path / "cpu") == tree_digest(tmp_path / "gpu")
    if torch.cuda.device_count() > 1:
        devs = ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
        expq.convert(src, tmp_path / "multi", device=devs, max_shard_size="40KB")
        assert tree_digest(tmp_path / "cpu") == tree_digest(tmp_path / "multi")

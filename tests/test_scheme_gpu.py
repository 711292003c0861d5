"""On CUDA (run through the device tool; skipped without a GPU): expq's arithmetic equals vLLM's function run on
CUDA, bit for bit, on the CPU and on the GPU; a conversion on the GPU equals one on the CPU byte for byte."""

from __future__ import annotations

import pytest
import torch
from helpers import example, seed_reference, tree_digest
from test_scheme import adversarial_rows, random_rows, with_special_rows

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
        for fn in (scheme.quantize_rows, lambda x: scheme.quantize_matrix(x)[:2]):  # whole / row blocks on a CPU
            codes, scales = fn(w.to(dev))
            assert torch.equal(codes.cpu(), ref_codes), f"{dev} {dtype}: {(codes.cpu() != ref_codes).sum()} codes"
            assert torch.equal(scales.cpu(), ref_scales), f"{dev} {dtype}: {(scales.cpu() != ref_scales).sum()} scales"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_rows_same_bits_on_cpu_and_cuda(dtype):
    """Zero, -0.0, NaN, +-inf and underflowing rows: codes, scales (NaN canonical) and the row report are the same
    on both devices, so an --allow-nonfinite conversion does not depend on the device either."""
    w = with_special_rows(random_rows(dtype, rows=64, cols=96, low=-8))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    (c0, s0, r0), (c1, s1, r1) = (scheme.quantize_matrix(w.to(d)) for d in ("cpu", "cuda"))
    assert torch.equal(c0, c1.cpu()) and torch.equal(s0.view(bits), s1.cpu().view(bits)) and r0 == r1


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
    from expq.pipeline import run_plan
    from expq.plan import make_plan
    from expq.source import open_source
    from expq.output.outdir import OutputDir
    from expq.output.shards import ShardSet

    for devs in ([torch.device("cuda:0"), torch.device("cpu")], [torch.device("cuda:0")] * 2):
        plan = make_plan(open_source(src), max_shard_size="40KB")  # mixed devices; two pipelines on one GPU
        outdir = OutputDir(tmp_path / "mixed", fingerprint={"test": str(devs)}, src_root=src)
        outdir.start()
        shards = ShardSet(plan, outdir)
        stats = run_plan(plan, shards, devs)
        assert sum(stats.jobs_by_device.values()) == len(plan.jobs)
        for name in plan.shard_names:
            assert (outdir.staging / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes(), (devs, name)
        outdir.discard()
    if torch.cuda.device_count() > 1:
        devs = ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
        expq.convert(src, tmp_path / "multi", device=devs, max_shard_size="40KB")
        assert tree_digest(tmp_path / "cpu") == tree_digest(tmp_path / "multi")


@pytest.mark.parametrize("batch_elems", [1, 1 << 40])  # a batch per slice; one batch per unit
@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoe"])  # per-expert tensors; stacked ones, by slices
def test_front_pass_batches_on_gpu_equal_cpu(family, batch_elems, tmp_path, tmp_path_factory, monkeypatch):
    """experts-int8 on the GPU: the front pass computes the scales of small slices over its own pool, many at a
    time (``front_pass.FRONT_BATCH_ELEMS``), and writes them in order: the shards equal the CPU's byte for byte."""
    from expq import front_pass

    src = example(tmp_path_factory, family)
    expq.convert(src, tmp_path / "cpu", device="cpu", format="experts-int8", max_shard_size="40KB")
    monkeypatch.setattr(front_pass, "FRONT_BATCH_ELEMS", batch_elems)
    batches = []
    real = front_pass.FrontPass._run_batch
    monkeypatch.setattr(front_pass.FrontPass, "_run_batch", lambda self: (batches.append(len(self._batch)),
                                                                          real(self))[1])
    expq.convert(src, tmp_path / "gpu", device="cuda", format="experts-int8", max_shard_size="40KB")
    assert tree_digest(tmp_path / "cpu") == tree_digest(tmp_path / "gpu")
    # the batched path ran; a unit of per-expert tensors is many small slices (granitemoe's: one stacked tensor)
    assert max(batches) >= (2 if family == "qwen3_moe" and batch_elems > 1 else 1)

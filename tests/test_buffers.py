"""The host buffer pool of a CPU conversion (``expq.io.buffers``): a buffer is handed out again only once nothing
refers to its bytes, and conversions whose every large tensor comes from a reused, poisoned buffer write the same
bytes (and record the same hashes) as the torch reference path without the pool."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from ct_fixture import make_ct_int4_source
from fp8_fixture import make_fp8_deepseek
from helpers import example, tree_digest
from mxfp4_fixture import FIXTURE_OVERRIDES, make_mxfp4_gpt_oss

import expq
from expq import cpu_kernels
from expq.io import buffers

MB = 1 << 20
POISON = 0xA5


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = buffers.Pool(max_free=64 * MB)
    t = pool.take(3 * MB)
    addr = t.data_ptr()
    view = t[MB:].view(torch.int16)[:10]  # a view of a view
    mv = memoryview(t[:5].numpy())  # bytes handed to a writer or the hasher
    del t
    gc.collect()
    u = pool.take(3 * MB)  # the first buffer is still referred to: a new one
    assert u.data_ptr() != addr and (pool.mapped, pool.reused) == (2, 0)
    del view
    gc.collect()
    w = pool.take(3 * MB)  # the memoryview still holds it
    assert w.data_ptr() != addr and (pool.mapped, pool.reused) == (3, 0)
    del mv
    gc.collect()
    x = pool.take(3 * MB)  # now nothing does
    assert x.data_ptr() == addr and (pool.mapped, pool.reused) == (3, 1)
    del u, w, x


def test_reuse_by_size_poison_and_the_free_allowance():
    pool = buffers.Pool(max_free=8 * MB, poison=POISON)
    a = pool.take(6 * MB)
    a.fill_(1)
    addr = a.data_ptr()
    del a
    small = pool.take(MB)  # far smaller than the free buffer: not given it
    assert small.data_ptr() != addr and pool.reused == 0
    b = pool.take(6 * MB - 5)
    assert b.data_ptr() == addr and pool.reused == 1 and b.numel() == 6 * MB - 5
    assert bool((b == POISON).all())  # poisoned before it was handed out again
    c, d = pool.take(6 * MB), pool.take(6 * MB)
    assert pool.mapped == 4
    del b, c, d, small  # 20 MiB given back, in this order: past the 8 MiB allowance b's and c's are unmapped
    kept = [pool.take(MB), pool.take(6 * MB)]  # small's and d's
    assert (pool.mapped, pool.reused) == (4, 3)
    kept.append(pool.take(6 * MB))
    assert (pool.mapped, pool.reused) == (5, 3)


def test_empty_outside_a_pool_and_for_small_tensors():
    pool = buffers.Pool(max_free=64 * MB)
    t = buffers.empty((4, MB), torch.bfloat16)
    assert t.shape == (4, MB) and t.dtype == torch.bfloat16 and pool.mapped == 0
    with buffers.using(pool):
        small = buffers.empty((16, 16), torch.float32)
        big = buffers.empty((MB, 3), torch.int8)
        assert small.is_contiguous() and pool.mapped == 1
        assert big.shape == (MB, 3) and big.dtype == torch.int8 and big.is_contiguous()
        big.fill_(-3)
        assert int(big.sum()) == -9 * MB


def _sources(tmp_path_factory):
    olmoe = example(tmp_path_factory, "olmoe", num_experts=16)
    return {
        "olmoe-16-experts": (olmoe, "experts-int8"),
        "olmoe-16-experts-ct": (olmoe, "compressed-tensors"),
        "olmoe-fp32": (example(tmp_path_factory, "olmoe", dtype=torch.float32), "experts-int8"),  # cast into the pool
        "gpt_oss": (example(tmp_path_factory, "gpt_oss"), "experts-int8"),  # stacked in_out: copied into the pool
        "fp8-deepseek": (make_fp8_deepseek(example(tmp_path_factory, "deepseek_v3"),
                                           tmp_path_factory.mktemp("fp8"), block=(32, 32))[0], "compressed-tensors"),
        "mxfp4-gpt_oss": (make_mxfp4_gpt_oss(example(tmp_path_factory, "gpt_oss", **FIXTURE_OVERRIDES),
                                             tmp_path_factory.mktemp("mxfp4"))[0], "experts-int8"),
        "ct-int4-qwen3": (make_ct_int4_source(example(tmp_path_factory, "qwen3_moe"),
                                              tmp_path_factory.mktemp("ct"))[0], "experts-int8"),
    }


CASES = ["olmoe-16-experts", "olmoe-16-experts-ct", "olmoe-fp32", "gpt_oss", "fp8-deepseek", "mxfp4-gpt_oss",
         "ct-int4-qwen3"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _sources(tmp_path_factory)


def _convert(src, out, fmt):
    expq.convert(src, out, device="cpu", format=fmt, max_shard_size="40KB", fsync=False,
                 allow_random_experts_in_transformers=True)


@pytest.mark.parametrize("case", CASES)
def test_conversion_through_reused_poisoned_buffers_is_byte_identical(case, sources, tmp_path, monkeypatch):
    """Every tensor the pipeline makes (reads, decodes, casts, codes) comes from the pool (``MIN_BYTES`` 0), every
    reused buffer is poisoned first; the output files and the recorded sha256s equal those of the torch reference
    path without the pool. Were a buffer handed out again before the writer wrote it (or the hasher hashed it from
    memory), the poison or another tensor's bytes would be in a file or a hash."""
    src, fmt = sources[case]
    src_copy = tmp_path / "src"  # a fixed name: expq.json records the source directory's name
    shutil.copytree(src, src_copy)
    with monkeypatch.context() as m:
        m.setenv(cpu_kernels.ENV, "torch")
        m.setattr(buffers, "MIN_BYTES", 1 << 62)  # no pool
        _convert(src_copy, tmp_path / "ref", fmt)
    made, pool_class = [], buffers.Pool

    def poisoned(max_free):
        made.append(pool_class(max_free, poison=POISON))
        return made[-1]

    monkeypatch.setattr(buffers, "Pool", poisoned)
    monkeypatch.setattr(buffers, "MIN_BYTES", 0)
    _convert(src_copy, tmp_path / "out", fmt)
    assert len(made) == 1 and made[0].reused > 0
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "ref")

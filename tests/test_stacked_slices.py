"""A stacked expert tensor is quantized in slices of experts (``plan.Slice``; ``plan.SLICE_BYTES``, set here through
``EXPQ_SLICE_BYTES``): the output is byte for byte the unsliced conversion's (both formats; bf16, MXFP4 and FP8 block
sources; 3-D and flat stacking; output shards cut inside a tensor's matrices), a conversion killed between two slices
of a tensor resumes to the same bytes, row findings (zero, underflowing, NaN/inf: refused or recorded) are the whole
tensor's, and what one job reads, decodes and quantizes at once is bounded by the budget, not by the number of
experts."""

from __future__ import annotations

import functools
import shutil
import signal
import threading

import pytest
import torch
from fp8_fixture import make_fp8_stacked
from helpers import edit_shard_tensors, example, load_json, start_cli, tree_digest
from mxfp4_fixture import FIXTURE_OVERRIDES, make_mxfp4_gpt_oss

import expq
from expq import cpu_kernels, front_pass, pipeline, plan as plan_mod
from expq.decoders import detect
from expq.errors import NonFiniteError
from expq.io.safetensors import read_tensor
from expq.plan import JobKind
from expq.source import open_source

BUDGET = 13000
"""Bytes of rows in the compute dtype a slice (the fixtures' experts, bf16: gpt_oss gate_up 24 KiB and down 12 KiB
an expert, granitemoe 12 KiB and 6 KiB, dbrx 6 KiB a matrix): one to two experts of four a slice."""
SHARD = "40KB"  # output shards that end inside a stacked tensor's matrices
FORMATS = [dict(format="experts-int8"),
           dict(format="compressed-tensors", allow_random_experts_in_transformers=True)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    gpt_oss = example(tmp_path_factory, "gpt_oss", **FIXTURE_OVERRIDES)
    mxfp4, _ = make_mxfp4_gpt_oss(gpt_oss, tmp_path_factory.mktemp("slices-mxfp4"))
    fp8 = make_fp8_stacked(example(tmp_path_factory, "granitemoe"), tmp_path_factory.mktemp("slices-fp8"),
                           (".input_linear.weight", ".output_linear.weight"))
    return {"gpt_oss-bf16": gpt_oss, "gpt_oss-mxfp4": mxfp4, "granitemoe-fp8": fp8,
            "granitemoe-bf16": example(tmp_path_factory, "granitemoe"), "dbrx-bf16": example(tmp_path_factory, "dbrx")}


def quantize_jobs(p):
    return [j for j in p.jobs if j.kind is JobKind.QUANTIZE]


@pytest.mark.parametrize("name", ["gpt_oss-bf16", "gpt_oss-mxfp4", "granitemoe-fp8", "dbrx-bf16"])
def test_slices_cover_each_stacked_tensor_once_within_the_budget(sources, name, monkeypatch):
    src = sources[name]
    monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
    assert all(len(j.slices) == 1 for j in quantize_jobs(expq.inspect(src)))  # the default: whole
    monkeypatch.setenv(plan_mod.SLICE_ENV, str(BUDGET))
    p = expq.inspect(src)
    for j in quantize_jobs(p):
        E = j.expert.stacked_experts
        assert E == 4 and 2 <= len(j.slices) <= 4, (j.tensor.name, len(j.slices))
        assert [(s.first, s.stop) for s in j.slices] == [(a, min(E, a + j.slices[0].stop))
                                                         for a in range(0, E, j.slices[0].stop)]
        assert [m for s in j.slices for m in s.expert.matrices] == list(j.matrices)
        assert [g for s in j.slices for g in j.groups_of(s)] == j.groups
        for s in j.slices:
            rows = sum(m.rows * m.cols for m in s.expert.matrices) * p.compute_dtype.itemsize
            assert rows <= BUDGET or s.stop - s.first == 1
            # each part of a slice is the stored bytes of its experts: the parts' ranges tile the whole tensor's
            assert [q.name for q in s.tensor.parts] == [q.name for q in j.tensor.parts]
        for k, whole in enumerate(j.tensor.parts):
            spans = [(s.tensor.parts[k].start, s.tensor.parts[k].end) for s in j.slices]
            assert spans[0][0] == whole.start and spans[-1][1] == whole.end
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", ["gpt_oss-mxfp4", "granitemoe-fp8"])
def test_a_narrowed_tensor_decodes_to_the_rows_of_the_whole(sources, name, monkeypatch):
    """``Decoder.narrow``: decode and row absmax of a slice are exactly the slice of the whole's."""
    src = open_source(sources[name])
    dec = detect(src.config, src.tensors)
    read = functools.partial(read_tensor, src.root)
    for t in (t for t in dec.logical_tensors(src.tensors).values() if t.decoded and len(t.shape) == 3):
        whole = dec.decode(t, read)
        for a, b in ((0, 1), (1, 3), (3, 4)):
            part = dec.narrow(t, a, b)
            assert part.shape == (b - a, *t.shape[1:]) and part.decoded
            assert torch.equal(dec.decode(part, read).view(torch.int16), whole[a:b].view(torch.int16))
            for dim in (-1, -2):
                amax, got = dec.row_absmax(t, read, dim), dec.row_absmax(part, read, dim)
                assert (amax is None) == (got is None)
                if amax is not None:
                    assert torch.equal(got.view(torch.int16), amax[a:b].view(torch.int16))


def test_fp8_flat_weights_narrow_only_on_block_rows():
    """A flat [E*rows, cols] FP8 weight: a cut inside a block row would need the other experts' rows (None)."""
    from expq.decoders.base import LogicalTensor
    from expq.decoders.fp8_block import Fp8BlockDecoder
    from expq.io.safetensors import TensorInfo

    w = TensorInfo("w1.weight", "f", "F8_E4M3", (256, 64), 0, 256 * 64)
    s = TensorInfo("w1.weight_scale_inv", "f", "F32", (2, 1), 256 * 64, 256 * 64 + 8)
    t = LogicalTensor("w1.weight", "BF16", (256, 64), (w, s), decoded=True)
    dec = Fp8BlockDecoder((128, 128))
    assert dec.narrow(t, 64, 128) is None and dec.narrow(t, 0, 64) is None
    got = dec.narrow(t, 128, 256)
    assert got.parts == (TensorInfo("w1.weight", "f", "F8_E4M3", (128, 64), 128 * 64, 256 * 64),
                         TensorInfo("w1.weight_scale_inv", "f", "F32", (1, 1), 256 * 64 + 4, 256 * 64 + 8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f["format"])
@pytest.mark.parametrize("name", ["gpt_oss-bf16", "gpt_oss-mxfp4", "granitemoe-fp8", "granitemoe-bf16",
                                  "dbrx-bf16"])
def test_sliced_conversion_is_byte_identical(sources, name, fmt, tmp_path, monkeypatch):
    for shard in ("5GB", SHARD):
        whole, sliced = tmp_path / f"whole-{shard}", tmp_path / f"sliced-{shard}"
        monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
        expq.convert(sources[name], whole, device="cpu", max_shard_size=shard, **fmt)
        monkeypatch.setenv(plan_mod.SLICE_ENV, str(BUDGET))
        expq.convert(sources[name], sliced, device="cpu", max_shard_size=shard, **fmt)
        assert tree_digest(sliced) == tree_digest(whole), (name, shard)


@pytest.mark.parametrize("name", ["gpt_oss-bf16", "gpt_oss-mxfp4"])
def test_what_a_job_holds_at_once_is_bounded_by_the_budget(sources, name, tmp_path, monkeypatch):
    """The largest stored read, decoded tensor, row block quantized and scale pass of a conversion: about one
    slice (budget-sized), where unsliced they are the whole tensor (four experts). The front pass is made to claim
    every job it has outputs of (a pipeline that claims a job first takes its scales itself: which one does is a
    race, and the largest tensor's scales are what this measures)."""
    monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
    seen: dict[str, int] = {"read": 0, "decoded": 0, "quantized": 0, "front": 0}
    real_claim, tried, turn = pipeline.Run.claim, set(), threading.Condition()

    def claim(run, index, who):
        if who == "front":
            with turn:
                tried.add(index)
                turn.notify_all()
        else:  # the pipeline waits for the front pass to have asked first
            with turn:
                turn.wait_for(lambda: index in tried, timeout=10)
        return real_claim(run, index, who)

    monkeypatch.setattr(pipeline.Run, "claim", claim)

    def note(key, t):
        seen[key] = max(seen[key], t.numel() * t.element_size())
        return t

    src = open_source(sources[name])
    dec_cls = type(src.decoder)
    experts = {q.name for j in quantize_jobs(expq.inspect(sources[name])) for q in j.tensor.parts}
    real_read, real_q, real_s = pipeline.read_tensor, pipeline.quantize_matrix, front_pass.matrix_scales

    def read(root, info, **kw):
        t = real_read(root, info, **kw)
        return note("read", t) if info.name in experts else t

    monkeypatch.setattr(pipeline, "read_tensor", read)
    monkeypatch.setattr(pipeline, "quantize_matrix", lambda w: real_q(note("quantized", w)))
    monkeypatch.setattr(front_pass, "matrix_scales", lambda w, **kw: real_s(note("front", w), **kw))
    if name.endswith("mxfp4"):
        real_decode = dec_cls.decode
        monkeypatch.setattr(dec_cls, "decode", lambda self, t, read, device=None:
                            note("decoded", real_decode(self, t, read, device)))
        monkeypatch.setenv(cpu_kernels.ENV, "torch")  # no row absmax: the front pass decodes, measured too

    expq.convert(sources[name], tmp_path / "whole", device="cpu", format="experts-int8")
    whole = dict(seen)
    seen.update(dict.fromkeys(seen, 0))
    monkeypatch.setenv(plan_mod.SLICE_ENV, str(BUDGET))
    expq.convert(sources[name], tmp_path / "sliced", device="cpu", format="experts-int8")
    gate_up = 4 * 192 * 64 * 2  # [E, H, 2I] in bf16: the largest stacked tensor
    one_expert = gate_up // 4  # the budget (13000) holds less than one gate_up expert: one a slice
    assert whole["quantized"] == whole["front"] == gate_up
    assert seen["quantized"] == seen["front"] == one_expert
    if name.endswith("mxfp4"):
        assert whole["decoded"] == gate_up and seen["decoded"] == one_expert
    assert whole["read"] > 0 and seen["read"] == whole["read"] // 4  # the stored bytes of one expert of four


def test_a_conversion_killed_between_slices_resumes_to_the_same_bytes(sources, tmp_path, monkeypatch):
    """Killed (SIGKILL through the writer's fault seam) after a few writes, some of a stacked tensor's slices
    written and others not, in a shard not finished: the same command again gives the unsliced conversion's
    bytes."""
    src = sources["gpt_oss-mxfp4"]
    monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
    ref = tmp_path / "ref"
    expq.convert(src, ref, device="cpu", max_shard_size=SHARD, format="experts-int8")
    monkeypatch.setenv(plan_mod.SLICE_ENV, str(BUDGET))
    for n in (3, 9, 17):
        out = tmp_path / f"k{n}" / "out"
        out.parent.mkdir()
        p = start_cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD, "--format", "experts-int8",
                      fault=f"write:{n}:kill")
        text, _ = p.communicate(timeout=180)
        assert p.returncode == -signal.SIGKILL, text
        assert not out.exists()
        expq.convert(src, out, device="cpu", max_shard_size=SHARD, format="experts-int8")
        assert tree_digest(out) == tree_digest(ref), n


def test_row_findings_add_up_over_the_slices(sources, tmp_path, monkeypatch):
    """Zero and underflowing rows in several slices of a tensor: counted and listed as when it is taken whole."""
    src = tmp_path / "src"
    shutil.copytree(sources["gpt_oss-bf16"], src)
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [E, H, 2I]: a scheme row is a column of an expert's block

    def edit(tensors):
        w = tensors[name]
        for e in (1, 3):
            w[e, :, 5 + e] = 0
        w[0, :, 9] = w[2, :, 9] = w[3, :, 2] = 1e-39  # a scale of 1e-39 / 127 underflows in bf16

    edit_shard_tensors(src, name, edit)
    monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
    whole = expq.convert(src, tmp_path / "whole", device="cpu", format="experts-int8")
    monkeypatch.setenv(plan_mod.SLICE_ENV, str(BUDGET))
    sliced = expq.convert(src, tmp_path / "sliced", device="cpu", format="experts-int8")
    assert (whole.zero_rows, whole.underflow_rows) == (2, 3)
    assert (sliced.zero_rows, sliced.underflow_rows, sliced.underflow_examples) == \
        (whole.zero_rows, whole.underflow_rows, whole.underflow_examples)
    assert [e.split(" expert ")[1].split(" ", 2)[:2] for e in whole.underflow_examples] == \
        [["0", "up"], ["2", "up"], ["3", "gate"]]  # in row order: stored columns 9, 9 and 2 (odd: up)
    assert tree_digest(tmp_path / "sliced") == tree_digest(tmp_path / "whole")


def test_nonfinite_rows_found_alike_over_the_slices(sources, tmp_path, monkeypatch):
    """NaN/inf rows in several slices of a tensor: the refusal names the whole tensor's count and its first row, and
    an allowed conversion records them, exactly as when the tensor is taken whole."""
    src = tmp_path / "src"
    shutil.copytree(sources["gpt_oss-bf16"], src)
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [E, H, 2I]: column 2r is gate row r, 2r+1 up row r

    def edit(tensors):
        w = tensors[name]
        w[1, 3, 6] = w[1, 7, 11] = float("nan")  # expert 1: gate row 3, up row 5
        w[3, 0, 2] = float("-inf")  # expert 3 (another slice): gate row 1

    edit_shard_tensors(src, name, edit)
    got = {}
    for how, budget in (("whole", None), ("sliced", str(BUDGET))):
        if budget is None:
            monkeypatch.delenv(plan_mod.SLICE_ENV, raising=False)
        else:
            monkeypatch.setenv(plan_mod.SLICE_ENV, budget)
        job, = (j for j in quantize_jobs(expq.inspect(src)) if j.tensor.name == name)
        assert len(job.slices) == (1 if budget is None else 4)
        with pytest.raises(NonFiniteError) as ei:
            expq.convert(src, tmp_path / f"refused-{how}", device="cpu", format="experts-int8")
        e = ei.value
        assert not (tmp_path / f"refused-{how}").exists()
        r = expq.convert(src, tmp_path / how, device="cpu", format="experts-int8", allow_nonfinite=True)
        got[how] = (str(e), (e.tensor, e.expert, e.row), r.nonfinite_rows, r.nonfinite_examples,
                    load_json(tmp_path / how / "expq.json")["rows"])
    assert got["sliced"] == got["whole"]
    assert got["whole"][:4] == (
        f"file {job.tensor.file}, tensor {name}, expert 1, row 3: routed-expert row "
        "holds NaN or infinity (3 such rows in this tensor, first: layer 1 gate); vLLM would quantize it to garbage "
        "(pass allow_nonfinite=True to reproduce vLLM anyway)", (name, 1, 3), 3,
        [f"{name} layer 1 expert 1 gate row 3", f"{name} layer 1 expert 1 up row 5",
         f"{name} layer 1 expert 3 gate row 1"])
    assert got["whole"][4]["nonfinite"] == 3
    assert tree_digest(tmp_path / "sliced") == tree_digest(tmp_path / "whole")


@pytest.mark.parametrize("value,why", [("8 experts", "not a size: '8 experts'"),
                                       ("0.5", "size must be at least 1 byte: '0.5'")])
def test_a_bad_slice_budget_is_one_line_naming_the_variable(sources, value, why, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "expq.cli", "convert", sources["gpt_oss-bf16"], out, "--device", "cpu"],
                       env={**os.environ, plan_mod.SLICE_ENV: value}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: EXPQ_SLICE_BYTES={value!r}: {why}" + (" (use e.g. 5GB, 500MB, 2GiB)" if "not a size" in why else "")
        + " (unset it for the default, 256 MiB)"], r.stderr
    assert not out.exists()

"""The experts-int8 format: the seed's own tensors (int8 codes, fp32 scales), refused by stock transformers, loaded by
transformers after ``import expq``; and, per family, a default format that stock transformers either loads right or
refuses."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch
from helpers import (converted_factory, decode_output, dequantized_reference, example, load_hf, model_expert_matrices,
                     read_tensors, rel, seed_reference)

import expq
from expq.examples import FAMILIES
from expq.layouts import detect_layout

LOGIT_REL_TOL = 2e-2  # as tests/test_runtime.py: bf16 rounding level; a wrong expert or scale is > 30%
IDS = torch.randint(2, 300, (2, 16), generator=torch.Generator().manual_seed(0))
METHOD = "expq_experts_int8"


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory):
    return converted_factory(tmp_path_factory, "ei8", format="experts-int8", max_shard_size="60KB")


@pytest.fixture(scope="module")
def default_out(tmp_path_factory):
    return converted_factory(tmp_path_factory, "dflt")


@contextlib.contextmanager
def stock_transformers():
    """transformers as it is without expq: expq's quantizer and config taken out of its registries (the only
    thing ``import expq`` adds)."""
    from transformers.quantizers import auto

    maps = (auto.AUTO_QUANTIZER_MAPPING, auto.AUTO_QUANTIZATION_CONFIG_MAPPING)
    saved = [m.pop(METHOD, None) for m in maps]
    try:
        yield
    finally:
        for m, v in zip(maps, saved):
            if v is not None:
                m[METHOD] = v


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensors_are_the_seeds(family, int8_out):
    """Per expert projection: int8 codes and fp32 scales equal to a literal reference of the seed; one empty I8
    marker per MoE layer at the name transformers loads that layer's experts from; nothing packed."""
    src, out = int8_out(family)
    expected = model_expert_matrices(family, load_hf(src))
    got = decode_output(out)
    assert set(got) == set(expected)
    for key, w in expected.items():
        codes, scales, module = got[key]
        ref_codes, ref_scales = seed_reference(w)
        assert torch.equal(codes, ref_codes), (key, module)
        assert torch.equal(scales, ref_scales.float()), (key, module)
    tensors = read_tensors(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == METHOD and qc["format"] == "experts-int8"
    markers = qc["markers"]
    assert len(markers) == len({k[0] for k in got})
    for name in markers:
        assert tensors[name].dtype == torch.int8 and tensors[name].numel() == 0, name
    assert not any(n.endswith((".weight_packed", ".weight_shape")) for n in tensors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stock_transformers_refuses_and_expq_loads(family, int8_out):
    """Without expq transformers raises (never random experts); after ``import expq`` from_pretrained builds the int8
    experts modules that expq.load_model builds, and the logits match the reference-dequantized source."""
    src, out = int8_out(family)
    with stock_transformers(), pytest.raises(RuntimeError, match="mismatch"):
        load_hf(out)
    model = load_hf(out)
    mods = [m for m in model.modules() if getattr(m, "expq_int8", False)]
    ref_mods = [m for m in expq.load_model(out, device="cpu").modules() if getattr(m, "expq_int8", False)]
    assert mods and len(mods) == len(ref_mods)
    assert {type(m).__name__ for m in mods} == {type(m).__name__ for m in ref_mods}
    for a, b in zip(mods, ref_mods):
        for name in ("w13_weight", "w2_weight", "w13_scale", "w2_scale"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.w13_weight.dtype == torch.int8
    with torch.no_grad():
        r = rel(model(IDS).logits, dequantized_reference(family, src, out)(IDS).logits)
    assert r < LOGIT_REL_TOL, r


def test_negative_control_marker_is_what_stops_stock_transformers(int8_out, tmp_path):
    """Without its markers, stock transformers would load the checkpoint with random experts: the markers are what
    makes it refuse (and verify reports their absence)."""
    import shutil

    from helpers import edit_shard_tensors  # noqa: F401  (same module; shows where shard edits live)
    from safetensors.torch import load_file, save_file

    src, out = int8_out("mixtral")
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    qc = json.loads((bare / "config.json").read_text())["quantization_config"]
    for f in bare.glob("*.safetensors"):
        t = load_file(f)
        kept = {k: v for k, v in t.items() if k not in qc["markers"]}
        if len(kept) != len(t):
            save_file(kept, f, metadata={"format": "pt"})
    index = json.loads((bare / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in qc["markers"]}
    (bare / "model.safetensors.index.json").write_text(json.dumps(index))
    with stock_transformers():
        model = load_hf(bare)  # loads: experts missing, randomly initialised (what the markers prevent)
    with torch.no_grad():
        assert rel(model(IDS).logits, dequantized_reference("mixtral", src, out)(IDS).logits) > 0.1
    from expq.checkpoint import ConvertedCheckpoint

    ck = ConvertedCheckpoint(bare)
    problems = ck.format.check_config(ck.quantization_config, ck.tensors)
    assert len(problems) == 1 and "marker" in problems[0] and qc["markers"][0] in problems[0], problems
    assert expq.verify(bare).verdict.startswith("FAIL")


def test_really_stock_transformers_refuses(int8_out):
    """A fresh interpreter that never imports expq: transformers stops with an error and exit status 1."""
    _, out = int8_out("qwen3_moe")
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom transformers import AutoModelForCausalLM\n"
                        f"AutoModelForCausalLM.from_pretrained({str(out)!r})\nassert 'expq' not in sys.modules"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "RuntimeError" in r.stderr and "mismatch" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_format_never_gives_silently_random_experts(family, default_out):
    """expq's default output for each family: stock transformers either loads it right (logits match the
    reference-dequantized source) or raises. The choice is the layout's [clients] format."""
    src, out = default_out(family)
    lay = detect_layout(json.loads((src / "config.json").read_text()))[0]
    manifest = json.loads((out / "expq.json").read_text())
    assert manifest["format"] == lay.default_format
    try:
        with stock_transformers():
            model = load_hf(out)
    except RuntimeError:
        assert lay.default_format == "experts-int8", "stock transformers refused a compressed-tensors default"
        return
    with torch.no_grad():
        r = rel(model(IDS).logits, dequantized_reference(family, src, out)(IDS).logits)
    assert r < LOGIT_REL_TOL, f"{family}: stock transformers loads the default output wrongly (rel {r:.3f})"


def test_verify_passes_and_inspect_says_why(int8_out, tmp_path_factory):
    src, out = int8_out("gpt_oss")
    rep = expq.verify(out, source=src)
    assert rep.verdict.startswith("PASS"), [c for c in rep.checks if not c.ok]
    s = expq.inspect(example(tmp_path_factory, "granitemoe")).summary()
    assert s["format"] == "experts-int8" and "randomly initialised" in s["format_reason"]
    engines = {c["engine"]: c for c in s["clients"]}
    assert engines["vLLM"]["loads"] and "vllm serve OUT" in engines["vLLM"]["command"]
    assert "import expq" in engines["transformers"]["command"]
    s = expq.inspect(example(tmp_path_factory, "gpt_oss")).summary()  # vLLM 0.24's own GPT-OSS loader stops it
    vllm = {c["engine"]: c for c in s["clients"]}["vLLM"]
    assert s["format"] == "experts-int8" and not vllm["loads"] and "w2_bias" in vllm["note"]
    s_ct = expq.inspect(example(tmp_path_factory, "gpt_oss"), format="compressed-tensors").summary()
    assert s_ct["format"] == "compressed-tensors" and "--format" in s_ct["format_reason"]
    assert not {c["engine"]: c for c in s_ct["clients"]}["transformers"]["loads"]


def test_a_layout_whose_markers_stock_transformers_would_not_load_is_refused(tmp_path, tmp_path_factory):
    """A custom layout naming a [runtime] weight transformers' model does not have would write markers stock
    transformers ignores (random experts): convert refuses it, naming the marker, and commits nothing (the check
    runs beside the conversion and stops it)."""
    from pathlib import Path

    from expq.errors import LayoutError

    src = example(tmp_path_factory, "mixtral")
    good = (Path(expq.__file__).parent / "configs" / "mixtral.toml").read_text()
    assert 'forward = "topk"\n' in good
    bad = tmp_path / "bogus.toml"
    bad.write_text(good.replace('forward = "topk"\n', 'forward = "topk"\nweight = "bogus_proj"\n', 1))
    out = tmp_path / "out"
    with pytest.raises(LayoutError, match=r"marker model\.layers\.0\.mlp\.experts\.bogus_proj .*random experts"):
        expq.convert(src, out, format="experts-int8", layout=bad, device="cpu")
    assert not out.exists()
    (tmp_path / "good.toml").write_text(good)
    expq.convert(src, out, format="experts-int8", layout=tmp_path / "good.toml", device="cpu")  # the right weight
    assert expq.verify(out).ok


def test_advice_never_points_at_a_path_that_fails(tmp_path_factory):
    """Where expq's plugin cannot serve a family either, the compressed-tensors advice does not send users there."""
    s = expq.inspect(example(tmp_path_factory, "phimoe")).summary()  # hidden 64: no Marlin; and no phimoe in vLLM
    vllm = {c["engine"]: c for c in s["clients"]}["vLLM"]
    assert not vllm["loads"] and "--format experts-int8" not in vllm["note"] and "Phimoe" in vllm["note"]
    assert s["format_reason"] == "this family's default: stock transformers loads it"


def test_verify_fails_a_marker_that_is_not_empty(int8_out, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, out = int8_out("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    marker = json.loads((bad / "config.json").read_text())["quantization_config"]["markers"][0]
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    f = bad / index[marker]
    t = load_file(f)
    t[marker] = torch.zeros(4, 96, 64, dtype=torch.int8)
    save_file(t, f, metadata={"format": "pt"})
    rep = expq.verify(bad)
    assert not rep.ok and any(f"layer marker {marker} is I8 [4, 96, 64], expected I8 [0]" in p for p in rep.problems)


@pytest.mark.parametrize("family", ["gpt_oss", "dbrx", "llama4_text", "granitemoe", "mixtral"])
def test_a_row_absmax_over_row_dim_lines_up_with_the_matrices_rows(family, tmp_path_factory):
    """``ExpertTensor.row_dim`` (the dimension the front pass asks a decoder's row absmax over): the maximum of a
    stored tensor over it, through ``to_rows``, is each matrix row's maximum, for per-expert, ``out_in`` and ``in_out``
    stacked tensors (gate/up interleaved or concatenated); None where no one dimension holds a row (DBRX's flat
    ``[E*in, out]`` w2)."""
    plan = expq.inspect(example(tmp_path_factory, family))
    g = torch.Generator().manual_seed(0)
    dims = set()
    for name, et in plan.experts.tensors.items():
        shape = plan.source.logical[name].shape
        dim = et.row_dim(shape)
        dims.add(dim)
        if dim is None:
            continue
        w = torch.randn(shape, generator=g)
        assert torch.equal(et.to_rows(w.abs().amax(dim, keepdim=True))[:, 0], et.to_rows(w).abs().amax(-1)), name
    assert dims == {"gpt_oss": {-2}, "dbrx": {-1, None}, "llama4_text": {-2}}.get(family, {-1})

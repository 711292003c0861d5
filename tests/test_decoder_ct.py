"""The compressed-tensors source decoder against the compressed-tensors library itself.

Fixtures are compressed by the library's own compressors (``ct_fixture``); the judge of every decoded tensor is the
library's own model-free dequantizer (``CompressedTensorsDequantizer``, which matches modules and gathers their
tensors on its own), bit for bit, and the original weights within each scheme's quantization error.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import expq
from ct_fixture import (KIMI_STYLE_IGNORE, compress_weight, decompress_weight, make_ct_int4_source,
                        max_abs_error_bound, quantization_config, scheme)
from expq import decoders
from expq.decoders.compressed_tensors import CompressedTensorsDecoder
from expq.errors import LayoutError, SourceError
from expq.io.safetensors import TensorInfo, read_tensor
from expq.source import open_source
from helpers import example

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
H, I = 64, 48
SHARD_A, SHARD_B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


# --- a tiny handmade source: two experts of one layer, attention, router and norm ------------------------------
def originals(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {}
    for e in range(2):
        for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            t[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = w(*shape)
    t["model.layers.0.mlp.experts.1.down_proj.weight"][3, 5] = 0.4  # one outlier: a group with a large step
    t["model.layers.0.self_attn.q_proj.weight"] = w(H, H)
    t["model.layers.0.mlp.gate.weight"] = w(4, H)
    t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    return t


def expert_module(name: str) -> str | None:
    if ".mlp.experts." in name and name.endswith(".weight"):
        return name.removesuffix(".weight")
    return None


def write_source(root: Path, qc_dict: dict | None, tensors: dict[str, torch.Tensor],
                 split: dict[str, str] | None = None) -> Path:
    """A checkpoint of ``tensors`` in two shards (``split``: name -> shard, default: the first half in shard A),
    config.json of a qwen3_moe with ``qc_dict`` as its quantization_config."""
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    split = split or {}
    where = {n: split.get(n, SHARD_A if i < len(names) // 2 else SHARD_B) for i, n in enumerate(names)}
    for shard in (SHARD_A, SHARD_B):
        save_file({n: t.contiguous() for n, t in tensors.items() if where[n] == shard}, root / shard,
                  metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "dtype": "bfloat16",
           "num_experts": 2, "hidden_size": H, "moe_intermediate_size": I, "num_hidden_layers": 1}
    if qc_dict is not None:
        cfg["quantization_config"] = qc_dict
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


def qc_json(qc) -> dict:
    """A QuantizationConfig as the library writes it into config.json (ModelCompressor.update_config)."""
    from compressed_tensors.compressors import ModelCompressor
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text("{}")
        ModelCompressor(quantization_config=qc).update_config(d)
        return json.loads((Path(d) / "config.json").read_text())["quantization_config"]


def build(root: Path, sch, *, extra: dict[str, torch.Tensor] | None = None, scale_dtype=None, split=None,
          seed: int = 0) -> tuple[Path, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Compress the experts of ``originals()`` with ``sch`` (by the library) and write the source.

    Returns (root, originals, compressed state dict per expert module)."""
    orig = originals(seed)
    stored, comp = {}, {}
    for name, t in orig.items():
        m = expert_module(name)
        if m is None:
            stored[name] = t
            continue
        comp[m] = compress_weight(t, sch, scale_dtype=scale_dtype)
        stored.update({f"{m}.{k}": v for k, v in comp[m].items()})
    stored.update(extra or {})
    qc = quantization_config({"group_0": sch}, sch.format, ["lm_head"])
    return write_source(root, qc_json(qc), stored, split), orig, comp


def library_dequantized(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the source after the library's own model-free dequantizer (bf16)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    tensors = {}
    for f in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(f))
    return CompressedTensorsDequantizer(str(root)).process(tensors)


def decode_all(root: Path) -> tuple[CompressedTensorsDecoder, dict, dict[str, torch.Tensor]]:
    s = open_source(root)
    dec = decoders.detect(s.config, s.tensors)
    assert isinstance(dec, CompressedTensorsDecoder)
    lts = dec.logical_tensors(s.tensors)
    out = {n: dec.decode(lt, lambda ti: read_tensor(root, ti)) if lt.decoded else read_tensor(root, lt.stored)
           for n, lt in lts.items()}
    return dec, lts, out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_exact(decoded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Decoded == the library's dequantization, tensor for tensor, bit for bit."""
    assert decoded.keys() == reference.keys()
    for name, ref in reference.items():
        got = decoded[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(bits(got), bits(ref)), f"{name} differs from the library's dequantization"


def assert_close(decoded: dict[str, torch.Tensor], orig: dict, comp: dict, sch) -> None:
    """Every decoded expert within the scheme's error bound of its original weight (and really quantized)."""
    for name, t in orig.items():
        m = expert_module(name)
        if m is None:
            continue
        err = (decoded[name].float() - t.float()).abs()
        bound = max_abs_error_bound(t, sch, comp[m])
        assert (err <= bound).all(), f"{name}: error {err.max():.3g} over the bound at {(err > bound).sum()} elements"
        assert err.max() > 0  # really quantized (a pass-through would not be judged)


def assert_matches(decoded, reference, orig, comp, sch) -> None:
    assert_exact(decoded, reference)
    assert_close(decoded, orig, comp, sch)


SCHEMES = {  # id: (weights, format, input activations, extra kw)
    "int4-group16": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
                     "pack-quantized", None),
    "int4-group16-asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
                          "pack-quantized", None),
    "int8-group16": (dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=16),
                     "pack-quantized", None),
    "int4-channel": (dict(num_bits=4, type="int", symmetric=True, strategy="channel"), "pack-quantized", None),
    "fp8-channel-dynamic": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized",
                            dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)),
    "fp8-tensor": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), "float-quantized",
                   dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)),
    "fp8-block16": (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[16, 16]),
                    "float-quantized", None),
    "int8-naive-group16": (dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=16),
                           "naive-quantized", None),
}


@pytest.fixture(params=["whole", "bands"])
def row_bands(request, monkeypatch):
    """Decode each module in one call ("whole"), or in bands of 8-16 rows spread over a 2-thread pool as a CPU
    conversion does ("bands"; the values must not depend on it)."""
    if request.param == "whole":
        yield request.param
        return
    from concurrent.futures import ThreadPoolExecutor

    from expq import parallel
    from expq.decoders import compressed_tensors as ct

    monkeypatch.setattr(ct, "BAND_ELEMS", 8 * H)
    with ThreadPoolExecutor(2) as pool, parallel.using(pool):
        yield request.param


@pytest.mark.parametrize("sid", list(SCHEMES))
def test_decodes_like_the_library(tmp_path, sid, row_bands):
    weights, fmt, acts = SCHEMES[sid]
    sch = scheme(weights, [EXPERTS], fmt, acts)
    extra = {}
    if acts and not acts.get("dynamic"):  # a static activation scale per module: a part, read by nobody
        extra = {f"model.layers.0.mlp.experts.{e}.{p}.input_scale": torch.tensor([0.02], dtype=torch.bfloat16)
                 for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    root, orig, comp = build(tmp_path / "src", sch, extra=extra)
    dec, lts, decoded = decode_all(root)
    reference = library_dequantized(root)
    if fmt == "naive-quantized":  # the model-free dequantizer re-infers int8 weight-only as pack-quantized and so
        # leaves this checkpoint as it is: judge by the compressor's own decompress, module by module
        reference = {n: decompress_weight(comp[m], sch).to(torch.bfloat16) if (m := expert_module(n)) else t
                     for n, t in orig.items()}
    # the library's dequantizer leaves static activation scales behind as plain tensors; expq drops them
    assert all(reference.pop(k).numel() == 1 for k in list(reference) if k.endswith(".input_scale")) or not extra
    assert_matches(decoded, reference, orig, comp, sch)
    lt = lts["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert lt.decoded and lt.dtype == "BF16" and lt.shape == (H, I)
    assert lt.how.startswith(f"compressed-tensors {fmt} ") and lt.how.endswith("-> bf16" + (
        " (activation quantization dropped)" if acts else ""))
    assert lt.stored.name.endswith(".weight_packed" if fmt == "pack-quantized" else ".weight")
    if extra:
        assert any(p.name.endswith(".input_scale") for p in lt.parts)
    assert not lts["model.layers.0.self_attn.q_proj.weight"].decoded
    assert pickle.loads(pickle.dumps(dec)).decode(lt, lambda ti: read_tensor(root, ti)).equal(decoded[lt.name])


def test_how_strings(tmp_path):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    _, lts, _ = decode_all(root)
    assert lts["model.layers.0.mlp.experts.0.gate_proj.weight"].how == \
        "compressed-tensors pack-quantized int4 group 16 -> bf16"
    sch = scheme(SCHEMES["fp8-channel-dynamic"][0], [EXPERTS], "float-quantized")
    root, _, _ = build(tmp_path / "src8", sch)
    _, lts, _ = decode_all(root)
    assert lts["model.layers.0.mlp.experts.0.gate_proj.weight"].how == \
        "compressed-tensors float-quantized fp8 e4m3 channel -> bf16"


def test_fp32_scales_and_parts_in_another_shard(tmp_path):
    """F32 scales (the library dequantizes in fp32, then the compute dtype), and a scale stored in the other shard
    than its weight."""
    sch = scheme(SCHEMES["fp8-channel-dynamic"][0], [EXPERTS], "float-quantized")
    m = "model.layers.0.mlp.experts.0.up_proj"
    root, orig, comp = build(tmp_path / "src", sch, scale_dtype=torch.float32,
                             split={f"{m}.weight": SHARD_A, f"{m}.weight_scale": SHARD_B})
    dec, lts, decoded = decode_all(root)
    lt = lts[f"{m}.weight"]
    assert {p.file for p in lt.parts} == {SHARD_A, SHARD_B} and lt.parts[1].dtype == "F32" and lt.dtype == "BF16"
    assert_matches(decoded, library_dequantized(root), orig, comp, sch)


def test_int4_fixture_matches_its_decompressed_checkpoint(tmp_path, tmp_path_factory):
    """ct_fixture's Kimi-style source: only routed experts INT4 (targets Linear + an ignore list), the rest bf16;
    decoded, it is its library-decompressed twin, tensor for tensor, bit for bit."""
    src = example(tmp_path_factory, "qwen3_moe")
    ct_dir, dec_dir = make_ct_int4_source(src, tmp_path)
    qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["ignore"] == KIMI_STYLE_IGNORE
    assert "quantization_config" not in json.loads((dec_dir / "config.json").read_text())
    _, lts, decoded = decode_all(ct_dir)
    twin = open_source(dec_dir)
    assert list(lts) == list(twin.tensors)
    n_decoded = 0
    for name, ti in twin.tensors.items():
        lt = lts[name]
        assert (lt.dtype, lt.shape) == (ti.dtype, ti.shape), name
        assert torch.equal(bits(decoded[name]), bits(read_tensor(dec_dir, ti))), name
        assert lt.decoded == (".mlp.experts." in name), name  # attention, router, norms stay stored as they are
        n_decoded += lt.decoded
    assert n_decoded == 2 * 4 * 3
    orig, ct = open_source(src), open_source(ct_dir)  # and the twin is the bf16 source within int4 group-16 error
    sch = scheme(SCHEMES["int4-group16"][0], ["Linear"], "pack-quantized")
    for name, lt in lts.items():
        if lt.decoded:
            w = read_tensor(src, orig.tensors[name])
            scale = read_tensor(ct_dir, ct.tensors[name.removesuffix(".weight") + ".weight_scale"])
            err = (decoded[name].float() - w.float()).abs()
            assert 0 < err.max() and (err <= max_abs_error_bound(w, sch, {"weight_scale": scale})).all(), name


# --- negative controls: the comparison must fail when the decoding is wrong -------------------------------------------
def test_negative_control_wrong_scale(tmp_path):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, orig, comp = build(tmp_path / "src", sch)
    reference = library_dequantized(root)
    m = "model.layers.0.mlp.experts.0.gate_proj"
    shard = next(f for f in (SHARD_A, SHARD_B) if f"{m}.weight_scale" in load_file(root / f))
    saved = (root / shard).read_bytes()
    t = load_file(root / shard)
    t[f"{m}.weight_scale"] = t[f"{m}.weight_scale"] * 1.25
    save_file(t, root / shard, metadata={"format": "pt"})
    _, _, decoded = decode_all(root)
    with pytest.raises(AssertionError, match=f"{m}.weight differs from the library"):
        assert_exact(decoded, reference)
    with pytest.raises(AssertionError, match=f"{m}.weight: error .* over the bound"):
        assert_close(decoded, orig, comp, sch)
    (root / shard).write_bytes(saved)  # restored: passes again
    assert_matches(decode_all(root)[2], reference, orig, comp, sch)


def test_negative_control_wrong_group_size(tmp_path):
    """A config whose group size does not fit the stored scales is refused; one whose (coarser) scales fit it
    decodes to values the comparison rejects; the right config passes."""
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, orig, comp = build(tmp_path / "src", sch)
    reference = library_dequantized(root)
    cfg_path = root / "config.json"
    good = cfg_path.read_text()

    def with_group_size(gs: int, projections: str = "gate|up|down") -> None:
        cfg = json.loads(good)
        groups = cfg["quantization_config"]["config_groups"]
        groups["group_1"] = json.loads(json.dumps(groups["group_0"]))  # the rest keeps its group size
        groups["group_0"]["targets"] = [rf"re:.*mlp\.experts\.\d+\.({projections})_proj$"]
        groups["group_0"]["weights"]["group_size"] = gs
        cfg_path.write_text(json.dumps(cfg))

    for wrong in (8, 32):
        with_group_size(wrong)
        with pytest.raises(SourceError, match="groups of") as e:
            decode_all(root)
        assert e.value.tensor.endswith(".weight_scale") and e.value.file.endswith(".safetensors")
    # group 32 for gate/up (64 columns) with every other group-16 scale: the shapes fit, the values are wrong
    with_group_size(32, "gate|up")
    saved = {f: (root / f).read_bytes() for f in (SHARD_A, SHARD_B)}
    _rewrite(root, lambda t: t.update({k: v[:, ::2].contiguous() for k, v in t.items()
                                       if k.endswith(("gate_proj.weight_scale", "up_proj.weight_scale"))}))
    _, _, decoded = decode_all(root)
    with pytest.raises(AssertionError, match="gate_proj.weight differs from the library"):
        assert_exact(decoded, reference)
    with pytest.raises(AssertionError, match="over the bound"):
        assert_close(decoded, orig, comp, sch)
    cfg_path.write_text(good)  # restored: passes
    for f, b in saved.items():
        (root / f).write_bytes(b)
    assert_matches(decode_all(root)[2], reference, orig, comp, sch)


# --- errors: one line, naming file and tensor -------------------------------------------------------------------------
def _rewrite(root: Path, fn) -> None:
    for f in (SHARD_A, SHARD_B):
        t = load_file(root / f)
        fn(t)
        save_file(t, root / f, metadata={"format": "pt"})
    weight_map = {}
    for f in (SHARD_A, SHARD_B):
        weight_map.update({k: f for k in load_file(root / f)})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _detect(root: Path):
    s = open_source(root)
    return decoders.detect(s.config, s.tensors)


def _one_line(e: SourceError) -> None:
    assert "\n" not in str(e) and str(e).startswith("file ")


M = "model.layers.0.mlp.experts.1.up_proj"


@pytest.mark.parametrize("missing", ["weight_scale", "weight_shape"])
def test_packed_weight_without_its_scale_or_shape(tmp_path, missing):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    _rewrite(root, lambda t: t.pop(f"{M}.{missing}", None))
    with pytest.raises(SourceError, match=f"no {M}.{missing}") as e:
        _detect(root)
    assert e.value.tensor == f"{M}.weight_packed" and e.value.file in (SHARD_A, SHARD_B)
    _one_line(e.value)


def test_orphan_scale(tmp_path):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    orphan = "model.layers.0.mlp.experts.7.gate_proj.weight_scale"
    _rewrite(root, lambda t: t.update({orphan: torch.ones(I, 4, dtype=torch.bfloat16)}) if "model.norm.weight" in t
             else None)
    with pytest.raises(SourceError, match="weight_scale without its weight") as e:
        _detect(root)
    assert e.value.tensor == orphan and e.value.file in (SHARD_A, SHARD_B)
    _one_line(e.value)


def test_fp8_weight_without_scale_and_wrong_dtype(tmp_path):
    sch = scheme(SCHEMES["fp8-channel-dynamic"][0], [EXPERTS], "float-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    _rewrite(root, lambda t: t.update({f"{M}.weight": t[f"{M}.weight"].to(torch.bfloat16)}) if f"{M}.weight" in t
             else None)
    with pytest.raises(SourceError, match="weight is BF16, but quantization_config stores 8-bit float") as e:
        _detect(root)
    assert e.value.tensor == f"{M}.weight"
    _rewrite(root, lambda t: t.pop(f"{M}.weight_scale", None))  # now a plain bf16 module: fine, stored as is
    s = open_source(root)
    assert not decoders.detect(s.config, s.tensors).logical_tensors(s.tensors)[f"{M}.weight"].decoded


@pytest.mark.parametrize("bad, match", [
    ({"group_size": None}, "requires group_size"),  # group strategy without a group size
    ({"bits": 4}, "Extra inputs are not permitted"),  # a key compressed-tensors does not know
    ({"actorder": "group"}, "actorder='group' has been removed"),  # GPTQ g_idx ordering, gone from the library
])
def test_config_that_does_not_validate(tmp_path, bad, match):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(bad)
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="does not validate as compressed-tensors") as e:
        _detect(root)
    assert e.value.file == "config.json" and match in str(e.value)
    _one_line(e.value)


@pytest.mark.parametrize("change, match", [
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (lambda qc: qc.update(transform_config={"config_groups": {"r": {}}}), "transform_config"),
    (lambda qc: qc.update(ignore=["lm_head", "re:.*experts\\.1\\..*"]), "leave this module unquantized"),
])
def test_refused_features(tmp_path, change, match):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    cfg = json.loads((root / "config.json").read_text())
    change(cfg["quantization_config"])
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=match) as e:
        _detect(root)
    _one_line(e.value)


def test_weight_shape_and_g_idx_checked_at_decode(tmp_path):
    sch = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    g_idx = torch.arange(H, dtype=torch.int32) // 16
    root, orig, comp = build(tmp_path / "src", sch, extra={f"{M}.weight_g_idx": g_idx})
    dec, lts, decoded = decode_all(root)  # the identity ordering decodes
    assert any(p.name.endswith("weight_g_idx") for p in lts[f"{M}.weight"].parts)
    reference = library_dequantized(root)
    reference.pop(f"{M}.weight_g_idx")  # the library's dequantizer leaves it behind as a plain tensor
    assert_matches(decoded, reference, orig, comp, sch)
    _rewrite(root, lambda t: t.update({f"{M}.weight_g_idx": g_idx.flip(0).contiguous()}) if f"{M}.weight_g_idx" in t
             else None)
    s = open_source(root)
    lt = dec.logical_tensors(s.tensors)[f"{M}.weight"]
    with pytest.raises(SourceError, match="permuted weight_g_idx") as e:
        dec.decode(lt, lambda ti: read_tensor(root, ti))
    assert e.value.tensor == f"{M}.weight_g_idx"
    _rewrite(root, lambda t: t.update({f"{M}.weight_shape": torch.tensor([I, H - 4])}) if f"{M}.weight_shape" in t
             else None)
    s = open_source(root)
    lt = dec.logical_tensors(s.tensors)[f"{M}.weight"]
    with pytest.raises(SourceError, match=r"weight_shape says \[48, 60\]") as e:
        dec.decode(lt, lambda ti: read_tensor(root, ti))
    assert e.value.tensor == f"{M}.weight_shape" and e.value.file in (SHARD_A, SHARD_B)


# --- never quantize twice ---------------------------------------------------------------------------------------------
# Which tensors are routed experts is the expert map's answer, from the layout in use: the refusal comes with the plan.
def test_refuses_an_expq_output(tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu")
    with pytest.raises(SourceError, match="already int8 per channel") as e:
        expq.inspect(out)
    assert "already quantized" in str(e.value) and "never quantizes twice" in str(e.value)
    assert e.value.file == "config.json" and e.value.tensor.endswith(".weight_packed")
    assert ".block_sparse_moe.experts." in e.value.tensor
    _one_line(e.value)


@pytest.mark.parametrize("fmt, acts", [
    ("pack-quantized", None),  # W8A16 per channel
    ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),  # W8A8
])
def test_refuses_int8_channel_experts(tmp_path, fmt, acts):
    sch = scheme(dict(num_bits=8, type="int", symmetric=True, strategy="channel"), [EXPERTS], fmt, acts)
    root, _, _ = build(tmp_path / "src", sch)
    assert _detect(root).name == "compressed-tensors"  # the format itself is understood
    with pytest.raises(SourceError, match="already int8 per channel"):
        expq.inspect(root)


def test_int8_channel_experts_of_an_unknown_family_follow_its_layout(tmp_path):
    """No built-in layout for the model: the architecture is unknown until a layout names its experts; with
    ``--layout`` the experts it names are refused."""
    sch = scheme(dict(num_bits=8, type="int", symmetric=True, strategy="channel"), [EXPERTS], "pack-quantized")
    root, _, _ = build(tmp_path / "src", sch)
    cfg = json.loads((root / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "some_new_moe", ["SomeNewMoeForCausalLM"]
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayoutError, match="some_new_moe"):
        expq.inspect(root)
    with pytest.raises(SourceError, match="already int8 per channel") as e:
        expq.inspect(root, layout=Path(expq.__file__).parent / "configs" / "qwen3_moe.toml")
    assert ".mlp.experts." in e.value.tensor


def test_int8_channel_elsewhere_is_decoded(tmp_path):
    """int8 per channel on attention only, int4 experts: nothing routed is int8 yet, so it is decoded."""
    orig = originals()
    experts = scheme(SCHEMES["int4-group16"][0], [EXPERTS], "pack-quantized")
    attn = scheme(dict(num_bits=8, type="int", symmetric=True, strategy="channel"), [r"re:.*self_attn\..*"],
                  "pack-quantized")
    stored = {}
    for name, t in orig.items():
        sch = experts if expert_module(name) else attn if ".self_attn." in name else None
        if sch is None:
            stored[name] = t
        else:
            stored.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in compress_weight(t, sch).items()})
    qc = quantization_config({"experts": experts, "attention": attn}, "mixed-precision", ["lm_head"])
    root = write_source(tmp_path / "src", qc_json(qc), stored)
    _, lts, decoded = decode_all(root)
    assert lts["model.layers.0.self_attn.q_proj.weight"].decoded
    reference = library_dequantized(root)
    for name in reference:
        assert torch.equal(bits(decoded[name]), bits(reference[name])), name


def test_plain_and_other_sources_are_not_claimed(tmp_path_factory):
    s = open_source(example(tmp_path_factory, "qwen3_moe"))
    assert CompressedTensorsDecoder.detect(s.config, s.tensors) is None
    assert CompressedTensorsDecoder.detect({"quantization_config": {"quant_method": "fp8"}}, s.tensors) is None


# --- published configs ------------------------------------------------------------------------------------------------
# moonshotai/Kimi-K2-Thinking config.json's quantization_config, as published (transcribed field for field).
KIMI_K2_THINKING = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# RedHatAI/Qwen3-30B-A3B-quantized.w4a16: GPTQ, scheme W4A16 (int4 symmetric group 128), targets Linear, ignore
# lm_head and the routers (its model card's recipe), as llm-compressor writes it (explicit ignore names, per-group
# format, the fields of compressed-tensors 0.9-era configs).
REDHAT_W4A16 = {
    "config_groups": {"group_0": {
        "format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized", "global_compression_ratio": None,
    "ignore": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "sparsity_config": {}, "transform_config": {}, "version": "0.9.4",
}
# RedHatAI/Qwen3-30B-A3B-FP8-dynamic: scheme FP8_DYNAMIC (fp8 e4m3 channel weights, dynamic per-token fp8
# activations), targets Linear, ignore lm_head and the routers.
REDHAT_FP8_DYNAMIC = {
    "config_groups": {"group_0": {
        "format": "float-quantized", "output_activations": None, "targets": ["Linear"],
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                              "symmetric": True, "type": "float"},
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": None,
    "ignore": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "sparsity_config": {}, "transform_config": {}, "version": "0.9.4",
}


def _ti(name: str, dtype: str, shape: tuple[int, ...], file: str = "model-00001.safetensors") -> TensorInfo:
    return TensorInfo(name, file, dtype, shape, 0, 0)  # headers only: detect and logical_tensors never read


def _headers_int(prefix: str, module: str, out: int, cols: int, gs: int) -> dict[str, TensorInfo]:
    m = f"{prefix}{module}"
    return {f"{m}.weight_packed": _ti(f"{m}.weight_packed", "I32", (out, cols // 8)),
            f"{m}.weight_scale": _ti(f"{m}.weight_scale", "BF16", (out, cols // gs)),
            f"{m}.weight_shape": _ti(f"{m}.weight_shape", "I32", (2,))}


@pytest.mark.parametrize("nested", [False, True])
def test_kimi_k2_thinking_config(nested):
    """Kimi-K2-Thinking (and K2.5's text_config-nested form): routed experts INT4 group 32, the rest bf16."""
    pre = "language_model.model.layers." if nested else "model.layers."
    t = {}
    for e in (0, 383):
        for p, (o, c) in (("gate_proj", (2048, 7168)), ("up_proj", (2048, 7168)), ("down_proj", (7168, 2048))):
            t.update(_headers_int(pre, f"1.mlp.experts.{e}.{p}", o, c, 32))
    for n, shape in ((f"{pre}0.mlp.gate_proj.weight", (18432, 7168)), (f"{pre}1.mlp.gate.weight", (384, 7168)),
                     (f"{pre}1.mlp.shared_experts.down_proj.weight", (7168, 2048)),
                     (f"{pre}1.self_attn.kv_a_proj_with_mqa.weight", (576, 7168)), ("lm_head.weight", (163840, 7168))):
        t[n] = _ti(n, "BF16", shape)
    text = {"model_type": "kimi_k2", "torch_dtype": "bfloat16", "n_routed_experts": 384}
    config = {"model_type": "kimi_k25", "text_config": {**text, "quantization_config": KIMI_K2_THINKING}} if nested \
        else {**text, "quantization_config": KIMI_K2_THINKING}
    dec = CompressedTensorsDecoder.detect(config, t)
    lts = dec.logical_tensors(t)
    down = lts[f"{pre}1.mlp.experts.383.down_proj.weight"]
    assert down.shape == (7168, 2048) and down.dtype == "BF16" and down.decoded
    assert down.how == "compressed-tensors pack-quantized int4 group 32 -> bf16"
    assert [p.name.rpartition(".")[2] for p in down.parts] == ["weight_packed", "weight_scale", "weight_shape"]
    assert lts[f"{pre}1.mlp.experts.0.gate_proj.weight"].shape == (2048, 7168)
    assert sum(lt.decoded for lt in lts.values()) == 6 and len(lts) == 6 + 5
    # an INT4 scale with the wrong group count is caught from the headers alone
    bad = dict(t)
    n = f"{pre}1.mlp.experts.0.up_proj.weight_scale"
    bad[n] = _ti(n, "BF16", (2048, 7168 // 64))
    with pytest.raises(SourceError, match="weight_packed holds 896 words"):
        CompressedTensorsDecoder.detect(config, bad)


@pytest.mark.parametrize("qc", ["w4a16", "fp8-dynamic"])
def test_redhat_qwen3_moe_configs(qc):
    t = {}
    for layer in (0, 1):
        pre = f"model.layers.{layer}."
        for e in (0, 127):
            for p, (o, c) in (("gate_proj", (768, 2048)), ("up_proj", (768, 2048)), ("down_proj", (2048, 768))):
                m = f"{pre}mlp.experts.{e}.{p}"
                if qc == "w4a16":
                    t.update(_headers_int(pre, f"mlp.experts.{e}.{p}", o, c, 128))
                else:
                    t[f"{m}.weight"] = _ti(f"{m}.weight", "F8_E4M3", (o, c))
                    t[f"{m}.weight_scale"] = _ti(f"{m}.weight_scale", "BF16", (o, 1))
        for p in ("q_proj", "o_proj"):  # every Linear is quantized, attention included
            m = f"{pre}self_attn.{p}"
            if qc == "w4a16":
                t.update(_headers_int(pre, f"self_attn.{p}", 2048 if p == "o_proj" else 4096,
                                      4096 if p == "o_proj" else 2048, 128))
            else:
                o, c = (2048, 4096) if p == "o_proj" else (4096, 2048)
                t[f"{m}.weight"] = _ti(f"{m}.weight", "F8_E4M3", (o, c))
                t[f"{m}.weight_scale"] = _ti(f"{m}.weight_scale", "BF16", (o, 1))
        t[f"{pre}mlp.gate.weight"] = _ti(f"{pre}mlp.gate.weight", "BF16", (128, 2048))
        t[f"{pre}self_attn.q_norm.weight"] = _ti(f"{pre}self_attn.q_norm.weight", "BF16", (128,))
    config = {"model_type": "qwen3_moe", "torch_dtype": "bfloat16",
              "quantization_config": REDHAT_W4A16 if qc == "w4a16" else REDHAT_FP8_DYNAMIC}
    dec = CompressedTensorsDecoder.detect(config, t)
    lts = dec.logical_tensors(t)
    down = lts["model.layers.1.mlp.experts.127.down_proj.weight"]
    assert down.shape == (2048, 768) and down.decoded
    assert down.how == ("compressed-tensors pack-quantized int4 group 128 -> bf16" if qc == "w4a16" else
                        "compressed-tensors float-quantized fp8 e4m3 channel -> bf16 (activation quantization dropped)")
    assert lts["model.layers.0.self_attn.o_proj.weight"].shape == (2048, 4096)
    assert not lts["model.layers.0.mlp.gate.weight"].decoded
    assert sum(lt.decoded for lt in lts.values()) == 2 * (2 * 3 + 2)

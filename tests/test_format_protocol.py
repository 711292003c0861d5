"""The output-format slot holds what the README says: a format defined in this file alone (nothing in ``expq/``
names it), registered with one line (``FORMATS[name] = cls``), goes through convert, inspect, verify, expq's loader and
transformers after ``import expq``, and its tensors carry exactly the codes and scales experts-int8 carries."""

from __future__ import annotations

import json
import re
from typing import ClassVar

import pytest
import torch
from helpers import converted_factory, decode_output, example, load_hf, read_tensors, rel

import expq
from expq.engines.clients import expq_clients
from expq.errors import ExpqError, UsageError
from expq.formats import FORMATS
from expq.formats.base import TensorRole, TensorSpec

FAMILY = "mixtral"
IDS = torch.randint(2, 300, (2, 16), generator=torch.Generator().manual_seed(1))


class ToyInt8Format:
    """int8 codes under ``M.qweight`` [out, in] and the scales in the compute dtype under ``M.qscale`` [out]; the
    experts-int8 markers, so that stock transformers refuses it."""

    name: ClassVar[str] = "toy-int8"
    quant_method: ClassVar[str] = "toy_int8"
    expq_loads: ClassVar[bool] = True
    suffixes: ClassVar[dict[str, str]] = {"codes": "qweight", "scale": "qscale"}
    _DTYPES: ClassVar[dict] = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

    def __init__(self, experts, compute_dtype):
        self.experts, self.compute_dtype = experts, compute_dtype

    def _markers(self) -> dict[str, int]:
        return {self.experts.stock_weight_name(L): L for L in self.experts.moe_layers}

    def tensor_specs(self, matrix):
        m = matrix.module
        specs = [TensorSpec(f"{m}.qweight", "I8", (matrix.rows, matrix.cols)),
                 TensorSpec(f"{m}.qscale", self._DTYPES[self.compute_dtype], (matrix.rows,))]
        if matrix.expert == 0 and matrix.proj == "gate":
            specs.append(TensorSpec(self.experts.stock_weight_name(matrix.layer), "I8", (0,), value=b""))
        return specs

    def encode(self, codes, scales, matrices):
        out, r0 = [], 0
        for m in matrices:
            c_spec, s_spec = self.tensor_specs(m)[:2]
            out.append([(c_spec, codes[r0:r0 + m.rows]), (s_spec, scales[r0:r0 + m.rows].to(self.compute_dtype))])
            r0 += m.rows
        return out

    def describe(self):
        return "Stored as toy-int8: `qweight` int8 [out, in] and `qscale` [out] in the compute dtype."

    def decode(self, module, read):
        codes, scale = read(f"{module}.qweight"), read(f"{module}.qscale")
        if codes.dtype != torch.int8 or scale.shape != codes.shape[:1]:
            raise ValueError(f"qweight {codes.dtype} {list(codes.shape)} and qscale {list(scale.shape)} do not fit")
        return codes, scale

    def classify(self, name):
        module, _, suffix = name.rpartition(".")
        role = {"qweight": "codes", "qscale": "scale"}.get(suffix)
        key = self.experts.parse_module(module) if role else None
        if key is not None:
            return TensorRole(*key, role)
        layer = self._markers().get(name)
        return None if layer is None else TensorRole(layer, -1, "", "marker")

    def quantized_modules(self, names):
        return self.experts.modules_with(names, "qweight")

    def targets(self):
        return ["re:.*" + re.escape(self.experts.layout.targets_container) + r"\.\d+\..*$"]

    def quantization_config(self, tensors):
        return {"quant_method": self.quant_method, "format": self.name, "targets": self.targets()}

    def check_model(self, config, *, use_cache=True):
        return []

    def check_config(self, config, tensors):
        want = self.quantization_config(tensors)
        return [] if config == want else [f"quantization_config {config} is not {want}"]

    def clients(self, layout, hidden_size, *, local=False):
        return expq_clients(self, layout, hidden_size, local=local)


@pytest.fixture
def toy(monkeypatch):
    """The toy format registered as a user registers one (and taken out again after the test)."""
    monkeypatch.setitem(FORMATS, ToyInt8Format.name, ToyInt8Format)
    return ToyInt8Format


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory):
    return converted_factory(tmp_path_factory, "proto-ei8", format="experts-int8")


def test_toy_format_converts_verifies_and_loads(toy, int8_out, tmp_path, tmp_path_factory):
    src, int8 = int8_out(FAMILY)
    out = tmp_path / "toy"
    plan = expq.inspect(src, format=toy.name)
    summary = plan.summary()
    assert summary["format"] == toy.name
    loads = {c["engine"]: c["loads"] for c in summary["clients"]}
    assert loads == {"vLLM": False, "SGLang": False, "transformers": True, "expq": True}, loads

    expq.convert(src, out, format=toy.name, device="cpu")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == toy.quant_method
    assert json.loads((out / "expq.json").read_text())["format"] == toy.name
    tensors = read_tensors(out)
    ref = decode_output(int8)  # the experts-int8 output of the same source: codes [out, in], fp32 scales [out]
    for codes, scales, module in ref.values():
        assert torch.equal(tensors[f"{module}.qweight"], codes), module
        assert tensors[f"{module}.qscale"].dtype == torch.bfloat16, module
        assert torch.equal(tensors[f"{module}.qscale"].float(), scales), module
    assert not any(n.endswith((".weight_int8", ".weight_scale")) for n in tensors)

    report = expq.verify(out, source=src)
    assert report.ok, report.verdict

    model = expq.load_model(out, device="cpu")
    hf = load_hf(out)  # transformers, through expq's quantizer registered under toy_int8
    int8_model = expq.load_model(int8, device="cpu")
    assert any(getattr(m, "expq_int8", False) for m in hf.modules())
    with torch.no_grad():
        want = int8_model(IDS).logits
        assert torch.equal(model(IDS).logits, want)
        assert rel(hf(IDS).logits, want) < 1e-6


def test_toy_format_negative_control(toy, tmp_path, tmp_path_factory):
    """verify sees a wrong toy tensor (the format's decode feeds it), and a checkpoint whose format is no longer
    registered is refused with one line naming it."""
    src = example(tmp_path_factory, FAMILY)
    out = tmp_path / "toy"
    expq.convert(src, out, format=toy.name, device="cpu")
    from safetensors.torch import load_file, save_file

    shard = next(f for f in sorted(out.glob("*.safetensors")) if any(k.endswith(".qweight") for k in load_file(f)))
    t = load_file(shard)
    name = next(k for k in t if k.endswith(".qweight"))
    t[name] = t[name].clone()
    t[name][0, 0] = t[name][0, 0] ^ 1
    save_file(t, shard, metadata={"format": "pt"})
    report = expq.verify(out, source=src)
    failed = {c.name for c in report.checks if not c.ok}
    assert "experts: bits equal re-quantized source" in failed, report.checks
    del FORMATS[toy.name]
    with pytest.raises(ExpqError, match="'toy-int8' is not an expq output format"):
        expq.load_experts(out, layer=0)
    with pytest.raises(UsageError, match="unknown --format 'toy-int8'"):
        expq.inspect(src, format=toy.name)


def test_registration_checks_the_name():
    with pytest.raises(ValueError, match="named 'toy-int8', registered as 'toy'"):
        FORMATS["toy"] = ToyInt8Format
    assert "toy" not in FORMATS

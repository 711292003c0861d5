"""CPU tests of the tuned-config tables of the fused-MoE kernel (expq.kernels.tuned, get_config).

No GPU here: the running GPU's name is faked (``tuned._GPU_NAMES``) and tables are written to a temporary directory
given by ``EXPQ_KERNEL_CONFIGS``. What is checked: an exact entry is used; the nearest token bucket is chosen (ties
to the smaller); an unknown GPU, an unknown shape, another dtype, CPU, ``tuned=False``, ``off``, a file not marked
measured and a malformed file all give today's default bit for bit; no table file is shipped in the package.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from expq.kernels import moe as moe_mod
from expq.kernels import tuned

SHAPE = dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)
CFG_A = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=8, num_stages=3)
CFG_B = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=4, num_stages=5)
CFG_C = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


def default_config(t, e, top_k):
    """Today's rule, written out independently of get_config: _CONFIG_TABLE by pairs per expert."""
    per_expert = t * top_k / e
    for limit, cfg in moe_mod._CONFIG_TABLE:
        if per_expert <= limit:
            return dict(cfg)
    raise AssertionError


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake CUDA GPU named 'NVIDIA H200' with a table directory tmp_path; returns a writer of its table."""
    monkeypatch.setattr(tuned, "_GPU_NAMES", {None: "NVIDIA H200", 0: "NVIDIA H200", 1: "Other GPU"})
    monkeypatch.setenv(tuned.ENV, str(tmp_path))
    tuned.clear_cache()

    def write(shapes, measured=True, name="NVIDIA_H200", fmt=tuned.FORMAT, raw=None):
        data = raw if raw is not None else dict(format=fmt, measured=measured, gpu="NVIDIA H200", meta={},
                                                shapes=shapes)
        (tmp_path / f"{name}.json").write_text(data if isinstance(data, str) else json.dumps(data))
        tuned.clear_cache()

    yield write
    tuned.clear_cache()


def call(t, device="cuda", dtype=torch.bfloat16, **kw):
    return moe_mod.get_config(t, SHAPE["num_experts"], SHAPE["top_k"], device, hidden_size=SHAPE["hidden_size"],
                              intermediate_size=SHAPE["intermediate_size"], dtype=dtype, **kw)


KEY = tuned.shape_key(128, 2048, 768, 8, torch.bfloat16)


def test_names():
    assert tuned.normalize_gpu_name("NVIDIA H200") == "NVIDIA_H200"
    assert tuned.normalize_gpu_name(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3"
    assert tuned.normalize_gpu_name("AMD Instinct MI300X/VF") == "AMD_Instinct_MI300X_VF"
    assert KEY == "E=128,H=2048,I=768,top_k=8,dtype=bfloat16"
    assert tuned.shape_key(128, 2048, 768, 8, "bfloat16") == KEY


def test_no_table_is_shipped():
    """Nothing measured yet: the package holds no table, so every GPU gets the default."""
    assert not list(tuned.CONFIG_DIR.glob("*.json"))
    assert (tuned.CONFIG_DIR / "README.md").is_file()


def test_exact_entry_and_buckets(gpu):
    gpu({KEY: {"1": CFG_A, "32": CFG_B, "1024": CFG_C}})
    assert call(1) == CFG_A
    assert call(16) == CFG_A  # |16-1| = 15 < |16-32| = 16
    assert call(17) == CFG_B  # 16 vs 15
    assert call(528) == CFG_B  # |528-32| = 496 == |528-1024| = 496: tie to the smaller bucket
    assert call(529) == CFG_C
    assert call(100000) == CFG_C
    out = call(1)
    out["BLOCK_SIZE_M"] = 999  # a new dict each time
    assert call(1) == CFG_A
    # through the pipeline's call site: the same keyword arguments
    assert call(1, device="cuda:0") == CFG_A


@pytest.mark.parametrize("t", [1, 8, 32, 128, 1024, 4096, 3])
def test_fallbacks_are_todays_default(gpu, t):
    gpu({KEY: {"1": CFG_A, "4096": CFG_C}})
    e, top_k = SHAPE["num_experts"], SHAPE["top_k"]
    want = default_config(t, e, top_k)
    assert call(t, device="cuda:1") == want  # another GPU: no file
    assert call(t, dtype=torch.float16) == want  # another dtype
    assert moe_mod.get_config(t, e, top_k, "cuda", hidden_size=4096, intermediate_size=768,
                              dtype=torch.bfloat16) == want  # another shape
    assert moe_mod.get_config(t, e, top_k, "cuda") == want  # shape not given (the old signature)
    assert moe_mod.get_config(t, e, top_k) == want  # no device
    assert call(t, tuned=False) == want
    assert call(t, device="cpu") == moe_mod._INTERPRETER_CONFIG


def test_env_off(gpu, monkeypatch):
    gpu({KEY: {"1": CFG_A}})
    assert call(1) == CFG_A
    monkeypatch.setenv(tuned.ENV, "off")
    assert call(1) == default_config(1, 128, 8)


@pytest.mark.parametrize("bad", [
    dict(measured=False),
    dict(fmt="something-else/1"),
    dict(raw="{not json"),
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": 2}}),  # a knob the kernel does not have
    dict(shapes_entry={"1": {k: v for k, v in CFG_A.items() if k != "num_stages"}}),
    dict(shapes_entry={"1": {**CFG_A, "BLOCK_SIZE_N": 48}}),
    dict(shapes_entry={"1": {**CFG_A, "BLOCK_SIZE_M": 8}}),
    dict(shapes_entry={"x": CFG_A}),
    dict(shapes_entry={}),
])
def test_unusable_file_is_ignored_whole(gpu, bad):
    entry = bad.pop("shapes_entry", None)
    shapes = {KEY: entry if entry is not None else {"1": CFG_A},
              tuned.shape_key(8, 4096, 14336, 2, "bfloat16"): {"1": CFG_B}}
    gpu(shapes, **bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert call(1) == default_config(1, 128, 8)
        assert moe_mod.get_config(1, 8, 2, "cuda", hidden_size=4096, intermediate_size=14336,
                                  dtype=torch.bfloat16) == default_config(1, 8, 2)
    assert sum("ignoring the kernel config table" in str(w.message) for w in caught) == 1  # read once


def test_no_cuda_no_lookup(monkeypatch, tmp_path):
    """Without the fake name, on this CPU machine: a CUDA device string still gives the default (no crash)."""
    monkeypatch.setattr(tuned, "_GPU_NAMES", {})
    tuned.clear_cache()
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert call(1) == default_config(1, 128, 8)
    assert call(4096) == default_config(4096, 128, 8)


def test_check_config():
    assert tuned.check_config(CFG_A) == CFG_A
    for bad in ({**CFG_A, "num_warps": 3}, {**CFG_A, "num_stages": 0}, {**CFG_A, "GROUP_SIZE_M": 0},
                {**CFG_A, "BLOCK_SIZE_K": True}, [1, 2]):
        with pytest.raises(ValueError):
            tuned.check_config(bad)
    for _, cfg in moe_mod._CONFIG_TABLE:
        assert tuned.check_config(cfg) == cfg  # the defaults are valid entries
    assert math.isinf(moe_mod._CONFIG_TABLE[-1][0])


def test_tuner_on_the_interpreter(tmp_path):
    """bench/tune_kernel.py end to end on CPU (interpreter, a tiny shape, a two-config space): budget stop, resume,
    and a table that the lookup accepts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    space = json.dumps([dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4,
                             num_stages=1)])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    cmd = [sys.executable, str(repo / "bench" / "tune_kernel.py"), "--device", "cpu", "--shapes", "4,32,16,2",
           "--tokens", "1", "3", "--out", str(tmp_path), "--space", space]

    def run(*extra):
        p = subprocess.run(cmd + list(extra), capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout + p.stderr

    assert "INCOMPLETE: 2 of 2 points left" in run("--budget-s", "0")
    assert "DONE: 2 points" in run()
    again = run()
    assert "2 already done" in again and "DONE: 2 points" in again
    data = json.loads((tmp_path / "cpu-interpreter.json").read_text())
    table = tuned._parse(data, None)
    rows = table["E=4,H=32,I=16,top_k=2,dtype=float16"]
    assert [b for b, _ in rows] == [1, 3]
    raw = json.loads((tmp_path / "cpu-interpreter.raw.json").read_text())
    for p in raw["points"].values():
        assert p["done"] and all(c["ok"] for c in p["checks"].values() if c is not None) and p["checks"]


def test_marlin_baseline_layout_and_skip():
    """bench/kernel_baselines.py: the compressed-tensors words in vLLM's transposed Marlin-MoE layout, and a clear
    Unavailable (not a crash) where vLLM is missing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import kernel_baselines as kb
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    w13 = torch.randint(-127, 128, (3, 2 * 64, 128), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (3, 128, 64), dtype=torch.int8, generator=g)
    s13, s2 = torch.rand(3, 128, generator=g), torch.rand(3, 128, generator=g)
    keep = w13.clone(), w2.clone()
    p13, p2, c13, c2 = kb.compressed_tensors_marlin_layout(w13, w2, s13, s2, torch.bfloat16)
    assert torch.equal(w13, keep[0]) and torch.equal(w2, keep[1])  # inputs untouched
    assert p13.shape == (3, 32, 128) and p2.shape == (3, 16, 128) and c13.shape == (3, 1, 128)
    for e in range(3):
        gate, up = pack_to_int32(w13[e, :64].clone(), 8), pack_to_int32(w13[e, 64:].clone(), 8)
        assert torch.equal(p13[e], torch.cat([gate, up]).t())
        assert torch.equal(p2[e], pack_to_int32(w2[e].clone(), 8).t())
    assert torch.equal(c2[:, 0], s2.to(torch.bfloat16))
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        for build in kb.BASELINES.values():
            with pytest.raises(kb.Unavailable, match="not importable"):
                build(w13=w13, w2=w2, s13=s13, s2=s2, w13_bf=None, w2_bf=None, dtype=torch.bfloat16)

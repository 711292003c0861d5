"""CPU tests of the tuned-config tables of the fused-MoE kernel (expq.kernels.tuned, get_config).

No GPU here: the running GPU's name is faked (``tuned._GPU_NAMES``) and tables are written to a temporary directory
given by ``EXPQ_KERNEL_CONFIGS`` (the package's own directory hidden). What is checked: an exact entry is used; the nearest token bucket is chosen (ties
to the smaller); an unknown GPU, an unknown shape, another dtype, CPU, ``tuned=False``, ``off``, a file not marked
measured and a malformed file all give today's default bit for bit; entries may set SPLIT_K / SWAP_AB or leave them
out (1 / False); FUSE_ACT likewise; the shipped H200 table is whole, valid and used on an H200 only. Configs are compared through ``tuned.check_config`` (all
nine keys) wherever the built-in defaults are involved, so the tests do not depend on whether ``_CONFIG_TABLE``
spells out SPLIT_K and SWAP_AB.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from expq.errors import visible
from expq.kernels import moe as moe_mod
from expq.kernels import tuned

SHAPE = dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)
CFG_A = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=8, num_stages=3)
CFG_B = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=4, num_stages=5)
CFG_C = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)
CFG_D = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4,
             SPLIT_K=4, SWAP_AB=True)
NEW_KEYS = dict(SPLIT_K=1, SWAP_AB=False, FUSE_ACT=False)


def full(cfg):
    """A 6-key config as get_config / lookup return it: with SPLIT_K 1, SWAP_AB and FUSE_ACT False."""
    return {**cfg, **{k: v for k, v in NEW_KEYS.items() if k not in cfg}}


def default_config(t, e, top_k, raw=False):
    """Today's rule, written out independently of get_config: _CONFIG_TABLE by pairs per expert (through
    check_config, unless ``raw``: the table's dict as it is)."""
    per_expert = t * top_k / e
    for limit, cfg in moe_mod._CONFIG_TABLE:
        if per_expert <= limit:
            return dict(cfg) if raw else tuned.check_config(cfg)
    raise AssertionError


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake CUDA GPU named 'NVIDIA H200' with a table directory tmp_path; returns a writer of its table."""
    monkeypatch.setattr(tuned, "_GPU_NAMES", {None: "NVIDIA H200", 0: "NVIDIA H200", 1: "Other GPU"})
    monkeypatch.setenv(tuned.ENV, str(tmp_path))
    # the package's own tables (the shipped NVIDIA_H200.json) are searched after EXPQ_KERNEL_CONFIGS: hide them
    empty = tmp_path / "package-configs"
    empty.mkdir()
    monkeypatch.setattr(tuned, "CONFIG_DIR", empty)
    tuned.clear_cache()

    def write(shapes, measured=True, name="NVIDIA_H200", fmt=tuned.FORMAT, raw=None):
        data = raw if raw is not None else dict(format=fmt, measured=measured, gpu="NVIDIA H200", meta={},
                                                shapes=shapes)
        (tmp_path / f"{name}.json").write_text(data if isinstance(data, str) else json.dumps(data))
        tuned.clear_cache()

    yield write
    tuned.clear_cache()


@pytest.fixture
def tuned_log():
    """The messages of the kernels' logger (``tuned.LOGGER``), from a handler of its own (whatever the process's
    logging: a real vLLM's, pytest's)."""

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    lines: list[tuple[str, str]] = []
    handler = Collect(logging.WARNING)
    logger = logging.getLogger(tuned.LOGGER)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def raw_call(t, device="cuda", dtype=torch.bfloat16, **kw):
    return moe_mod.get_config(t, SHAPE["num_experts"], SHAPE["top_k"], device, hidden_size=SHAPE["hidden_size"],
                              intermediate_size=SHAPE["intermediate_size"], dtype=dtype, **kw)


def call(t, device="cuda", dtype=torch.bfloat16, **kw):
    """get_config's answer through check_config (all nine keys, a built-in default with or without the new three)."""
    return tuned.check_config(raw_call(t, device, dtype, **kw))


def get_config(*args, **kw):
    return tuned.check_config(moe_mod.get_config(*args, **kw))


KEY = tuned.shape_key(128, 2048, 768, 8, torch.bfloat16)


def test_names():
    assert tuned.normalize_gpu_name("NVIDIA H200") == "NVIDIA_H200"
    assert tuned.normalize_gpu_name(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3"
    assert tuned.normalize_gpu_name("AMD Instinct MI300X/VF") == "AMD_Instinct_MI300X_VF"
    assert KEY == "E=128,H=2048,I=768,top_k=8,dtype=bfloat16"
    assert tuned.shape_key(128, 2048, 768, 8, "bfloat16") == KEY


ISSUE13_SHAPES = {(8, 4096, 14336, 2), (128, 2048, 768, 8), (256, 7168, 2048, 8)}


def test_shipped_h200_table(monkeypatch, tuned_log):
    """The committed table (bench/tune_kernel.py on one H200, docs/benchmarks.md): readable as a whole, marked
    measured, one entry per issue-13 point (3 shapes x 6 token buckets, bf16), and for the two shapes served by
    bench/serve.py the batch sizes vLLM runs them at (16, 64, 256, 512, 2048 and 16384 tokens: issue 26), each a valid
    config; and get_config on an H200 returns its entries (the built-in default elsewhere)."""
    path = tuned.CONFIG_DIR / "NVIDIA_H200.json"
    data = json.loads(path.read_text())
    assert data["measured"] is True and data["gpu"] == "NVIDIA H200"
    assert data["meta"]["tuner"] == "bench/tune_kernel.py" and data["meta"]["triton"]
    monkeypatch.delenv(tuned.ENV, raising=False)
    monkeypatch.setattr(tuned, "_GPU_NAMES", {None: "NVIDIA H200", 0: "NVIDIA H200", 1: "Other GPU"})
    tuned.clear_cache()
    table = tuned.load_table("NVIDIA H200")
    assert tuned_log == []
    shapes = {tuple(int(f.split("=")[1]) for f in k.split(",")[:4]) for k in table}
    assert shapes == ISSUE13_SHAPES
    served = {tuned.shape_key(8, 4096, 14336, 2, "bfloat16"), tuned.shape_key(128, 2048, 768, 8, "bfloat16")}
    for key, rows in table.items():
        issue13 = [1, 8, 32, 128, 1024, 4096]
        want = sorted(issue13 + [16, 64, 256, 512, 2048, 16384]) if key in served else issue13
        assert key.endswith("dtype=bfloat16") and [b for b, _ in rows] == want, key
    e, h, i, k = 8, 4096, 14336, 2
    entry = data["shapes"][tuned.shape_key(e, h, i, k, torch.bfloat16)]["1"]
    got = moe_mod.get_config(1, e, k, "cuda", hidden_size=h, intermediate_size=i, dtype=torch.bfloat16)
    assert got == tuned.check_config(entry)
    other = moe_mod.get_config(1, e, k, "cuda:1", hidden_size=h, intermediate_size=i, dtype=torch.bfloat16)
    assert tuned.check_config(other) == tuned.check_config(default_config(1, e, k))
    tuned.clear_cache()
    assert (tuned.CONFIG_DIR / "README.md").is_file()


def test_exact_entry_and_buckets(gpu):
    gpu({KEY: {"1": CFG_A, "32": CFG_B, "1024": CFG_C}})
    assert raw_call(1) == full(CFG_A)  # a table entry: all nine keys, whatever the default table holds
    assert raw_call(16) == full(CFG_A)  # |16-1| = 15 < |16-32| = 16
    assert raw_call(17) == full(CFG_B)  # 16 vs 15
    assert raw_call(528) == full(CFG_B)  # |528-32| = 496 == |528-1024| = 496: tie to the smaller bucket
    assert raw_call(529) == full(CFG_C)
    assert raw_call(100000) == full(CFG_C)
    assert list(raw_call(1)) == list(tuned.CONFIG_KEYS)
    out = raw_call(1)
    out["BLOCK_SIZE_M"] = 999  # a new dict each time
    assert raw_call(1) == full(CFG_A)
    # through the pipeline's call site: the same keyword arguments
    assert raw_call(1, device="cuda:0") == full(CFG_A)


def test_split_k_and_swap_ab_entries(gpu):
    """An entry with SPLIT_K / SWAP_AB is returned as written (JSON true -> True); one without them (a table written
    before the kernel had them) gets 1 / False."""
    gpu({KEY: {"1": CFG_D, "32": CFG_B, "1024": {**CFG_C, "SWAP_AB": False, "SPLIT_K": 16}}})
    got = raw_call(1)
    assert got == full(CFG_D) and got["SPLIT_K"] == 4 and got["SWAP_AB"] is True
    got = raw_call(32)
    assert got == full(CFG_B) and got["SWAP_AB"] is False and got["FUSE_ACT"] is False
    assert raw_call(4096) == full({**CFG_C, "SPLIT_K": 16, "SWAP_AB": False})


@pytest.mark.parametrize("t", [1, 8, 32, 128, 1024, 4096, 3])
def test_fallbacks_are_todays_default(gpu, t):
    gpu({KEY: {"1": CFG_A, "4096": CFG_C}})
    e, top_k = SHAPE["num_experts"], SHAPE["top_k"]
    want = default_config(t, e, top_k)
    assert call(t, device="cuda:1") == want  # another GPU: no file
    assert call(t, dtype=torch.float16) == want  # another dtype
    assert get_config(t, e, top_k, "cuda", hidden_size=4096, intermediate_size=768,
                      dtype=torch.bfloat16) == want  # another shape
    assert get_config(t, e, top_k, "cuda") == want  # shape not given (the old signature)
    assert get_config(t, e, top_k) == want  # no device
    assert call(t, tuned=False) == want
    assert raw_call(t, device="cuda:1") == default_config(t, e, top_k, raw=True)  # bit for bit: _CONFIG_TABLE's
    assert raw_call(t, device="cpu") == moe_mod._INTERPRETER_CONFIG


def test_env_off(gpu, monkeypatch):
    gpu({KEY: {"1": CFG_A}})
    assert call(1) == full(CFG_A)
    monkeypatch.setenv(tuned.ENV, "off")
    assert call(1) == default_config(1, 128, 8)


@pytest.mark.parametrize("bad", [
    dict(measured=False),
    dict(fmt="something-else/1"),
    dict(raw="{not json"),
    dict(shapes_entry={"1": {**CFG_A, "BLOCK_SIZE_Q": 2}}),  # a knob the kernel does not have
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": 3}}),  # not a power of two
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": 32}}),  # > 16
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": 0}}),
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": True}}),  # a bool is not an integer here
    dict(shapes_entry={"1": {**CFG_A, "SPLIT_K": 2.0}}),
    dict(shapes_entry={"1": {**CFG_A, "SWAP_AB": 1}}),  # JSON true / false only
    dict(shapes_entry={"1": {**CFG_A, "SWAP_AB": "true"}}),
    dict(shapes_entry={"1": {**CFG_A, "SWAP_AB": None}}),
    dict(shapes_entry={"1": {k: v for k, v in CFG_A.items() if k != "num_stages"}}),
    dict(shapes_entry={"1": {**CFG_A, "BLOCK_SIZE_N": 48}}),
    dict(shapes_entry={"1": {**CFG_A, "BLOCK_SIZE_M": 8}}),
    dict(shapes_entry={"x": CFG_A}),
    dict(shapes_entry={}),
])
def test_unusable_file_is_ignored_whole(gpu, bad, tuned_log):
    entry = bad.pop("shapes_entry", None)
    shapes = {KEY: entry if entry is not None else {"1": CFG_A},
              tuned.shape_key(8, 4096, 14336, 2, "bfloat16"): {"1": CFG_B}}
    gpu(shapes, **bad)
    assert call(1) == default_config(1, 128, 8)
    assert get_config(1, 8, 2, "cuda", hidden_size=4096, intermediate_size=14336,
                      dtype=torch.bfloat16) == default_config(1, 8, 2)
    assert len(tuned_log) == 1 and tuned_log[0][0] == "WARNING"  # read once
    assert tuned_log[0][1].startswith(f"expq: ignoring the kernel config table {visible(os.environ[tuned.ENV])}"
                                      "/NVIDIA_H200.json: ")


def test_an_unusable_file_is_one_line_on_stderr_outside_vllm(tmp_path):
    """Outside vLLM (``expq verify``, ``load_model``: nothing configures logging), the warning is one line on
    stderr, once per process, its path's control characters escaped."""
    folder = tmp_path / "tables\nINFO forged\x1b[31m"
    folder.mkdir()
    (folder / "NVIDIA_H200.json").write_text("{not json")
    code = ("import torch; from expq.kernels import moe, tuned; tuned._GPU_NAMES[None] = 'NVIDIA H200'\n"
            "for t in (1, 8, 64): moe.get_config(t, 8, 2, 'cuda', hidden_size=64, intermediate_size=32, "
            "dtype=torch.bfloat16)")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, tuned.ENV: str(folder)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [
        f"expq: ignoring the kernel config table {tmp_path}/tables\\nINFO forged\\x1b[31m/NVIDIA_H200.json: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"]


def test_no_cuda_no_lookup(monkeypatch, tmp_path):
    """Without the fake name, on this CPU machine: a CUDA device string still gives the default (no crash)."""
    monkeypatch.setattr(tuned, "_GPU_NAMES", {})
    tuned.clear_cache()
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert call(1) == default_config(1, 128, 8)
    assert call(4096) == default_config(4096, 128, 8)


def test_check_config():
    assert tuned.check_config(CFG_A) == full(CFG_A)
    assert list(tuned.check_config(CFG_A)) == list(tuned.CONFIG_KEYS)
    assert tuned.check_config(CFG_D) == full(CFG_D)
    assert tuned.check_config(CFG_D) is not CFG_D
    keep = dict(CFG_A)
    tuned.check_config(keep)
    assert keep == CFG_A  # the argument is not filled in
    for sk in (1, 2, 4, 8, 16):
        assert tuned.check_config({**CFG_A, "SPLIT_K": sk})["SPLIT_K"] == sk
    assert tuned.check_config({**CFG_A, "SWAP_AB": True}) == full({**CFG_A, "SWAP_AB": True})
    for m in (128, 256):  # 256 rows: refused with SWAP_AB only
        assert tuned.check_config({**CFG_A, "BLOCK_SIZE_M": m})["BLOCK_SIZE_M"] == m
    assert tuned.check_config({**CFG_A, "BLOCK_SIZE_M": 128, "SWAP_AB": True})["SWAP_AB"] is True
    assert tuned.check_config({**CFG_A, "FUSE_ACT": True}) == full({**CFG_A, "FUSE_ACT": True})
    for bad, word in (({**CFG_A, "num_warps": 3}, "num_warps"), ({**CFG_A, "num_stages": 0}, "num_stages"),
                      ({**CFG_A, "GROUP_SIZE_M": 0}, "GROUP_SIZE_M"), ({**CFG_A, "BLOCK_SIZE_K": True}, "BLOCK_SIZE_K"),
                      ([1, 2], "object"), ({**CFG_A, "SPLIT_K": 3}, "SPLIT_K"), ({**CFG_A, "SPLIT_K": 32}, "SPLIT_K"),
                      ({**CFG_A, "SPLIT_K": 0}, "SPLIT_K"), ({**CFG_A, "SPLIT_K": True}, "SPLIT_K"),
                      ({**CFG_A, "SWAP_AB": 1}, "SWAP_AB"), ({**CFG_A, "SWAP_AB": 0}, "SWAP_AB"),
                      ({**CFG_A, "SWAP_AB": "false"}, "SWAP_AB"), ({**CFG_A, "split_k": 2}, "unknown"),
                      ({**CFG_A, "FUSE_ACT": 1}, "FUSE_ACT"), ({**CFG_A, "FUSE_ACT": True, "SWAP_AB": True}, "FUSE_ACT"),
                      ({**CFG_A, "BLOCK_SIZE_M": 256, "SWAP_AB": True}, "SWAP_AB: needs BLOCK_SIZE_M < 256")):
        with pytest.raises(ValueError, match=word):
            tuned.check_config(bad)
    for _, cfg in moe_mod._CONFIG_TABLE:
        assert tuned.check_config(cfg) == full(cfg)  # the defaults are valid entries
    assert tuned.check_config(moe_mod._INTERPRETER_CONFIG) == full(moe_mod._INTERPRETER_CONFIG)
    assert math.isinf(moe_mod._CONFIG_TABLE[-1][0])


@pytest.mark.slow  # bench/tune_kernel.py run five or six times, each in a fresh interpreter: make test-slow
def test_tuner_on_the_interpreter(tmp_path):
    """bench/tune_kernel.py end to end on CPU (interpreter, a tiny shape, a space of a config without SPLIT_K /
    SWAP_AB and one with SPLIT_K 2 and SWAP_AB, plus the default): budget stop, resume, and a table that the lookup
    accepts, with all nine keys."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    plain = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
    space = json.dumps([plain, {**plain, "SPLIT_K": 2, "SWAP_AB": True}])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    cmd = [sys.executable, str(repo / "bench" / "tune_kernel.py"), "--device", "cpu", "--shapes", "4,32,32,2",
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
    table = tuned.parse_table(data)
    rows = table["E=4,H=32,I=32,top_k=2,dtype=float16"]
    assert [b for b, _ in rows] == [1, 3]
    for _, cfg in rows:
        assert list(cfg) == list(tuned.CONFIG_KEYS)
    for entry in data["shapes"]["E=4,H=32,I=32,top_k=2,dtype=float16"].values():
        assert list(entry) == list(tuned.CONFIG_KEYS)  # written out in full
    raw = json.loads((tmp_path / "cpu-interpreter.raw.json").read_text())
    for p in raw["points"].values():
        assert p["done"] and all(c["ok"] for c in p["checks"].values() if c is not None) and p["checks"]
        assert {"M16_N16_K16_G2_w4_s1", "M16_N16_K16_G2_w4_s1_sk2_swap"} <= set(p["timings"]), p["timings"].keys()

    # --base: the written table keeps a base table's entries where this run tuned no point, and this run's win.
    other = "E=8,H=64,I=32,top_k=2,dtype=float16"
    base = dict(data, meta={"tuner": "earlier"}, shapes={other: {"4": plain}, "E=4,H=32,I=32,top_k=2,dtype=float16":
                                                          {"1": {**plain, "BLOCK_SIZE_N": 32}, "7": plain}})
    (tmp_path / "base.json").write_text(json.dumps(base))
    assert "DONE: 2 points" in run("--base", str(tmp_path / "base.json"))
    merged = json.loads((tmp_path / "cpu-interpreter.json").read_text())
    assert merged["shapes"][other] == {"4": tuned.check_config(plain)}
    mine = merged["shapes"]["E=4,H=32,I=32,top_k=2,dtype=float16"]
    assert list(mine) == ["1", "3", "7"] and mine["1"] == data["shapes"]["E=4,H=32,I=32,top_k=2,dtype=float16"]["1"]
    assert merged["meta"]["base"] == {"tuner": "earlier", "entries_kept": 2}
    (tmp_path / "bad.json").write_text(json.dumps(dict(base, gpu="NVIDIA H200")))
    p = subprocess.run(cmd + ["--base", str(tmp_path / "bad.json")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode != 0 and "a table for 'NVIDIA H200'" in p.stderr


@pytest.mark.slow  # bench/tune_kernel.py run five or six times, each in a fresh interpreter: make test-slow
def test_tuner_resume_keeps_the_base_and_drops_refused_configs(tmp_path):
    """A run started with --base and resumed without it still writes the base's entries; a raw file holding a
    config that check_config now refuses (an earlier space's) resumes without it (recorded as an error, never the
    winner); bad --tokens / --shapes are one clear line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    plain = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(repo))
    cmd = [sys.executable, str(repo / "bench" / "tune_kernel.py"), "--device", "cpu", "--shapes", "4,32,32,2",
           "--out", str(tmp_path), "--space", json.dumps([plain])]

    def run(*extra, ok=True):
        p = subprocess.run(cmd + list(extra), capture_output=True, text=True, env=env, timeout=300)
        assert (p.returncode == 0) == ok, p.stderr[-3000:]
        assert "Traceback" not in p.stderr
        return p.stdout + p.stderr

    other = "E=8,H=64,I=32,top_k=2,dtype=float16"
    base = dict(format=tuned.FORMAT, measured=True, gpu="cpu-interpreter", meta=None, shapes={other: {"04": plain}})
    (tmp_path / "base.json").write_text(json.dumps(base))
    assert "INCOMPLETE" in run("--tokens", "1", "--base", str(tmp_path / "base.json"), "--budget-s", "0")
    assert "DONE: 1 points" in run("--tokens", "1", "1")  # resumed without --base; one point, not two
    table = json.loads((tmp_path / "cpu-interpreter.json").read_text())
    assert table["shapes"][other] == {"4": tuned.check_config(plain)}  # the bucket written as an integer
    assert table["meta"]["base"] == {"entries_kept": 1}

    raw_path = tmp_path / "cpu-interpreter.raw.json"
    raw = json.loads(raw_path.read_text())
    point = next(iter(raw["points"].values()))
    bad = tuned.check_config(plain) | dict(BLOCK_SIZE_M=256, SWAP_AB=True)  # refused now; "fastest" in the file
    point["timings"]["M256_N16_K16_G2_w4_s1_swap"] = dict(cfg=bad, us=1e-3)
    point["done"] = False
    raw_path.write_text(json.dumps(raw))
    assert "DONE: 1 points" in run("--tokens", "1")
    raw = json.loads(raw_path.read_text())
    point = next(iter(raw["points"].values()))
    assert "M256_N16_K16_G2_w4_s1_swap" not in point["timings"]
    assert point["errors"]["M256_N16_K16_G2_w4_s1_swap"].startswith("refused: SWAP_AB")
    assert point["winner"]["BLOCK_SIZE_M"] == 16 and tuned.check_config(point["winner"]) == point["winner"]

    assert "--tokens: expected token counts >= 1" in run("--tokens", "0", ok=False)
    assert "expected E,H,I,top_k" in run("--tokens", "1", "--shapes", "4,32,32", ok=False)
    raw_path.write_text(raw_path.read_text()[:40])  # a truncated raw file: one line, not a traceback
    assert "not readable as this tuner's raw file" in run("--tokens", "1", ok=False)


def _tune_module():
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("tune_kernel_under_test", bench / "tune_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tuner_space():
    """bench/tune_kernel.py's search space: config ids, stage A (tiles x SWAP_AB, N 256 only for T >= 1024, what
    fits shared memory), stage B (num_warps x num_stages), SPLIT_K (only where GEMM2 has the K blocks, decode-sized
    groups only), and the size of the default run (what one device call of ~480 s is estimated on)."""
    tk = _tune_module()
    plain = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    assert tk.cfg_id(plain) == "M16_N64_K128_G1_w4_s4"  # the earlier tuner's ids: its raw files resume
    assert tk.cfg_id(tuned.check_config(plain)) == "M16_N64_K128_G1_w4_s4"
    assert tk.cfg_id({**plain, "SPLIT_K": 4, "SWAP_AB": True}) == "M16_N64_K128_G1_w4_s4_sk4_swap"
    assert tk.cfg_id({**plain, "SWAP_AB": True}) == "M16_N64_K128_G1_w4_s4_swap"
    assert tk.make_cfg(16, 64, 128, 1, 4, 4) == full(plain)
    assert tk.make_cfg(16, 64, 128, 1, 4, 4, 4, True) == full({**plain, "SPLIT_K": 4, "SWAP_AB": True})
    assert tk.cfg_id(tk.make_cfg(16, 64, 128, 1, 4, 4, fuse=True)) == "M16_N64_K128_G1_w4_s4_fuse"
    fused = tk.stage_fuse([tk.make_cfg(16, 64, 128, 1, 4, 4), tk.make_cfg(16, 64, 128, 1, 4, 4, swap=True)])
    assert [(c["BLOCK_SIZE_N"], c["FUSE_ACT"]) for c in sorted(fused, key=lambda c: c["BLOCK_SIZE_N"])] == \
        [(32, True), (64, True)]  # half and same N; never with SWAP_AB
    big = tk.stage_fuse([tk.make_cfg(128, 128, 64, 8, 4, 4)])  # two 128 x 128 accumulators: 8 warps, fewer stages
    assert [tk.cfg_id(c) for c in big] == [  # half N: two 128 x 64 accumulators, as many registers as unfused
        "M128_N64_K64_G8_w4_s4_fuse", "M128_N128_K64_G8_w8_s4_fuse", "M128_N128_K64_G8_w8_s3_fuse",
        "M128_N128_K64_G8_w8_s2_fuse"]
    assert all(tuned.check_config(c) == c for c in big)
    huge = tk.stage_fuse([tk.make_cfg(256, 128, 64, 8, 8, 3)])  # 256 x 128 fused: too big; 256 x 64: 8 warps
    assert [tk.cfg_id(c) for c in huge] == ["M256_N64_K64_G8_w8_s3_fuse", "M256_N64_K64_G8_w8_s2_fuse"]

    for per_expert, t in ((0.0625, 1), (64, 1024), (256, 4096), (32, 128)):
        a = tk.stage_a(per_expert, t, quick=False)
        ids = [tk.cfg_id(c) for c in a]
        assert len(ids) == len(set(ids))
        for c in a:
            m_n = c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"]
            assert tuned.check_config(c) == c and c["SPLIT_K"] == 1 and m_n <= tk.BIG_ACC
            assert c["num_warps"] == (8 if m_n >= tk.BIG_ACC else 4)  # 4 warps would spill a 128 x 256 accumulator
            assert tk.m_allowed(c["BLOCK_SIZE_M"], per_expert)
            assert tk.smem(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["num_stages"]) <= tk.SMEM_BYTES
            assert c["GROUP_SIZE_M"] == (8 if c["BLOCK_SIZE_M"] >= 64 else 1)
        tiles = {tk.tile_of(c)[:3] for c in a}
        assert all({tk.tile_of(c) for c in a} >= {tl + (False,)} | ({tl + (True,)} if tl[0] < 256 else set())
                   for tl in tiles)  # both SWAP_AB below 256 rows
        assert {c["BLOCK_SIZE_N"] for c in a} == ({64, 128, 256} if t >= 1024 else {64, 128})
        assert {c["BLOCK_SIZE_K"] for c in a} == {64, 128, 256}
        for c in tk.stage_a(per_expert, t, quick=True):
            assert c["BLOCK_SIZE_K"] == (64 if c["BLOCK_SIZE_M"] >= 64 else 128) and c["BLOCK_SIZE_N"] in (64, 128)
    assert len(tk.stage_a(0.0625, 1, quick=False)) == 12  # decode: BLOCK_SIZE_M 16 only, 2 N x 3 K x 2
    prefill = {tk.tile_of(c) for c in tk.stage_a(256, 4096, False)}
    assert (128, 256, 256, False) not in prefill  # no smem
    assert {(256, 128, 64, False), (128, 256, 64, True), (128, 256, 64, False)} <= prefill  # vLLM bf16's 128 x 256
    assert not any(m == n == 256 for m, n, _, _ in prefill)
    assert not any(swap and m >= tuned.SWAP_AB_MAX_BLOCK_M for m, _, _, swap in prefill)  # refused: wrong on GPU
    assert 256 not in {tk.tile_of(c)[0] for c in tk.stage_a(64, 1024, False)}  # 256 rows for 64 pairs: no

    b = tk.stage_b([(16, 64, 128, True), (64, 128, 64, False)], quick=False)
    assert len(b) == 12 and all(c["SPLIT_K"] == 1 for c in b)
    assert {(c["num_warps"], c["num_stages"]) for c in b} == {(4, 3), (4, 4), (8, 3), (8, 4)}
    assert {(c["BLOCK_SIZE_M"], c["GROUP_SIZE_M"]) for c in b} == {(16, 1), (64, 8), (64, 16)}
    big_b = tk.stage_b([(128, 256, 64, False)], quick=False)
    assert {c["num_warps"] for c in big_b} == {8} and all(
        tk.smem(128, 256, 64, c["num_stages"]) <= tk.SMEM_BYTES for c in big_b)
    assert {c["SWAP_AB"] for c in b if c["BLOCK_SIZE_M"] == 16} == {True}
    assert tk.stage_b([(16, 64, 128, True)], quick=True) == []

    best = [tk.make_cfg(16, 64, 128, 1, 8, 3, 1, True), tk.make_cfg(16, 64, 256, 1, 4, 4)]
    sk = tk.stage_split(best, 768, quick=False)  # cdiv(768, 128) = 6, cdiv(768, 256) = 3
    assert [tk.cfg_id(c) for c in sk] == ["M16_N64_K128_G1_w8_s3_sk2_swap", "M16_N64_K128_G1_w8_s3_sk4_swap",
                                          "M16_N64_K256_G1_w4_s4_sk2"]
    assert all(tuned.check_config(c) == c for c in sk)
    assert tk.split_allowed(16) and not tk.split_allowed(32)

    pl = tk.plan(tk.parse_shapes(list(tk.SHAPES)), list(tk.TOKENS), quick=False, refine=2,
                 default_of=lambda t, e, top_k: default_config(t, e, top_k))
    assert len(pl["points"]) == 18
    # The default run's budget (module docstring): about the size of the old --quick space.
    assert pl["search_timings_max"] + pl["final_timings_max"] <= 760
    assert pl["compiled_max"] <= 420 and pl["compiled_split_k_max"] <= 60
    quick = tk.plan(tk.parse_shapes(list(tk.SHAPES)), list(tk.TOKENS), quick=True, refine=1,
                    default_of=lambda t, e, top_k: default_config(t, e, top_k))
    assert quick["search_timings_max"] < pl["search_timings_max"] / 2 and quick["compiled_max"] < pl["compiled_max"] / 2


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

"""Test helpers: the literal reference of vLLM's experts_int8 function, cached fixture checkpoints, readers.

Everything here is written independently of expq's own code paths (its layouts, plan and pipeline), so that the
tests compare expq against an outside judge: the seed function, transformers' in-memory modules and safetensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from expq.examples import build_example


# --- the reference: vLLM's quantize_in_place_and_get_scales, literally ------------------------------------------
def seed_reference(weight: torch.Tensor, *, cuda_scalar_rule: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's experts_int8 function, step for step, on a copy of ``weight`` [out, in] (in its own dtype, on its own
    device): scales = max(|w|, dim=1) / 127; w /= scales; round; clamp to [-127, 127]; cast to int8.

    ``cuda_scalar_rule``: on a CPU, perform ``/ 127`` as CUDA does (multiply by fp32(1/127) in fp32, then round to
    the dtype) instead of the CPU's true division; needed for float32 only (README: CUDA's arithmetic).
    Returns (codes int8 [out, in], scales [out] in the dtype).
    """
    w = weight.clone()
    vmax = torch.iinfo(torch.int8).max
    amax = torch.max(torch.abs(w), dim=1, keepdim=True)[0]
    if cuda_scalar_rule:
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(vmax), dtype=torch.float32)
        scales = (amax.float() * inv.to(amax.device)).to(w.dtype)
    else:
        scales = amax / vmax
    w.div_(scales)
    w.round_()
    w.clamp_(-vmax, vmax)
    return w.to(torch.int8), scales[:, 0]


# --- fixture checkpoints, built once per session ------------------------------------------------------------------
_CACHE: dict[tuple, Path] = {}


def example(tmp_path_factory: pytest.TempPathFactory, family: str, dtype: torch.dtype = torch.bfloat16,
            **kw) -> Path:
    """A cached tiny ``family`` checkpoint (several shards). Never modify it: copy it first."""
    key = (family, dtype, tuple(sorted(kw.items())))
    if key not in _CACHE:
        d = tmp_path_factory.mktemp(f"src-{family}-{str(dtype).removeprefix('torch.')}")
        _CACHE[key] = build_example(family, d, dtype=dtype, max_shard_size="60KB", **kw)
    return _CACHE[key]


# --- reading checkpoints ------------------------------------------------------------------------------------------
def read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, through the safetensors library."""
    out = {}
    for f in sorted(Path(root).glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def tensor_files(root: Path) -> dict[str, str]:
    out = {}
    for f in sorted(Path(root).glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                out[k] = f.name
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> hex)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def unpack_int8(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Independent unpacking of compressed-tensors 8-bit packing: little-endian bytes, each code stored + 128."""
    b = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)[:, :cols]
    return (b.to(torch.int16) - 128).to(torch.int8)


# Output module names -> (layer, expert, projection), independent of expq's layout files.
_OUT_NAME = re.compile(r"(?:layers|blocks)\.(\d+)\..*?(?:experts|experts\.mlp)\.(\d+)\.(w1|w2|w3|v1|gate_proj|up_proj|"
                       r"down_proj)$")
PROJ_OF = {"w1": "gate", "gate_proj": "gate", "w3": "up", "v1": "up", "up_proj": "up", "w2": "down",
           "down_proj": "down"}


def decode_output(root: Path) -> dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor, str]]:
    """Quantized experts of an output dir: (layer, expert, proj) -> (codes [out, in], scales [out], module)."""
    tensors = read_tensors(root)
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_int8"):  # experts-int8: codes int8 [out, in] and fp32 scales [out], unpacked
            module = name[: -len(".weight_int8")]
            m = _OUT_NAME.search(module)
            assert m, f"unexpected quantized module name {module}"
            scale = tensors[module + ".weight_scale"]
            assert t.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (t.shape[0],), module
            out[(int(m[1]), int(m[2]), PROJ_OF[m[3]])] = (t, scale, module)
            continue
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        m = _OUT_NAME.search(module)
        assert m, f"unexpected quantized module name {module}"
        shape = tensors[module + ".weight_shape"].tolist()
        codes = unpack_int8(t, shape[1])
        scale = tensors[module + ".weight_scale"]
        assert scale.shape == (shape[0], 1), f"{module}.weight_scale shape {scale.shape}"
        out[(int(m[1]), int(m[2]), PROJ_OF[m[3]])] = (codes, scale[:, 0], module)
    return out


# In-memory expert parameters of each family's transformers modules (transformers 5.x), independent of expq:
# (gate_up or (gate, up) attribute, orientation, gate/up order, down attribute, orientation)
IN_MEMORY = {
    "default": ("gate_up_proj", "out_in", "concat", "down_proj", "out_in"),
    "llama4_text": ("gate_up_proj", "in_out", "concat", "down_proj", "in_out"),
    "gpt_oss": ("gate_up_proj", "in_out", "interleaved", "down_proj", "in_out"),
}


def model_expert_matrices(family: str, model) -> dict[tuple[int, int, str], torch.Tensor]:
    """(layer, expert, proj) -> [out, in] weight, read from the transformers model's own expert modules."""
    out = {}
    for name, mod in model.named_modules():
        m = re.search(r"(?:layers|blocks)\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward|ffn)\.experts$", name)
        if not m:
            continue
        L = int(m[1])
        if family == "dbrx":
            mlp = mod.mlp
            E = mod.num_experts if hasattr(mod, "num_experts") else model.config.ffn_config.moe_num_experts
            for part, attr, transposed in (("gate", "w1", False), ("up", "v1", False), ("down", "w2", True)):
                w = getattr(mlp, attr).detach().reshape(E, -1, getattr(mlp, attr).shape[-1])
                for e in range(E):
                    out[(L, e, part)] = w[e].T if transposed else w[e]
            continue
        gu_attr, gu_or, order, d_attr, d_or = IN_MEMORY.get(family, IN_MEMORY["default"])
        gu = getattr(mod, gu_attr).detach()
        dn = getattr(mod, d_attr).detach()
        for e in range(gu.shape[0]):
            g_u = gu[e] if gu_or == "out_in" else gu[e].T
            if order == "concat":
                gate, up = g_u.chunk(2, dim=0)
            else:
                gate, up = g_u[0::2], g_u[1::2]
            out[(L, e, "gate")], out[(L, e, "up")] = gate, up
            out[(L, e, "down")] = dn[e] if d_or == "out_in" else dn[e].T
    return out


def converted_factory(tmp_path_factory: pytest.TempPathFactory, tag: str, **convert_kw):
    """A function family -> (src, out) that converts each fixture once (cached per test module)."""
    import expq

    done: dict[str, tuple[Path, Path]] = {}

    def get(family: str):
        if family not in done:
            src = example(tmp_path_factory, family)
            out = tmp_path_factory.mktemp(f"{tag}-{family}") / "out"
            expq.convert(src, out, **{"device": "cpu", **convert_kw})
            done[family] = (src, out)
        return done[family]

    return get


def load_hf(path, **kw):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def dequantized_reference(family, src, out):
    """The source model with its experts replaced by the checkpoint's dequantized weights (transformers' own
    modules): what stock transformers gives where it can load the format, built here for every family."""
    model = load_hf(src)
    got = decode_output(out)
    with torch.no_grad():
        for name, mod in model.named_modules():
            m = re.search(r"(?:layers|blocks)\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward|ffn)\.experts$", name)
            if not m:
                continue
            L = int(m[1])
            deq = {k[1:]: (c.float() * s.float()[:, None]) for k, (c, s, _) in got.items() if k[0] == L}
            if family == "dbrx":
                E = len({e for e, _ in deq})
                for attr, p, tr in (("w1", "gate", False), ("v1", "up", False), ("w2", "down", True)):
                    w = getattr(mod.mlp, attr)
                    blocks = [deq[(e, p)].T if tr else deq[(e, p)] for e in range(E)]
                    w.copy_(torch.cat(blocks).to(w.dtype))
                continue
            gu_attr, gu_or, order, d_attr, d_or = IN_MEMORY.get(family, IN_MEMORY["default"])
            gu, dn = getattr(mod, gu_attr), getattr(mod, d_attr)
            for e in range(gu.shape[0]):
                g, u, d = deq[(e, "gate")], deq[(e, "up")], deq[(e, "down")]
                g_u = torch.cat([g, u]) if order == "concat" else torch.stack([g, u], 1).reshape(-1, g.shape[1])
                gu[e].copy_((g_u if gu_or == "out_in" else g_u.T).to(gu.dtype))
                dn[e].copy_((d if d_or == "out_in" else d.T).to(dn.dtype))
    return model


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()



def edit_shard_tensors(root: Path, name: str, fn) -> None:
    """Call ``fn(tensors)`` on the dict of tensors of the indexed shard that holds ``name``, and save it back."""
    from safetensors.torch import load_file, save_file

    idx = json.loads((Path(root) / "model.safetensors.index.json").read_text())["weight_map"]
    f = Path(root) / idx[name]
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def load_json(p: Path) -> dict:
    return json.loads(Path(p).read_text())


def run_cli(*args, timeout: int = 300) -> tuple[int, str]:
    """``python -m expq.cli ARGS`` in a real subprocess, stdin closed: (exit status, stdout + stderr)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "expq.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout + r.stderr


def start_cli(*args, fault: str | None = None, prelude: str | None = None):
    """``python -m expq.cli ARGS`` started in a real subprocess (stdout and stderr merged, unbuffered), with the
    ``EXPQ_FAULT`` rules ``fault`` (none unless given): the caller waits, signals or kills it. ``prelude``: Python
    statements run in that process before the CLI (e.g. a module constant set for a small fixture)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EXPQ_FAULT", None)
    if fault:
        env["EXPQ_FAULT"] = fault
    cmd = ["-m", "expq.cli"] if prelude is None else [
        "-c", f"{prelude}\nimport runpy, sys\nsys.argv = ['expq', *sys.argv[1:]]\n"
              "runpy.run_module('expq.cli', run_name='__main__', alter_sys=True)"]
    return subprocess.Popen([sys.executable, *cmd, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def reference_conversions(tmp_path_factory: pytest.TempPathFactory):
    """(a mixtral source, its conversion's digest, an earlier conversion of another family (olmoe), its digest):
    what a replacing conversion must leave as the complete old or the complete new checkpoint."""
    import expq

    src = example(tmp_path_factory, "mixtral")
    ref = tmp_path_factory.mktemp("ref") / "out"
    expq.convert(src, ref, device="cpu")
    old = tmp_path_factory.mktemp("old") / "out"
    expq.convert(example(tmp_path_factory, "olmoe"), old, device="cpu")
    return src, tree_digest(ref), old, tree_digest(old)


def count_row_absmax(monkeypatch: pytest.MonkeyPatch, decoder_class) -> list[bool]:
    """Wrap ``decoder_class.row_absmax`` for the test: the returned list gets, per call, whether it was offered
    (not None): a test then knows the front pass took its scales from it."""
    used: list[bool] = []
    row_absmax = decoder_class.row_absmax

    def counted(self, tensor, read, dim=-1):
        out = row_absmax(self, tensor, read, dim)
        used.append(out is not None)
        return out

    monkeypatch.setattr(decoder_class, "row_absmax", counted)
    return used

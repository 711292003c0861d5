"""Convert speed, peak memory and peak disk of expq against the I/O floor, a naive converter and llm-compressor,
on checkpoints with real architectures' shapes (issue 11's measurement contract).

    python bench/convert.py --model mixtral-8x7b[:LAYERS] [--model olmoe] [--model olmoe-x2] [--model tiny]
                            [--model qwen3-30b-a3b[:LAYERS]] [--model deepseek-v3[:LAYERS]]
                            [--model gpt-oss-120b[:LAYERS]]
                            [--variants floor,naive,llmc,expq-cpu,expq-cuda,expq-cuda:0,cuda:1,expq-stream,decode]
                            [--formats compressed-tensors,experts-int8] [--baseline DIR]
                            [--runs 3] [--work DIR] [--shard-size 5GB] [--source-format bf16|fp8|both]
                            [--json OUT.json] [--build-only] [--delete-sources-after]

Models (built once into ``--work`` with safetensors, random bf16 weights, one shard in memory at a time, a
config.json made by transformers' ``AutoConfig.for_model`` and a ``model.safetensors.index.json``; shards named
and filled as Hugging Face's ``save_pretrained`` does: tensors in state-dict order, a new shard when the next tensor
would pass ``--shard-size``, default 5GB as HF ships them; a build is reused when its ``.bench-complete`` marker
matches the spec):

* ``mixtral-8x7b[:LAYERS]``: Mixtral-8x7B at full width (hidden 4096, intermediate 14336, 8 experts, top-2,
  32 heads / 8 kv heads, vocab 32000), ``LAYERS`` decoder layers (default 2: 6.3 GB; 1 layer: 3.4 GB);
* ``olmoe[:LAYERS]``: OLMoE-1B-7B (hidden 2048, expert intermediate 1024, 64 experts, top-8, 16 heads, q/k norms,
  vocab 50304, 16 layers: 13.8 GB) with its real config keys (``model_type: olmoe``, ``num_experts``...), so that
  expq detects its ``olmoe`` layout; a smaller ``LAYERS`` is for checking the generator;
* ``olmoe-x2``: the same widths with 32 layers (27.6 GB): the peak-RSS-does-not-grow check, next to ``olmoe``;
* ``qwen3-30b-a3b[:LAYERS]``: Qwen3-30B-A3B (hidden 2048, expert intermediate 768, 128 experts, top-8, 32 heads /
  4 kv heads of 128, vocab 151936), 12 layers by default (16.2 GB);
* ``deepseek-v3[:LAYERS]``: DeepSeek-V3 as it ships, FP8 E4M3 with 128x128 F32 block scales on every projection
  (MLA attention, one dense layer then MoE layers of 256 experts of 7168 x 2048 and a shared expert), embeddings,
  norms and routers bf16; 2 layers by default (15.8 GB);
* ``gpt-oss-120b[:LAYERS]``: GPT-OSS-120B as it ships, MXFP4 routed experts (128 experts, 2880 x 2880) and the rest
  bf16; 4 layers by default (9.3 GB);
* ``tiny``: a 60 MB Mixtral-layout model in 16 MB shards; ``deepseek-v3-tiny``, ``gpt-oss-tiny``: the same for the
  two quantized layouts. All for smoke tests.

Weights are tiled from seeded random pools (bf16 ``0.02 N(0, 1)``, FP8 codes of block-quantized normals, uniform
MXFP4 nibbles with scales 2**-9..2**-3): fast to build, and the conversion's speed does not depend on the values.
Every expq variant runs once per output format (``--formats``); ``--baseline DIR`` runs each again with the expq
package found in DIR (another revision, e.g. ``git archive REV expq configs | tar -x -C DIR``), in DIR. Runs go
round by round (one run of each variant per round), so that a shared machine's load falls on all variants alike.

``--source-format fp8`` (or ``both``) also builds, one shard at a time, the checkpoint's FP8 twin as DeepSeek ships
FP8: every 2-D projection (``*_proj`` and Mixtral's ``w1/w2/w3``) F8_E4M3 with an F32 ``weight_scale_inv`` per
128x128 block (``s = amax / 448``, ``q = fp8(x / s)`` in fp32), everything else unchanged, the same shard files;
naive and llmc run on bf16 sources only, and ``decode`` (expq's decoder alone, nothing written) on quantized
sources only.

Variants. Each run is a fresh process started by a small meter process (below), after the source files were read
once more into the page cache (``cached`` says what fraction of them was resident just before the run; a source
larger than RAM cannot be), with its output folder removed beforehand; the figures are the median (seconds) and the
maximum (memory, disk) of ``--runs`` runs:

* ``floor``: start Python, import torch, read every source byte in 64 MiB reads, write as many bytes as expq's
  output holds (``expq inspect``'s ``bytes_out``), fsync: what no converter can beat.
* ``naive``: each whole shard through ``safetensors.torch.load_file``; every routed-expert matrix quantized with the
  seed formula in torch ops (``s = amax(|w|, dim=1) / 127``, ``q = clamp(round(w / s), -127, 127)``), packed by
  compressed-tensors' ``pack_to_int32``; ``save_file`` per shard, then fsync (so that every variant ends with its
  bytes on disk).
* ``llmc``: llm-compressor's ``model_free_ptq`` (``from llmcompressor import model_free_ptq``), run by the
  interpreter of ``bench/.venv-llmc`` (made by ``bench/setup_llmc.sh``), with a ``QuantizationScheme`` whose
  targets are the routed experts only (``re:.*experts\\.\\d+\\.(w1|w2|w3|gate_proj|up_proj|down_proj)$``), weights
  ``QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)``, ``format:
  pack-quantized``, ``max_workers=1`` (its default), ``device`` from ``--llmc-device`` (default cpu); the output
  files are fsynced after it returns (inside the timed process). It runs its shard jobs in the calling process
  (inline with one worker, a ThreadPoolExecutor's threads with more), never in worker processes; the meter checks
  that (``procs``). Where it is not installed or does not import, the row says why and the rest runs.
* ``expq-cpu``, ``expq-cuda``, ``expq-cuda:N``, ``expq-cuda:0,cuda:1``: the expq command line, ``python -m
  expq.cli convert SRC OUT --device D --json`` (start-up and imports count). For CUDA devices the same command line
  runs inside a wrapper (``expq.cli.main`` in the same process, ending as the console script does) that records
  ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of each device used: the allocator's peaks are
  visible only from inside. CUDA variants are skipped (with the reason) where torch sees no or too few GPUs.
* ``expq-stream[:DEVICE]``: a local Hub (``tests/hub_server.py``'s ``HubServer`` on 127.0.0.1, started in this
  process; the checkpoint committed to it as LFS files, hard-linked into its object store) and, in the child,
  ``expq.api.convert(REPO, OUT, device=DEVICE, stream=True)`` with ``HF_ENDPOINT`` pointing at it and an empty
  ``HF_HOME`` per run. Peak disk is the largest ``stream_peak_bytes`` the ConvertReport gives, and, measured from
  outside, the largest allocated size (``st_blocks``) of everything under the run's folder (``HF_HOME`` and OUT with
  its staging), sampled every 0.1 s. If ``expq.api.convert`` has no ``stream`` parameter, the row says "not
  available" and the rest runs.
* ``decode`` (quantized sources): expq's decoder alone on the conversion's thread pool and buffer pool: read
  every quantized weight and its scales, ``decode`` to bf16; ns per element of decoded output (wall time of the
  decode calls).

How each figure is measured:

* ``seconds``: wall time in the meter from spawning the variant's process to reaping it (so interpreter start-up
  and imports count), median of the runs; ``GB/s``: source bytes (all ``*.safetensors``) / seconds;
  ``x floor``: seconds / the floor's seconds of the same source.
* ``inside the conversion`` (expq rows): the ``seconds`` that ``expq convert --json`` reports, from its start to
  its commit, without the interpreter's start-up and imports (median of the runs; against the same floor).
* ``peak RSS``: the variant process's peak resident set as the kernel keeps it (``ru_maxrss`` from the meter's
  ``getrusage(RUSAGE_CHILDREN)``: the largest VmHWM of the process and any descendant it reaped; it starts no lower
  than the meter's own ~15 MB, ``meter_hwm``), max over runs. The meter also samples ``/proc`` every 0.05 s: the
  processes of the tree (``procs``) and the sum of their VmRSS; if a variant ever has more than one process, the
  peak RSS shown is the larger of ``ru_maxrss`` and that sampled sum, marked ``(tree)``.
* ``CPU s``: user + system CPU seconds of the process (``ru_utime + ru_stime``), median: on a shared machine, wall
  time well above it means the process waited (for the disk, or for cores others were using).
* ``peak GPU``: CUDA variants: ``max_memory_allocated`` / ``max_memory_reserved`` summed over the devices used,
  plus ``nvidia-smi`` used memory sampled every 0.1 s, less its value before the start (includes the CUDA context).
* ``peak disk``: ``expq-stream`` only, as above.
* Targets, each PASS or FAIL: expq on the CPU <= 1.3x the floor (the target is for the 2-core CPU runner), expq on
  GPUs <= 1.1x; every expq variant's peak RSS <= 2 source shards + 1 GiB (shard = the largest source shard file),
  shown for each model (run ``olmoe`` and ``olmoe-x2`` together for the twice-the-size line); ``expq-stream`` peak
  disk <= output + 3 source shards (output = the files expq wrote).

Output: a markdown table per model and source on stdout (the form of docs/benchmarks.md's), the target checks, and
with ``--json FILE`` every run's raw numbers and the machine (CPU model, cores, RAM, torch, GPUs, versions).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLMC_PYTHON = REPO / "bench" / ".venv-llmc" / "bin" / "python"


def repo_env() -> dict:
    """This environment with the repository first on PYTHONPATH (and whatever PYTHONPATH already held)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
GIB = 1 << 30
EXPERT_RE = r"experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
"""A routed-expert projection module of the per-expert layouts built here (Mixtral ``w1/w2/w3``, OLMoE
``gate/up/down_proj``)."""
TARGET_CPU, TARGET_GPU = 1.3, 1.1
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
OUT_FORMATS = ("compressed-tensors", "experts-int8")

# ----------------------------------------------------------------------------------------------------------- models


ELEMENT_BYTES = {"w": 2, "norm": 2, "bias": 2, "f32": 4, "fp8": 1, "fp8_scale": 4, "mx_blocks": 1, "mx_scales": 1}
"""Bytes per element of each kind of tensor the builder writes (``ModelSpec.tensors``)."""
FP8_SOURCE_BLOCK = 128  # DeepSeek-V3's weight_block_size, both ways


@dataclass(frozen=True)
class ModelSpec:
    name: str  # as given on the command line
    family: str  # "mixtral", "olmoe", "qwen3_moe", "deepseek_v3" or "gpt_oss"
    hidden: int
    intermediate: int  # the routed experts'
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    shard_size: int  # bytes of tensor data per shard, at most (HF's max_shard_size)
    config: dict = field(default_factory=dict)  # further config keys
    head_dim_: int | None = None  # when it is not hidden / heads
    native: str = "bf16"  # how the checkpoint itself is stored: bf16, fp8 (DeepSeek-V3's blocks) or mxfp4 (GPT-OSS)
    dense_intermediate: int = 0  # DeepSeek-V3's dense layers (first_k_dense_replace) and shared expert widths

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads

    def tensors(self):
        """(name, shape, kind) in state-dict order; kind: ``w`` (bf16 random), ``norm`` (bf16 ones), ``bias`` (bf16
        random), ``f32`` (F32 zeros), ``fp8`` (F8_E4M3 random codes) with ``fp8_scale`` (its F32 128x128 block
        scales), ``mx_blocks`` / ``mx_scales`` (GPT-OSS MXFP4, U8)."""
        H, I, E, kv = self.hidden, self.intermediate, self.experts, self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, H), "w"
        for L in range(self.layers):
            yield from getattr(self, f"_layer_{self.family}")(f"model.layers.{L}.", L, H, I, E, kv)
            yield f"model.layers.{L}.input_layernorm.weight", (H,), "norm"
            yield f"model.layers.{L}.post_attention_layernorm.weight", (H,), "norm"
        yield "model.norm.weight", (H,), "norm"
        yield "lm_head.weight", (self.vocab, H), "w"

    def _attention(self, p, H, kv, q=None, o=None):
        q = q or self.heads * self.head_dim
        for n, shape in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, o or q))):
            yield p + f"self_attn.{n}.weight", shape, "w"

    def _layer_mixtral(self, p, L, H, I, E, kv):
        yield from self._attention(p, H, kv, H, H)
        yield p + "block_sparse_moe.gate.weight", (E, H), "w"
        for e in range(E):
            for n, shape in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
                yield p + f"block_sparse_moe.experts.{e}.{n}.weight", shape, "w"

    def _layer_olmoe(self, p, L, H, I, E, kv):
        yield from self._attention(p, H, kv, H, H)
        yield p + "self_attn.q_norm.weight", (H,), "norm"
        yield p + "self_attn.k_norm.weight", (kv,), "norm"
        yield from self._experts(p, E, H, I, "w")

    def _experts(self, p, E, H, I, kind):
        yield p + "mlp.gate.weight", (E, H), "w"
        for e in range(E):
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                yield from self._linear(p + f"mlp.experts.{e}.{n}", shape, kind)

    def _linear(self, m, shape, kind):
        yield m + ".weight", shape, kind
        if kind == "fp8":
            b = FP8_SOURCE_BLOCK
            yield m + ".weight_scale_inv", (-(-shape[0] // b), -(-shape[1] // b)), "fp8_scale"

    def _layer_qwen3_moe(self, p, L, H, I, E, kv):
        yield from self._attention(p, H, kv)
        yield p + "self_attn.q_norm.weight", (self.head_dim,), "norm"
        yield p + "self_attn.k_norm.weight", (self.head_dim,), "norm"
        yield from self._experts(p, E, H, I, "w")

    def _layer_deepseek_v3(self, p, L, H, I, E, kv):
        c = self.config
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        for n, shape in (("q_a_proj", (c["q_lora_rank"], H)), ("q_b_proj", (self.heads * qk, c["q_lora_rank"])),
                         ("kv_a_proj_with_mqa", (c["kv_lora_rank"] + c["qk_rope_head_dim"], H)),
                         ("kv_b_proj", (self.heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
                         ("o_proj", (H, self.heads * c["v_head_dim"]))):
            yield from self._linear(p + f"self_attn.{n}", shape, "fp8")
        yield p + "self_attn.q_a_layernorm.weight", (c["q_lora_rank"],), "norm"
        yield p + "self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],), "norm"
        D = self.dense_intermediate
        if L < c["first_k_dense_replace"]:
            for n, shape in (("gate_proj", (D, H)), ("up_proj", (D, H)), ("down_proj", (H, D))):
                yield from self._linear(p + f"mlp.{n}", shape, "fp8")
            return
        yield from self._experts(p, E, H, I, "fp8")
        yield p + "mlp.gate.e_score_correction_bias", (E,), "f32"
        S = I * c["n_shared_experts"]
        for n, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            yield from self._linear(p + f"mlp.shared_experts.{n}", shape, "fp8")

    def _layer_gpt_oss(self, p, L, H, I, E, kv):
        q = self.heads * self.head_dim
        for n, shape in (("q_proj", (q, H)), ("k_proj", (kv, H)), ("v_proj", (kv, H)), ("o_proj", (H, q))):
            yield p + f"self_attn.{n}.weight", shape, "w"
            yield p + f"self_attn.{n}.bias", shape[:1], "bias"
        yield p + "self_attn.sinks", (self.heads,), "bias"
        yield p + "mlp.router.weight", (E, H), "w"
        yield p + "mlp.router.bias", (E,), "bias"
        for n, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            yield p + f"mlp.experts.{n}_blocks", (E, rows, cols // 32, 16), "mx_blocks"
            yield p + f"mlp.experts.{n}_scales", (E, rows, cols // 32), "mx_scales"
            yield p + f"mlp.experts.{n}_bias", (E, rows), "bias"

    def shards(self) -> list[list[tuple[str, tuple, str]]]:
        """Tensors grouped into shards the way ``save_pretrained`` does."""
        out, cur, size = [], [], 0
        for t in self.tensors():
            n = math.prod(t[1]) * ELEMENT_BYTES[t[2]]
            if cur and size + n > self.shard_size:
                out.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += n
        if cur:
            out.append(cur)
        return out

    def hf_config(self):
        """The transformers config (``AutoConfig.for_model``) of this model, with the source's
        ``quantization_config`` for FP8 and MXFP4 checkpoints."""
        from transformers import AutoConfig

        arch = {"mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}[self.family]
        kw = dict(architectures=[arch], hidden_size=self.hidden, num_experts_per_tok=self.top_k,
                  num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                  vocab_size=self.vocab, tie_word_embeddings=False, rms_norm_eps=1e-5, dtype="bfloat16")
        kw |= {"mixtral": dict(num_local_experts=self.experts, max_position_embeddings=32768,
                               intermediate_size=self.intermediate),
               "olmoe": dict(num_experts=self.experts, max_position_embeddings=4096, pad_token_id=1,
                             eos_token_id=50279, intermediate_size=self.intermediate),
               "qwen3_moe": dict(num_experts=self.experts, moe_intermediate_size=self.intermediate,
                                 head_dim=self.head_dim, max_position_embeddings=40960,
                                 intermediate_size=6144, decoder_sparse_step=1, mlp_only_layers=[]),
               "deepseek_v3": dict(n_routed_experts=self.experts, moe_intermediate_size=self.intermediate,
                                   intermediate_size=self.dense_intermediate, max_position_embeddings=163840),
               "gpt_oss": dict(num_local_experts=self.experts, intermediate_size=self.intermediate,
                               head_dim=self.head_dim, max_position_embeddings=131072,
                               layer_types=["sliding_attention", "full_attention"] * (self.layers // 2)
                               + ["sliding_attention"] * (self.layers % 2), sliding_window=128)}[self.family]
        kw |= self.config
        cfg = AutoConfig.for_model(self.family, **kw)
        if self.native == "fp8":
            cfg.quantization_config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [FP8_SOURCE_BLOCK, FP8_SOURCE_BLOCK]}
        elif self.native == "mxfp4":
            cfg.quantization_config = {"modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"}
        return cfg

    def describe(self) -> str:
        stored = {"bf16": "bf16", "fp8": "FP8 E4M3 with 128x128 block scales (DeepSeek-V3's format)",
                  "mxfp4": "MXFP4 routed experts (GPT-OSS's format), the rest bf16"}[self.native]
        return (f"{self.family} layout, hidden {self.hidden}, expert intermediate {self.intermediate}, "
                f"{self.experts} experts (top-{self.top_k}), {self.layers} layer{'s' * (self.layers != 1)}, "
                f"{self.heads} heads / "
                f"{self.kv_heads} kv heads, vocab {self.vocab}, {stored}")


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``16MiB``, or a byte count (decimal units as Hugging Face uses them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = (m[2] or "b").lower()
    mult = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
            "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}[unit]
    return int(float(m[1]) * mult)


def model_spec(name: str, shard_size: int | None) -> ModelSpec:
    base, _, layers = name.partition(":")
    if layers and not layers.isdigit():
        raise SystemExit(f"--model {name}: LAYERS must be a number")
    size = shard_size or 5 * 10**9
    if base == "mixtral-8x7b":
        return ModelSpec(name, "mixtral", 4096, 14336, 8, 2, int(layers or 2), 32, 8, 32000, size)
    if base in ("olmoe", "olmoe-x2"):
        default = 16 if base == "olmoe" else 32
        if base == "olmoe-x2" and layers:
            raise SystemExit("--model olmoe-x2 takes no layer count (use olmoe:LAYERS)")
        return ModelSpec(name, "olmoe", 2048, 1024, 64, 8, int(layers or default), 16, 16, 50304, size,
                         {"clip_qkv": None, "norm_topk_prob": False})
    if base == "qwen3-30b-a3b":
        return ModelSpec(name, "qwen3_moe", 2048, 768, 128, 8, int(layers or 12), 32, 4, 151936, size,
                         {"norm_topk_prob": True}, head_dim_=128)
    if base in ("deepseek-v3", "deepseek-v3-tiny"):
        tiny = base.endswith("tiny")
        mla = dict(q_lora_rank=256 if tiny else 1536, kv_lora_rank=128 if tiny else 512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, n_shared_experts=1, n_group=8,
                   topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
                   norm_topk_prob=True)
        if tiny:
            return ModelSpec(name, "deepseek_v3", 1024, 256, 16, 4, int(layers or 2), 8, 8, 4096,
                             shard_size or 16 * 10**6, mla, head_dim_=64, native="fp8", dense_intermediate=1536)
        return ModelSpec(name, "deepseek_v3", 7168, 2048, 256, 8, int(layers or 2), 128, 128, 129280, size, mla,
                         head_dim_=64, native="fp8", dense_intermediate=18432)
    if base in ("gpt-oss-120b", "gpt-oss-tiny"):
        if base.endswith("tiny"):
            return ModelSpec(name, "gpt_oss", 512, 512, 8, 2, int(layers or 2), 8, 2, 4096, shard_size or 16 * 10**6,
                             {}, head_dim_=64, native="mxfp4")
        return ModelSpec(name, "gpt_oss", 2880, 2880, 128, 4, int(layers or 4), 64, 8, 201088, size, {},
                         head_dim_=64, native="mxfp4")
    if base == "tiny":
        return ModelSpec(name, "mixtral", 512, 1024, 8, 2, int(layers or 2), 8, 4, 4096, shard_size or 16 * 10**6)
    raise SystemExit(f"unknown --model {name!r}: mixtral-8x7b[:LAYERS], olmoe[:LAYERS], olmoe-x2, "
                     "qwen3-30b-a3b[:LAYERS], deepseek-v3[:LAYERS], gpt-oss-120b[:LAYERS], tiny, deepseek-v3-tiny, "
                     "gpt-oss-tiny")


# ---------------------------------------------------------------------------------------------------- checkpoints

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)
FP8_QUANTIZED = re.compile(r"(_proj|experts\.\d+\.w[123])\.weight$")
"""2-D projections stored FP8 in the twin: attention ``q/k/v/o_proj`` and routed experts (not routers, norms)."""


def _marker(path: Path) -> Path:
    return path / ".bench-complete"


def built(path: Path, key: dict) -> bool:
    m = _marker(path)
    return m.exists() and json.loads(m.read_text()) == key


POOL_ELEMS = 1 << 24
"""Elements of each random pool the builder tiles tensors from (a tensor starts at its own offset)."""


def _pool(kind: str):
    """The random values tensors of ``kind`` are cut from (generated once, seeded): bf16 ``0.02 * N(0, 1)``; FP8
    codes of ``N(0, 1) * 112`` (block-quantized normals use about the top quarter of E4M3's range; never NaN); MXFP4
    blocks of uniform random nibbles and E8M0 scales 2**-9 .. 2**-3."""
    import torch

    cache = _pool.__dict__.setdefault("cache", {})
    if kind not in cache:
        g = torch.Generator().manual_seed(1234)
        if kind in ("w", "bias"):
            cache[kind] = (torch.randn(POOL_ELEMS, generator=g) * 0.02).to(torch.bfloat16)
        elif kind == "fp8":
            cache[kind] = (torch.randn(POOL_ELEMS, generator=g) * 112).clamp(-448, 448).to(torch.float8_e4m3fn)
        elif kind == "mx_blocks":
            cache[kind] = torch.randint(0, 256, (POOL_ELEMS,), generator=g, dtype=torch.uint8)
        else:  # mx_scales
            cache[kind] = torch.randint(118, 125, (POOL_ELEMS,), generator=g, dtype=torch.uint8)
    return cache[kind]


def make_tensor(kind: str, shape: tuple, seed: int):
    """One tensor of ``kind`` (``ModelSpec.tensors``), filled from its pool starting at a seeded offset."""
    import torch

    if kind == "norm":
        return torch.ones(shape, dtype=torch.bfloat16)
    if kind == "f32":
        return torch.zeros(shape, dtype=torch.float32)
    if kind == "fp8_scale":  # block scales of normals with std 0.02: amax / 448 about 2e-4
        g = torch.Generator().manual_seed(seed)
        return 1.5e-4 + 1e-4 * torch.rand(shape, generator=g, dtype=torch.float32)
    pool = _pool(kind)
    n, off, pos = math.prod(shape), (seed * 7919) % POOL_ELEMS, 0
    out = torch.empty(n, dtype=pool.dtype)
    while pos < n:
        take = min(n - pos, POOL_ELEMS - off)
        out[pos:pos + take] = pool[off:off + take]
        pos, off = pos + take, 0
    return out.view(shape)


def build_checkpoint(spec: ModelSpec, path: Path) -> None:
    """Write ``spec`` as a safetensors checkpoint into ``path`` (bf16, or as the family ships it: ``native``), one
    shard in memory at a time; values tiled from seeded random pools (``make_tensor``: fast; the conversion does not
    depend on which random values it meets)."""
    from safetensors.torch import save_file

    key = {"spec": asdict(spec) | {"name": None}, "format": spec.native, "fill": "pools"}
    if built(path, key):
        return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    shards = spec.shards()
    n = len(shards)
    weight_map, total, i = {}, 0, 0
    t0 = time.perf_counter()
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        sd = {}
        for tname, shape, kind in shard:
            sd[tname] = t = make_tensor(kind, shape, i)
            i += 1
            weight_map[tname] = name
            total += t.numel() * t.element_size()
        save_file(sd, path / name, metadata={"format": "pt"})
        del sd
        print(f"  built {path.name}/{name} ({k + 1}/{n}, {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    spec.hf_config().save_pretrained(path)
    _marker(path).write_text(json.dumps(key))


def block_quant(w, br: int, bc: int):
    """Per ``br x bc`` block, in fp32: ``s = amax(|x|) / 448`` (1 for an all-zero block), ``q = fp8_e4m3(x / s)``;
    edge blocks cut at the matrix edge. Returns (F8_E4M3 codes [rows, cols], F32 scales [ceil(rows/br),
    ceil(cols/bc)]): DeepSeek-V3's ``weight_quant`` (``tests/fp8_fixture.vendor_quant``), vectorized."""
    import torch

    rows, cols = w.shape
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    x = torch.nn.functional.pad(w.to(torch.float32), (0, nc * bc - cols, 0, nr * br - rows))
    x = x.view(nr, br, nc, bc)
    amax = x.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return q, s.contiguous()


def build_fp8_twin(bf16: Path, path: Path) -> None:
    """The FP8 block-scale twin of the bf16 checkpoint ``bf16`` (same shapes, same shard files)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    key = {"from": json.loads(_marker(bf16).read_text()), "format": "fp8"}
    if built(path, key):
        return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    weight_map, total = {}, 0
    for f in sorted(set(index["weight_map"].values())):
        sd = {}
        with safe_open(bf16 / f, "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if t.dim() == 2 and FP8_QUANTIZED.search(k):
                    sd[k], sd[k + "_scale_inv"] = block_quant(t, *FP8_BLOCK)
                else:
                    sd[k] = t
        save_file(sd, path / f, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, f))
        total += sum(t.numel() * t.element_size() for t in sd.values())
        del sd
        print(f"  built {path.name}/{f}", file=sys.stderr)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(FP8_BLOCK)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _marker(path).write_text(json.dumps(key))


def shard_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def tree_bytes(path: Path) -> int:
    """Sum of the file sizes under ``path`` (0 if it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---------------------------------------------------------------------------------------------- the page cache


def warm(paths: list[Path]) -> None:
    """Read every byte once (into the page cache)."""
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def cached_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages resident in the page cache (mincore), None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        page = os.sysconf("SC_PAGE_SIZE")
        pages = resident = 0
        for p in paths:
            size = p.stat().st_size
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    pages += n
                    resident += n - bytes(vec).count(0)
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / pages if pages else None
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------------------- the variants' programs

FLOOR = r"""
import os, sys, json, time
t = time.perf_counter()
import torch  # noqa: F401 - every converter pays for it; so does the floor
src, out, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = bytearray(64 << 20)
for f in sorted(os.listdir(src)):
    if f.endswith(".safetensors"):
        with open(os.path.join(src, f), "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "blob"), "wb", buffering=0) as fh:
    left = nbytes
    while left:
        left -= fh.write(memoryview(buf)[: min(len(buf), left)])
    os.fsync(fh.fileno())
print(json.dumps({"inner_seconds": time.perf_counter() - t}))
"""

NAIVE = r"""
import os, sys, json, time, re
t = time.perf_counter()
import torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
src, out, expert = sys.argv[1], sys.argv[2], re.compile(sys.argv[3] + r"\.weight$")
os.makedirs(out, exist_ok=True)
for f in sorted(os.listdir(src)):
    if not f.endswith(".safetensors"):
        continue
    sd = load_file(os.path.join(src, f))
    res = {}
    for k, w in sd.items():
        if not expert.search(k):
            res[k] = w
            continue
        s = w.abs().amax(dim=1, keepdim=True) / 127
        q = (w / s).round_().clamp_(-127, 127).to(torch.int8)
        m = k[: -len(".weight")]
        res[m + ".weight_packed"] = pack_to_int32(q, 8)
        res[m + ".weight_scale"] = s
        res[m + ".weight_shape"] = torch.tensor(list(w.shape))
    save_file(res, os.path.join(out, f))
    del sd, res
    fd = os.open(os.path.join(out, f), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
print(json.dumps({"inner_seconds": time.perf_counter() - t}))
"""

LLMC = r"""
import os, sys, json, time
t = time.perf_counter()
import importlib.metadata as md
import torch  # noqa: F401
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq
src, out, expert, device = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
scheme = QuantizationScheme(
    targets=["re:.*" + expert + "$"],
    weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False),
    format="pack-quantized")
model_free_ptq(src, out, scheme=scheme, max_workers=1, device=device)
for f in sorted(os.listdir(out)):
    fd = os.open(os.path.join(out, f), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
print(json.dumps({"inner_seconds": time.perf_counter() - t, "llmcompressor": md.version("llmcompressor"),
                  "compressed_tensors": md.version("compressed-tensors"), "torch": torch.__version__}))
"""

GPU_STATS = r"""
def gpu_stats(devices):
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [{"device": f"cuda:{i}", "name": torch.cuda.get_device_name(i),
             "max_allocated": torch.cuda.max_memory_allocated(i), "max_reserved": torch.cuda.max_memory_reserved(i)}
            for i in devices]

def cuda_indices(spec):
    import torch
    if spec == "auto":
        return list(range(torch.cuda.device_count()))
    return [int(p.partition(":")[2] or 0) for p in spec.split(",") if p.strip().startswith("cuda")]
"""

EXPQ_CLI_GPU = GPU_STATS + r"""
import json, os, sys
argv = sys.argv[1:]
device = argv[argv.index("--device") + 1] if "--device" in argv else "auto"
sys.argv = ["expq", *argv]
code = 0
import expq.cli
try:
    expq.cli.main()  # the command in this process (expq.cli.console would end it before the stats are taken)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
with open(os.environ["BENCH_GPU_STATS"], "w") as f:
    json.dump(gpu_stats(cuda_indices(device)), f)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # as the console script ends (expq.cli.console): no interpreter teardown
"""

STREAM = GPU_STATS + r"""
import inspect, json, os, sys, time
t = time.perf_counter()
import expq.api
if "stream" not in inspect.signature(expq.api.convert).parameters:
    print(json.dumps({"unavailable": "expq.api.convert has no stream parameter"}))
    sys.exit(3)
repo, out, device, fmt = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
r = expq.api.convert(repo, out, device=device, stream=True, format=fmt, allow_random_experts_in_transformers=True)
print(json.dumps({"inner_seconds": time.perf_counter() - t, "bytes_out": r.bytes_out,
                  "stream_peak_bytes": getattr(r, "stream_peak_bytes", None)}))
with open(os.environ["BENCH_GPU_STATS"], "w") as f:
    json.dump(gpu_stats(cuda_indices(device)), f)
"""

DECODE = r"""
import contextlib, sys, json, time
t = time.perf_counter()
import torch  # noqa: F401
from expq import cpu_kernels, pipeline
from expq.source import open_source
try:  # the conversion's buffer pool (reads and decoded outputs reused, as run_plan does), where expq has one
    from expq.io import buffers
    pooled = buffers.using(buffers.Pool(pipeline.BUFFER_POOL_FREE))
except ImportError:
    pooled = contextlib.nullcontext()
src = open_source(sys.argv[1])
t_read = t_dec = 0.0
elements = 0
with pipeline.cpu_threads(True), pooled:  # torch single-threaded, the decoders' bands on one thread per core
    for lt in src.logical.values():
        if not lt.decoded:
            continue
        t0 = time.perf_counter()
        parts = {p.name: src.read(p) for p in lt.parts}
        t1 = time.perf_counter()
        out = src.decoder.decode(lt, lambda info: parts[info.name])
        t_dec += time.perf_counter() - t1
        t_read += t1 - t0
        elements += out.numel()
        del parts, out
print(json.dumps({"inner_seconds": time.perf_counter() - t, "read_s": t_read, "decode_s": t_dec,
                  "elements": elements, "kernel": cpu_kernels.active()}))
"""

METER = r"""
# Runs one command and measures it: wall seconds, the kernel's peak RSS of the child (RUSAGE_CHILDREN ru_maxrss),
# the process tree sampled from /proc (processes seen, the largest sum of their VmRSS), nvidia-smi used memory, and
# the allocated size of a folder. Prints one JSON line. Imports nothing heavy, so its own peak RSS stays small.
import json, os, resource, subprocess, sys, threading, time
spec = json.loads(sys.argv[1])

def status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    out[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out

def tree(pid):
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return pids

def du(path):
    total, todo = 0, [path]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            todo.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass
        except OSError:
            pass
    return total

own_hwm = status(os.getpid()).get("VmHWM", 0)
res = {"meter_hwm": own_hwm, "procs": 0, "tree_rss_peak": 0, "disk_peak": None, "smi_peak_mib": None}
smi, smi_base, smi_peak = None, {}, {}
if spec.get("gpu"):
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        def read_smi():
            for line in smi.stdout:
                try:
                    i, used = (int(x) for x in line.split(","))
                except ValueError:
                    continue
                smi_base.setdefault(i, used)
                smi_peak[i] = max(smi_peak.get(i, 0), used)
        threading.Thread(target=read_smi, daemon=True).start()
        time.sleep(0.5)
    except OSError:
        smi = None
env = dict(os.environ, **spec.get("env", {}))
for k in spec.get("unset_env", []):
    env.pop(k, None)
out, err = open(spec["stdout"], "w"), open(spec["stderr"], "w")
t0 = time.perf_counter()
p = subprocess.Popen(spec["cmd"], cwd=spec.get("cwd"), env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
done = threading.Event()
seen = set()
def sample():
    watch = spec.get("disk_watch")
    while not done.is_set():
        pids = tree(p.pid)
        seen.update(pids)
        res["tree_rss_peak"] = max(res["tree_rss_peak"], sum(status(q).get("VmRSS", 0) for q in pids))
        if watch:
            res["disk_peak"] = max(res["disk_peak"] or 0, du(watch))
        done.wait(0.1 if watch else 0.05)
th = threading.Thread(target=sample, daemon=True)
th.start()
fired = []
def kill():
    if not done.is_set():
        fired.append(True)
        p.kill()
killer = threading.Timer(spec["timeout"], kill) if spec.get("timeout") else None
if killer:
    killer.start()
try:
    _, st, ru = os.wait4(p.pid, 0)
except KeyboardInterrupt:
    p.kill()
    raise
wall = time.perf_counter() - t0
done.set()
p.returncode = os.waitstatus_to_exitcode(st)
if killer:
    killer.cancel()
res["timed_out"] = bool(fired)
th.join()
if spec.get("disk_watch"):
    res["disk_peak"] = max(res["disk_peak"] or 0, du(spec["disk_watch"]))
if smi is not None:
    time.sleep(0.3)
    smi.terminate()
    res["smi_peak_mib"] = {i: smi_peak[i] - smi_base.get(i, 0) for i in sorted(smi_peak)}
res.update(wall=wall, rc=os.waitstatus_to_exitcode(st), ru_maxrss=ru.ru_maxrss * 1024,
           cpu_seconds=ru.ru_utime + ru.ru_stime, procs=len(seen))
print(json.dumps(res))
"""


# ------------------------------------------------------------------------------------------------------- running


@dataclass
class Variant:
    name: str  # as shown: floor, naive, llmc, expq-cpu, expq-cuda:0, expq-stream, ... (expq: with [its format])
    kind: str  # floor, naive, llmc, expq, stream, decode
    device: str = "cpu"
    skip: str | None = None  # why it is not run
    out_format: str | None = None  # expq's --format (expq and stream variants)
    code: Path | None = None  # expq variants: run the expq package found here (--baseline) instead of this checkout's


def parse_variants(text: str) -> list[str]:
    """Comma-separated; a ``cuda:N`` item continues the device list of the previous item
    (``expq-cuda:0,cuda:1`` is one variant)."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item.startswith("cuda") and out and out[-1].startswith(("expq-cuda", "expq-stream:", "llmc:")):
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def make_variant(name: str, gpus: int, llmc_device: str) -> Variant:
    def need(device: str) -> str | None:
        idx = [int(p.partition(":")[2] or 0) for p in device.split(",") if p.startswith("cuda")]
        if not idx:
            return None
        if not gpus:
            return "no CUDA device here"
        if max(idx) >= gpus:
            return f"needs {max(idx) + 1} GPUs, {gpus} here"
        return None

    if name in ("floor", "naive", "decode"):
        return Variant(name, name)
    if name == "llmc" or name.startswith("llmc:"):
        device = name.partition(":")[2] or llmc_device
        return Variant(name, "llmc", device, need(device))
    if name.startswith("expq-stream"):
        device = name.partition(":")[2] or "cpu"
        return Variant(name, "stream", device, need(device))
    if name.startswith("expq-"):
        device = name[len("expq-"):]
        if device != "cpu" and not device.startswith("cuda"):
            raise SystemExit(f"unknown variant {name!r}")
        return Variant(name, "expq", device, need(device))
    raise SystemExit(f"unknown variant {name!r}: floor, naive, llmc, expq-cpu, expq-cuda[:N], "
                     "expq-cuda:0,cuda:1, expq-stream[:DEVICE], decode")


def meter(cmd: list[str], logs: Path, *, env: dict | None = None, unset_env: tuple = (), gpu: bool = False,
          disk_watch: Path | None = None, timeout: float | None = None, cwd: Path = REPO) -> dict:
    """Run ``cmd`` under the meter; returns the meter's figures plus ``child`` (the last JSON line the command
    printed, if any) and ``gpu_stats`` (what a CUDA wrapper recorded)."""
    logs.parent.mkdir(parents=True, exist_ok=True)
    stats = logs.with_suffix(".gpu.json")
    stats.unlink(missing_ok=True)
    env = dict(env or {})
    env.setdefault("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["BENCH_GPU_STATS"] = str(stats)
    spec = {"cmd": cmd, "cwd": str(cwd), "env": env, "unset_env": list(unset_env), "gpu": gpu,
            "stdout": str(logs.with_suffix(".out")), "stderr": str(logs.with_suffix(".err")),
            "disk_watch": str(disk_watch) if disk_watch else None, "timeout": timeout}
    p = subprocess.run([sys.executable, "-c", METER, json.dumps(spec)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"meter failed: {p.stderr[-2000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["child"] = None
    for line in reversed(logs.with_suffix(".out").read_text().strip().splitlines()):
        try:
            res["child"] = json.loads(line)
            break
        except json.JSONDecodeError:
            continue
    res["gpu_stats"] = json.loads(stats.read_text()) if stats.exists() else None
    if res["rc"] != 0:
        tail = logs.with_suffix(".err").read_text()[-1500:].strip()
        res["error"] = (f"killed after the {timeout:.0f} s --timeout" if res.get("timed_out") else
                        tail.splitlines()[-1] if tail else f"exit status {res['rc']}")
        res["stderr_tail"] = tail
    return res


def llmc_unavailable(llmc_python: Path) -> str | None:
    if not llmc_python.exists():
        return f"{llmc_python} does not exist: run bash bench/setup_llmc.sh"
    p = subprocess.run([str(llmc_python), "-c", "from llmcompressor import model_free_ptq"], capture_output=True,
                       text=True)
    if p.returncode != 0:
        return "llmcompressor does not import: " + (p.stderr.strip().splitlines() or ["?"])[-1]
    return None


def stream_unavailable() -> str | None:
    code = "import inspect, expq.api; print('stream' in inspect.signature(expq.api.convert).parameters)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=repo_env())
    if p.returncode != 0:
        return "expq does not import: " + (p.stderr.strip().splitlines() or ["?"])[-1]
    if p.stdout.strip() != "True":
        return "not available: expq.api.convert has no stream parameter yet"
    return None


def inspect_bytes_out(src: Path) -> int:
    p = subprocess.run([sys.executable, "-m", "expq.cli", "inspect", str(src), "--json"], capture_output=True,
                       text=True, cwd=REPO, env=repo_env())
    if p.returncode != 0:
        raise RuntimeError(f"expq inspect {src} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)["bytes_out"]


# ---------------------------------------------------------------------------------------------------- local Hub


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def start_hub(src: Path, root: Path, repo_id: str):
    """A started ``HubServer`` holding ``src`` as ``repo_id`` (one commit; the shards as LFS files). The shards are
    hard-linked into the server's object store (a copy where links are refused), never read into memory; their
    sha256 are cached beside ``src``. Uses the server's storage helpers, as its own seeding methods read whole
    files into memory."""
    sys.path.insert(0, str(REPO / "tests"))
    from hub_server import HubServer  # noqa: E402 - tests/ is not a package

    cache_file = src.parent / f".{src.name}.sha256.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    server = HubServer(root, token=None).start()
    repo = server.create_repo(repo_id)
    small, ops = {}, []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.suffix != ".safetensors":
            small[p.name] = p.read_bytes()
            continue
        st = p.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}"
        if cache.get(p.name, {}).get("key") != key:
            cache[p.name] = {"key": key, "sha256": _sha256(p)}
        sha = cache[p.name]["sha256"]
        obj = server._object(sha)
        if not obj.exists():
            obj.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, obj)
            except OSError:
                shutil.copyfile(p, obj)
        repo.lfs.add(sha)
        ops.append(("add", p.name, server._entry(sha, st.st_size, True)))
    cache_file.write_text(json.dumps(cache))
    server._commit(repo, "refs/heads/main", ops, "Upload shards")
    server.commit_files(repo_id, small, message="Upload config")
    return server


# --------------------------------------------------------------------------------------------------- benchmark


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0))}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                info["ram_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    import torch

    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    import importlib.metadata as md

    for dist in ("transformers", "compressed-tensors", "safetensors", "huggingface_hub"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        info["expq_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                             text=True).stdout.strip()
    except OSError:
        pass
    if info["gpus"]:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["nvidia_driver"] = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout else None
    return info


def run_variant(v: Variant, src: Path, fmt: str, work: Path, runs: int, ctx: dict, timeout: float,
                row: dict | None = None) -> dict:
    """``runs`` more runs of one variant on one source, added to ``row`` (a new one if None): {"runs": [...], ...}
    or {"skip": why}. ``summarize`` computes the figures once every run is in."""
    if row is not None:
        if "skip" in row or "error" in row:
            return row
        return _runs(v, src, fmt, work, runs, ctx, timeout, row)
    row = {"variant": v.name, "kind": v.kind, "device": v.device, "source": fmt, "out_format": v.out_format,
           "runs": []}
    if v.skip:
        return row | {"skip": v.skip}
    if v.kind in ("naive", "llmc") and fmt != "bf16":
        return row | {"skip": "bf16 sources only"}
    if v.kind == "decode" and fmt == "bf16":
        return row | {"skip": "quantized sources only"}
    if v.kind == "llmc" and ctx["llmc_skip"]:
        return row | {"skip": ctx["llmc_skip"]}
    if v.kind == "stream" and ctx["stream_skip"]:
        return row | {"skip": ctx["stream_skip"]}
    return _runs(v, src, fmt, work, runs, ctx, timeout, row)


def _runs(v: Variant, src: Path, fmt: str, work: Path, runs: int, ctx: dict, timeout: float, row: dict) -> dict:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", v.name)
    base = work / "runs" / f"{fmt}-{safe}"
    out = base / "out"
    files = shard_files(src)
    py = sys.executable
    for i in range(len(row["runs"]), len(row["runs"]) + runs):
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        env, unset, gpu, watch = {}, (), v.device.startswith("cuda"), None
        if v.kind == "floor":
            cmd = [py, "-c", FLOOR, str(src), str(out), str(ctx["bytes_out"])]
        elif v.kind == "naive":
            cmd = [py, "-c", NAIVE, str(src), str(out), EXPERT_RE]
        elif v.kind == "llmc":
            cmd = [str(ctx["llmc_python"]), "-c", LLMC, str(src), str(out), EXPERT_RE, v.device]
            env["PYTHONPATH"] = ""  # its own site-packages only
        elif v.kind == "decode":
            cmd = [py, "-c", DECODE, str(src)]
        elif v.kind == "expq":
            args = ["convert", str(src), str(out), "--device", v.device, "--json"]
            if v.out_format:  # the acknowledgement changes no byte; families that need it refuse without it
                args += ["--format", v.out_format, "--allow-random-experts-in-transformers"]
            if v.code:  # also its working directory: `python -m` puts that first on the path; this checkout's
                # entries leave the path (the rest stays: the device machine's dependencies are on it)
                keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                        if p and Path(p).resolve() != REPO.resolve()]
                env["PYTHONPATH"] = os.pathsep.join([str(v.code), *keep])
            cmd = [py, "-c", EXPQ_CLI_GPU, *args] if gpu else [py, "-m", "expq.cli", *args]
        else:  # stream
            server = ctx["hub"]()
            home = base / "hf-home"
            env.update(HF_ENDPOINT=server.url, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
                       HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ENABLE_HF_TRANSFER="0",
                       HF_HUB_DISABLE_UPDATE_CHECK="1")
            unset = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                     "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH")
            cmd = [py, "-c", STREAM, ctx["repo_id"], str(out), v.device, v.out_format or "auto"]
            watch = base
        warm(files)
        cached = cached_fraction(files)
        r = meter(cmd, work / "logs" / f"{fmt}-{safe}-{i}", env=env, unset_env=unset, gpu=gpu, disk_watch=watch,
                  timeout=timeout, cwd=v.code or REPO)
        r["cached"] = cached
        r["output_bytes"] = tree_bytes(out)
        row["runs"].append(r)
        status = "ok" if r["rc"] == 0 else f"FAILED ({r.get('error')})"
        print(f"  {v.name} [{fmt}] run {i + 1}: {r['wall']:.2f} s, {r['cpu_seconds']:.1f} CPU s, peak RSS "
              f"{r['ru_maxrss'] / 1e9:.2f} GB, {status}, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
        if r["rc"] != 0:
            if (r.get("child") or {}).get("unavailable"):
                row["skip"] = "not available: " + r["child"]["unavailable"]
            else:
                row["error"] = r.get("error")
            break
    shutil.rmtree(base, ignore_errors=True)
    return row


def summarize(row: dict) -> dict:
    """The row's figures from its runs (median seconds and CPU s, max memory and disk)."""
    if "skip" in row:
        return row
    ok = [r for r in row["runs"] if r["rc"] == 0]
    v_kind, gpu = row["kind"], row["device"].startswith("cuda")
    if ok and "error" not in row and "skip" not in row:
        row["seconds"] = statistics.median(r["wall"] for r in ok)
        row["rss"] = max(max(r["ru_maxrss"], r["tree_rss_peak"] if r["procs"] > 1 else 0) for r in ok)
        row["procs"] = max(r["procs"] for r in ok)
        row["cpu_seconds"] = statistics.median(r["cpu_seconds"] for r in ok)
        row["cached_min"] = min((r["cached"] for r in ok if r["cached"] is not None), default=None)
        row["output_bytes"] = max(r["output_bytes"] for r in ok)
        if v_kind == "expq":
            row["bytes_out_reported"] = (ok[-1].get("child") or {}).get("bytes_out")
            inside = [(r.get("child") or {}).get("seconds") for r in ok]
            if all(isinstance(x, (int, float)) for x in inside):
                row["inside_seconds"] = statistics.median(inside)
        if v_kind == "llmc":
            row["versions"] = {k: (ok[-1].get("child") or {}).get(k)
                               for k in ("llmcompressor", "compressed_tensors", "torch")}
        if v_kind == "decode":
            row.update({k: statistics.median(r["child"][k] for r in ok) for k in ("read_s", "decode_s")})
            row["elements"] = ok[-1]["child"]["elements"]
            row["decode_ns_per_element"] = row["decode_s"] / max(1, row["elements"]) * 1e9
        if gpu:
            alloc = [sum(s["max_allocated"] for s in r["gpu_stats"] or []) for r in ok]
            resv = [sum(s["max_reserved"] for s in r["gpu_stats"] or []) for r in ok]
            smi = [sum((r["smi_peak_mib"] or {}).values()) * 2**20 for r in ok if r["smi_peak_mib"] is not None]
            row["gpu_max_allocated"] = max(alloc) if any(r["gpu_stats"] for r in ok) else None
            row["gpu_max_reserved"] = max(resv) if any(r["gpu_stats"] for r in ok) else None
            row["gpu_smi_peak"] = max(smi) if smi else None
        if v_kind == "stream":
            row["disk_peak_sampled"] = max(r["disk_peak"] or 0 for r in ok)
            peaks = [(r.get("child") or {}).get("stream_peak_bytes") for r in ok]
            row["stream_peak_bytes"] = max(p for p in peaks if p is not None) if any(
                p is not None for p in peaks) else None
    return row


def gb(n: float | None, unit: str = " GB") -> str:
    return "—" if n is None else f"{n / 1e9:.2f}{unit}"


def checks_for(row: dict, src_info: dict) -> list[tuple[str, bool]]:
    """(description, passed) of each target that applies to a measured row."""
    out = []
    if "seconds" not in row or row["kind"] not in ("expq", "stream"):
        return out
    floor = src_info["floor_seconds"]
    if row["kind"] == "expq" and floor:
        ratio = row["seconds"] / floor
        limit = TARGET_CPU if row["device"] == "cpu" else TARGET_GPU
        where = "CPU (2-core runner target)" if row["device"] == "cpu" else "GPU"
        out.append((f"{row['variant']}: {ratio:.2f}x floor <= {limit}x on the {where}", ratio <= limit))
    bound = src_info["rss_bound"]
    out.append((f"{row['variant']}: peak RSS {gb(row['rss'])} <= 2 shards + 1 GiB = {gb(bound)}", row["rss"] <= bound))
    if row["kind"] == "stream":
        disk = max(row.get("disk_peak_sampled") or 0, row.get("stream_peak_bytes") or 0)
        dbound = row["output_bytes"] + 3 * src_info["shard_max"]
        out.append((f"{row['variant']}: peak disk {gb(disk)} <= output + 3 shards = {gb(dbound)}", disk <= dbound))
    return out


def table(rows: list[dict], src_info: dict) -> str:
    floor = src_info["floor_seconds"]
    bytes_in = src_info["bytes_in"]
    lines = ["| variant | seconds | GB/s of source | x floor | peak RSS | peak GPU memory | peak disk | CPU s "
             "| cached |", "|---|---|---|---|---|---|---|---|---|"]
    labels = {"floor": "I/O floor", "naive": "naive converter", "llmc": "llm-compressor model_free_ptq",
              "decode": "source decoder alone"}
    for r in rows:
        label = labels.get(r["kind"], f"expq convert ({r['device']})" if r["kind"] == "expq" else
                           f"expq convert --stream ({r['device']})")
        if r["variant"].startswith("baseline "):
            label = "baseline " + label
        if r["kind"] == "llmc" and r["device"] != "cpu":
            label += f" ({r['device']})"
        if "seconds" not in r:
            why = r.get("skip") or f"failed: {r.get('error')}"
            lines.append(f"| {label} | {why} | | | | | | | |")
            continue
        rss = gb(r["rss"]) + (" (tree)" if r.get("procs", 1) > 1 else "")
        gpu = "—"
        if r.get("gpu_max_allocated") is not None or r.get("gpu_smi_peak") is not None:
            gpu = (f"{gb(r.get('gpu_max_allocated'), '')} alloc / {gb(r.get('gpu_max_reserved'), '')} reserved / "
                   f"{gb(r.get('gpu_smi_peak'), '')} smi GB")
        disk = "—"
        if r["kind"] == "stream":
            disk = f"{gb(r.get('stream_peak_bytes'), '')} report / {gb(r.get('disk_peak_sampled'), '')} sampled GB"
        if r["kind"] == "decode":
            label = f"{str(r.get('source', '')).upper()} decoder alone".strip()
            label += (f" (read {r['read_s']:.2f} s, decode {r['decode_s']:.2f} s: "
                      f"{r['decode_ns_per_element']:.2f} ns/element on {CORES} cores)")
        if r.get("out_format"):
            label += f" → {r['out_format']}"
        if r.get("inside_seconds") is not None and floor:
            label += (f" (inside the conversion: {r['inside_seconds']:.2f} s, {r['inside_seconds'] / floor:.2f}x "
                      "floor)")
        cached = "—" if r.get("cached_min") is None else f"{100 * r['cached_min']:.0f}%"
        bold = r["kind"] in ("expq", "stream")
        sec = f"**{r['seconds']:.2f}**" if bold else f"{r['seconds']:.2f}"
        xf = f"{r['seconds'] / floor:.2f}" if floor else "—"
        lines.append(f"| {'**' + label + '**' if bold else label} | {sec} | {bytes_in / 1e9 / r['seconds']:.3g} | "
                     f"{'**' + xf + '**' if bold else xf} | {rss} | {gpu} | {disk} | {r['cpu_seconds']:.1f} | "
                     f"{cached} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", action="append", help="mixtral-8x7b[:LAYERS] (default), olmoe[:LAYERS], olmoe-x2, "
                    "tiny; repeat for several (olmoe and olmoe-x2 together show the RSS-does-not-grow check)")
    ap.add_argument("--variants", default="floor,naive,llmc,expq-cpu,expq-cuda,expq-cuda:0,cuda:1,expq-stream")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=REPO / "build" / "bench-convert")
    ap.add_argument("--shard-size", type=parse_size, default=None,
                    help="source shard size (default 5GB; tiny: 16MB)")
    ap.add_argument("--source-format", choices=("bf16", "fp8", "both"), default="bf16",
                    help="bf16 models: the bf16 checkpoint, its FP8 twin, or both (deepseek-v3 is built FP8 and "
                    "gpt-oss-120b MXFP4, as they ship, whatever this says)")
    ap.add_argument("--formats", default=",".join(OUT_FORMATS),
                    help="expq's output formats, each expq variant runs once per format (default: both)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a directory holding another expq package (e.g. `git archive REV expq | tar -x -C DIR`): "
                    "each expq variant also runs with it, as 'baseline ...', side by side in the same run")
    ap.add_argument("--llmc-python", type=Path, default=LLMC_PYTHON)
    ap.add_argument("--llmc-device", default="cpu", help="device for the llmc variant (default cpu)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per run, at most")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--build-only", action="store_true", help="build the checkpoints and stop")
    ap.add_argument("--delete-sources-after", action="store_true",
                    help="delete each model's checkpoints after its runs (disk-tight machines)")
    ap.add_argument("--_build", nargs=3, metavar=("MODEL", "DIR", "FORMAT"), help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a._build:  # child process: build one checkpoint (keeps the benchmark process small)
        name, path, fmt = a._build
        spec = model_spec(name, a.shard_size)
        if fmt == spec.native:
            build_checkpoint(spec, Path(path))
        else:
            build_fp8_twin(Path(path).parent / "src-bf16", Path(path))
        return

    models = a.model or ["mixtral-8x7b"]
    specs = [model_spec(m, a.shard_size) for m in models]
    formats = ["bf16", "fp8"] if a.source_format == "both" else [a.source_format]
    a.work.mkdir(parents=True, exist_ok=True)

    def source_formats(spec: ModelSpec) -> list[str]:
        return formats if spec.native == "bf16" else [spec.native]

    def build(spec: ModelSpec) -> dict[str, Path]:
        mdir = a.work / f"{spec.name.replace(':', '-')}-{spec.shard_size}"
        srcs = {}
        for fmt in [spec.native] + [f for f in source_formats(spec) if f != spec.native]:
            path = mdir / f"src-{fmt}"
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--_build", spec.name, str(path), fmt]
            if a.shard_size:
                cmd += ["--shard-size", str(a.shard_size)]
            subprocess.run(cmd, check=True, cwd=REPO)
            if time.perf_counter() - t > 5:
                print(f"built {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            srcs[fmt] = path
        return srcs

    if a.build_only:
        for spec in specs:
            for fmt, path in build(spec).items():
                files = shard_files(path)
                print(f"{spec.name} [{fmt}]: {path}: {len(files)} shards, "
                      f"{sum(p.stat().st_size for p in files) / 1e9:.2f} GB ({spec.describe()})")
        return

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out_formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    variants = []
    for n in parse_variants(a.variants):
        v = make_variant(n, gpus, a.llmc_device)
        if v.kind in ("expq", "stream"):
            variants += [Variant(f"{v.name} [{f}]", v.kind, v.device, v.skip, f) for f in out_formats]
            if a.baseline and v.kind == "expq":
                variants += [Variant(f"baseline {v.name} [{f}]", v.kind, v.device, v.skip, f, a.baseline.resolve())
                             for f in out_formats]
        else:
            variants.append(v)
    info = machine()
    ctx: dict = {"llmc_python": a.llmc_python, "llmc_skip": None, "stream_skip": None}
    if any(v.kind == "llmc" and not v.skip for v in variants):
        ctx["llmc_skip"] = llmc_unavailable(a.llmc_python)
        if not ctx["llmc_skip"]:
            # its code files into the page cache too (not timed)
            subprocess.run([str(a.llmc_python), "-c", "import llmcompressor, compressed_tensors, transformers"],
                           capture_output=True, env=dict(os.environ, PYTHONPATH=""))
    if any(v.kind == "stream" and not v.skip for v in variants):
        ctx["stream_skip"] = stream_unavailable()
    subprocess.run([sys.executable, "-c", "import expq.cli, compressed_tensors, transformers, safetensors"],
                   capture_output=True, cwd=REPO, env=repo_env())

    results = {"machine": info, "runs_per_variant": a.runs, "variants": [v.name for v in variants], "models": []}
    report: list[str] = []
    all_checks: list[tuple[str, bool]] = []
    rss_by_model: dict[str, dict] = {}
    for spec in specs:
        srcs = build(spec)
        by_fmt: dict[str, dict] = {}
        for fmt in source_formats(spec):
            src = srcs[fmt]
            files = shard_files(src)
            bytes_in = sum(p.stat().st_size for p in files)
            shard_max = max(p.stat().st_size for p in files)
            src_info = {"model": spec.name, "source": fmt, "path": str(src), "describe": spec.describe(),
                        "shards": len(files), "shard_max": shard_max, "bytes_in": bytes_in,
                        "shard_size_arg": spec.shard_size, "rss_bound": 2 * shard_max + GIB,
                        "bytes_out": inspect_bytes_out(src), "floor_seconds": None,
                        "fits_in_ram": bytes_in < info.get("ram_bytes", 0) * 0.8}
            mdir = src.parent
            ctx["bytes_out"] = src_info["bytes_out"]
            server = None

            def hub():
                nonlocal server
                if server is None:
                    server = start_hub(src, mdir / f"hub-{fmt}", f"bench/{spec.name.replace(':', '-')}-{fmt}")
                return server

            ctx["hub"], ctx["repo_id"] = hub, f"bench/{spec.name.replace(':', '-')}-{fmt}"
            print(f"{spec.name} [{fmt}]: {bytes_in / 1e9:.2f} GB in {len(files)} shards", file=sys.stderr)
            rows: list[dict] = []
            try:  # round by round (one run of each variant), so that the machine's load falls on all alike
                for i in range(a.runs):
                    for k, v in enumerate(variants):
                        row = run_variant(v, src, fmt, mdir, 1, ctx, a.timeout, rows[k] if i else None)
                        if not i:
                            rows.append(row)
                rows = [summarize(r) for r in rows]
                for r in rows:
                    if r["kind"] == "floor" and "seconds" in r:
                        src_info["floor_seconds"] = r["seconds"]
            finally:
                if server is not None:
                    server.stop()
            checks = [c for r in rows for c in checks_for(r, src_info)]
            all_checks += checks
            for r in rows:
                if r["kind"] == "expq" and "rss" in r:
                    rss_by_model.setdefault(f"{r['variant']} [{fmt}]", {})[spec.name] = (r["rss"], bytes_in)
            head = (f"### {spec.name}, {fmt} source: {bytes_in / 1e9:.2f} GB in {len(files)} shards "
                    f"(largest {shard_max / 1e9:.2f} GB), output {src_info['bytes_out'] / 1e9:.2f} GB\n\n"
                    f"{spec.describe()}; median of {a.runs} run(s), each a fresh process, source in the page cache"
                    f"{'' if src_info['fits_in_ram'] else ' as far as RAM allows (the source is larger than RAM)'};"
                    f" {info.get('cpu', '?')}, {info['cores_usable']} cores, "
                    f"{info.get('ram_bytes', 0) / GIB:.0f} GiB"
                    f"{', ' + ', '.join(info['gpus']) if info['gpus'] else ''}, torch {info['torch']}.\n")
            if fmt == "fp8" and spec.native == "bf16":
                head = head.replace(", bf16;", ", its FP8 twin (F8_E4M3 projections, 128x128 block scales);")
            text = head + "\n" + table(rows, src_info)
            if checks:
                text += "\n\n" + "\n".join(f"- {'PASS' if ok else 'FAIL'}: {d}" for d, ok in checks)
            report.append(text)
            results["models"].append({"source": src_info, "rows": rows, "checks": [
                {"check": d, "pass": ok} for d, ok in checks]})
            by_fmt[fmt] = {r["variant"]: r for r in rows if "seconds" in r}
        if len(by_fmt) == 2:  # FP8 against bf16, variant by variant
            lines = [f"- {name}: seconds {r['seconds'] / by_fmt['bf16'][name]['seconds']:.2f}x, peak RSS "
                     f"{r['rss'] / by_fmt['bf16'][name]['rss']:.2f}x" for name, r in by_fmt["fp8"].items()
                     if name in by_fmt["bf16"] and r["kind"] != "floor"]
            if lines:
                report.append(f"### {spec.name}: FP8 source / bf16 source\n\n" + "\n".join(lines))
        if a.delete_sources_after:
            shutil.rmtree(next(iter(srcs.values())).parent, ignore_errors=True)

    growth = []
    for variant, by_model in rss_by_model.items():
        if len(by_model) > 1:
            parts = ", ".join(f"{m} ({b / 1e9:.1f} GB source): {gb(r)}" for m, (r, b) in by_model.items())
            growth.append(f"- {variant} peak RSS by model size: {parts}")
    if growth:
        report.append("### Peak RSS against model size\n\n" + "\n".join(growth))
        results["rss_by_model"] = {k: {m: r for m, (r, _) in v.items()} for k, v in rss_by_model.items()}
    print("\n\n".join(report))
    if all_checks:
        print(f"\n{sum(ok for _, ok in all_checks)} of {len(all_checks)} targets met")
    if a.json:
        results["checks"] = [{"check": d, "pass": ok} for d, ok in all_checks]
        a.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

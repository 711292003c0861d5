"""Hypothesis strategies and oracles for fuzzing the safetensors header parser and the config reader.

Shared by ``tests/test_fuzz.py`` (a bounded, derandomized run in CI) and ``bench/fuzz.py`` (a long run that counts).

Oracles (what must hold for every input):
  * header: ``read_header`` returns or raises ``SourceError``, never anything else; its one-line message names the
    file; and it accepts exactly the files the safetensors library itself opens (a differential check against
    ``safe_open``), with the same tensor names, dtypes and shapes.
  * config: ``expq.inspect`` on a real tiny checkpoint whose ``config.json`` was mutated (and the manifest record convert
    would write from its plan) returns or raises ``SourceError`` / ``LayoutError`` (or ``UsageError`` for a config dtype that needs ``--dtype``) with one
    line, never anything else.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st
from safetensors import safe_open

import expq
from expq.errors import LayoutError, SourceError, UsageError
from expq.io.safetensors import DTYPE_BITS, read_header
from expq.manifest import PlanRecord

# --- JSON values of every kind (what a hostile header or config may hold) ----------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**64 - 1, 2**64])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=10)
NAMES = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12) | st.sampled_from(
    ["model.embed_tokens.weight", "lm_head.weight", "a", "\ud800", "x\ny", "__metadata__"])


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


@st.composite
def safetensors_blobs(draw) -> bytes:
    """A safetensors file: a valid one, then zero or more mutations of its header entries, metadata, offsets, JSON
    text, length prefix or data length."""
    tensors = []
    for name in draw(st.lists(NAMES, max_size=5, unique=True)):
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        if _nbytes(dtype, shape) * 8 != math.prod(shape) * DTYPE_BITS[dtype]:
            shape = shape + [2]
        tensors.append([name, dtype, shape])
    header: dict = {}
    pos = 0
    for name, dtype, shape in tensors:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    data_len = pos
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "offset", "drop", "extra", "meta", "data", "entry"]))
        names = [k for k in header if k != "__metadata__"]
        if kind == "meta":
            header["__metadata__"] = draw(JSON)
        elif kind == "data":
            data_len = max(0, data_len + draw(st.integers(-3, 3)))
        elif not names:
            header[draw(NAMES)] = draw(JSON)
        else:
            e = header[draw(st.sampled_from(names))]
            if kind == "entry":
                header[draw(st.sampled_from(names))] = draw(JSON)
            elif not isinstance(e, dict):
                continue
            elif kind == "field":
                e[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON)
            elif kind == "offset" and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2:
                i = draw(st.integers(0, 1))
                if isinstance(e["data_offsets"][i], int):
                    e["data_offsets"][i] += draw(st.integers(-3, 3))
            elif kind == "drop":
                e.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
            elif kind == "extra":
                e[draw(st.text(max_size=4))] = draw(JSON)
    text = json.dumps(header, allow_nan=True, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    form = draw(st.sampled_from(["plain"] * 6 + ["wrap", "nest", "bytes", "length", "pad"]))
    if form == "wrap":  # a header that is not an object
        text = json.dumps(draw(st.one_of(st.lists(SCALARS, max_size=3), SCALARS)), allow_nan=True).encode(
            "utf-8", "surrogatepass")
    elif form == "nest":
        depth = draw(st.integers(1, 5000))
        text = b"[" * depth + b"]" * depth
    elif form == "bytes" and text:
        b = bytearray(text)
        for _ in range(draw(st.integers(1, 3))):
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        text = bytes(b)
    elif form == "pad":
        text += draw(st.sampled_from([b" ", b"    ", b"\x00", b"\n"]))
    length = len(text)
    if form == "length":
        length = draw(st.integers(0, 2**64 - 1) | st.integers(max(0, length - 4), length + 4))
    return struct.pack("<Q", length) + text + b"\x5a" * data_len


def library_reads(path: Path) -> list[tuple[str, str, list[int]]] | None:
    """(name, dtype, shape) of every tensor as the safetensors library opens the file, or None if it refuses."""
    try:
        with safe_open(str(path), "numpy") as f:
            out = []
            for k in f.keys():
                sl = f.get_slice(k)
                out.append((k, sl.get_dtype(), list(sl.get_shape())))
            return sorted(out)
    except Exception:  # noqa: BLE001 - SafetensorError, or a dtype numpy cannot represent: "refused" either way
        return None


@dataclass
class Counts:
    """What a fuzz run saw."""

    tried: int = 0
    clean_errors: int = 0
    accepted: int = 0
    crashes: list[str] = field(default_factory=list)

    def line(self, what: str) -> str:
        """One line: inputs tried, clean errors, accepted, crashes."""
        return (f"{what}: {self.tried} inputs tried, {self.clean_errors} clean errors, {self.accepted} accepted, "
                f"{len(self.crashes)} crashes")


def check_header(blob: bytes, path: Path, counts: Counts | None = None) -> None:
    """The header oracle on one blob (written to ``path``). Raises AssertionError (or the crash) when it fails."""
    path.write_bytes(blob)
    if counts is not None:
        counts.tried += 1
    try:
        shard = read_header(path, path.name)
    except SourceError as e:
        line = str(e)
        assert "\n" not in line and str(path) in line, line
        lib = library_reads(path)
        assert lib is None or _lib_quirk(lib), f"expq refused a file the library opens: {line}"
        if counts is not None:
            counts.clean_errors += 1
        return
    ours = sorted((t.name, t.dtype, list(t.shape)) for t in shard.tensors)
    lib = library_reads(path)
    if lib is not None:  # the library may fail on dtypes numpy lacks; then compare nothing
        assert ours == lib, (ours, lib)
    if counts is not None:
        counts.accepted += 1


def _lib_quirk(lib) -> bool:
    """Files the library opens and expq refuses on purpose: none known."""
    return False


CONFIG_KEYS = ["model_type", "architectures", "text_config", "quantization_config", "compression_config",
               "num_local_experts", "num_experts", "num_hidden_layers", "hidden_size", "intermediate_size",
               "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers",
               "first_k_dense_replace", "moe_layer_freq", "moe_layers", "interleave_moe_layer_step",
               "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "expert_layer_period",
               "expert_layer_offset", "mlp_layer_types", "dtype", "torch_dtype", "tie_word_embeddings",
               "n_routed_experts", "num_nextn_predict_layers", "ffn_config", "n_layers", "d_model"]
MODEL_TYPES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "dbrx", "gpt_oss", "llama4", "jamba", "olmoe",
               "glm4_moe", "qwen3_vl_moe", "mistral3"]
QUANT = st.fixed_dictionaries({"quant_method": st.sampled_from(["fp8", "mxfp4", "compressed-tensors", "bitsandbytes"])
                               | JSON}, optional={"weight_block_size": JSON, "config_groups": JSON, "format": JSON,
                                                  "modules_to_not_convert": JSON, "fmt": JSON})


@st.composite
def config_mutations(draw) -> dict:
    """Key -> value changes for a config.json: any JSON at the keys expq reads, and nested text configs."""
    value = JSON | st.sampled_from(MODEL_TYPES) | st.integers(-2, 10) | st.lists(st.integers(-1, 8), max_size=4)
    changes = draw(st.dictionaries(st.sampled_from(CONFIG_KEYS), value, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        changes["quantization_config"] = draw(QUANT | JSON)
    if draw(st.integers(0, 3)) == 0:
        changes["text_config"] = draw(st.dictionaries(st.sampled_from(CONFIG_KEYS), value, max_size=4) | JSON)
    return changes


def check_config(src: Path, base: dict, changes: dict, counts: Counts | None = None) -> None:
    """The config oracle: ``base`` updated with ``changes`` written to ``src/config.json``, then ``expq.inspect``."""
    cfg = dict(base)
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict) and k == "text_config":
            v = {**cfg[k], **v}
        cfg[k] = v
    (src / "config.json").write_text(json.dumps(cfg, allow_nan=True), encoding="utf-8", errors="surrogatepass")
    if counts is not None:
        counts.tried += 1
    try:
        summary = expq.inspect(src).summary()
        PlanRecord(**{k: summary[k] for k in PlanRecord.model_fields})  # what convert records in expq.json
    except (SourceError, LayoutError, UsageError) as e:  # UsageError: a config dtype that needs --dtype (exit 2)
        assert "\n" not in str(e), str(e)
        if counts is not None:
            counts.clean_errors += 1
        return
    if counts is not None:
        counts.accepted += 1

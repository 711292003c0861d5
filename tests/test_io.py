"""The bytes floor ``expq.io``: the dtype table, headers written and read back (by the safetensors library too),
the weight-file rule and the index, file hashes against git's and hashlib's."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open

from expq.errors import SourceError
from expq.io import hashing
from expq.io.index import INDEX_NAME, SINGLE_NAME, Index, index_json, read_index, weight_files
from expq.io.safetensors import DTYPE_BITS, TORCH_DTYPES, dtype_name, encode_header, read_header, read_tensor


def test_dtype_table_agrees_with_torch():
    for name, dt in TORCH_DTYPES.items():
        assert torch.empty(0, dtype=dt).element_size() * 8 == DTYPE_BITS[name], name
        assert dtype_name(dt) == name
    with pytest.raises(KeyError):
        dtype_name(torch.complex128)


@dataclass
class _Placed:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def test_encoded_header_reads_back_here_and_in_the_library(tmp_path):
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.tensor([7, -8, 9], dtype=torch.int8)
    placed = [_Placed("b", "I8", (3,), 12, 3), _Placed("a", "BF16", (2, 3), 0, 12)]  # any order: sorted by offset
    header = encode_header(placed)
    assert len(header) % 8 == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(header + a.view(torch.uint8).numpy().tobytes() + b.numpy().tobytes())

    shard = read_header(path, "x.safetensors")
    assert [(t.name, t.dtype, t.shape) for t in shard.tensors] == [("a", "BF16", (2, 3)), ("b", "I8", (3,))]
    assert shard.data_start == len(header)
    assert shard.header_sha256 == hashlib.sha256(header[8:]).hexdigest()
    assert shard.metadata == {"format": "pt"}
    assert torch.equal(read_tensor(tmp_path, shard.tensors[0]), a)
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b"), b)


def test_read_tensor_into_a_reused_buffer(tmp_path):
    """``into``: each tensor read into the front of one caller's buffer (the front pass's per-thread buffers), the
    same values as a fresh read; the buffer's tail untouched; a file cut short is still refused."""
    a = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.tensor([7, -8, 9], dtype=torch.int8)
    placed = [_Placed("a", "BF16", (2, 3), 0, 12), _Placed("b", "I8", (3,), 12, 3)]
    path = tmp_path / "x.safetensors"
    path.write_bytes(encode_header(placed) + a.view(torch.uint8).numpy().tobytes() + b.numpy().tobytes())
    ta, tb = read_header(path, "x.safetensors").tensors
    buf = torch.full((64,), 0x5A, dtype=torch.uint8)
    got = read_tensor(tmp_path, ta, into=buf)
    assert torch.equal(got, a) and got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[12:], torch.full((52,), 0x5A, dtype=torch.uint8))
    got = read_tensor(tmp_path, tb, into=buf)
    assert torch.equal(got, b) and got.data_ptr() == buf.data_ptr()
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(SourceError, match=r"short read \(1 of 3 bytes\)"):
        read_tensor(tmp_path, tb, into=buf)


@pytest.mark.parametrize("paths,index,want", [
    (["config.json", SINGLE_NAME, "other.safetensors"], None, [SINGLE_NAME]),
    (["config.json", "w.safetensors", ".cache.safetensors", "sub/x.safetensors"], None, ["w.safetensors"]),
    ([INDEX_NAME, "b.safetensors", "a.safetensors"], Index({"t1": "b.safetensors", "t2": "a.safetensors"}),
     ["a.safetensors", "b.safetensors"]),
    ([INDEX_NAME, SINGLE_NAME], None, []),  # an index that could not be read chooses no shard
])
def test_weight_files(paths, index, want):
    assert weight_files(paths, index) == want


@pytest.mark.parametrize("paths,message", [
    (["a.safetensors", "b.safetensors"], f"2 safetensors files but no {INDEX_NAME}"),
    (["config.json", "pytorch_model.bin", "original/consolidated.00.pth"],
     "no safetensors weights (found original/consolidated.00.pth, pytorch_model.bin: convert them to safetensors "
     "first)"),
    (["config.json"], "no safetensors weights"),
])
def test_weight_files_refused(paths, message):
    with pytest.raises(SourceError) as e:
        weight_files(paths, None)
    assert str(e.value).startswith(message)


def test_index_written_and_read_back(tmp_path):
    text = index_json({"z.w": "b.safetensors", "a.w": "a.safetensors"}, total_size=42)
    assert list(json.loads(text)["weight_map"]) == ["a.w", "z.w"] and text.endswith("}\n")
    (tmp_path / INDEX_NAME).write_text(text)
    idx = read_index(tmp_path / INDEX_NAME)
    assert idx.total_size == 42 and idx.files == ["a.safetensors", "b.safetensors"]


@pytest.mark.parametrize("content,message", [
    ('{"weight_map": {"t": "../outside.safetensors"}}', "outside the checkpoint directory"),
    ('{"weight_map": {"t": 3}}', "weight_map must map tensor names to file names"),
    ('{"metadata": {}}', "needs a weight_map"),
    ("[1, 2", "needs a weight_map"),
])
def test_index_refused(tmp_path, content, message):
    (tmp_path / INDEX_NAME).write_text(content)
    with pytest.raises(SourceError, match=message) as e:
        read_index(tmp_path / INDEX_NAME)
    assert e.value.file == str(tmp_path / INDEX_NAME)


def test_hashes_match_hashlib_and_git(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "CHUNK", 7)  # many chunks
    p = tmp_path / "f.bin"
    data = bytes(range(256)) * 5 + b"tail"
    p.write_bytes(data)
    assert hashing.sha256_file(p) == hashlib.sha256(data).hexdigest()
    if shutil.which("git") is None:
        pytest.skip("no git")
    want = subprocess.run(["git", "hash-object", str(p)], capture_output=True, text=True, check=True).stdout.strip()
    assert hashing.git_blob_id(p) == want

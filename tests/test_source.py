"""Opening a source (``source.open_source``): bad safetensors headers, bad config.json types, and links out of SRC.

Each case gives one exact line that names the file (and the tensor or key), from the API and from ``expq inspect`` /
``expq convert`` on the command line (exit 1, no traceback, the same line after ``error:``). 28 header cases, 9
config cases and 6 link cases (43 bad inputs, each a clean error), plus 4 inputs that must keep working (Hub snapshot
links into blobs/, links inside SRC, the ``allow_outside_links`` opt-out, a library-valid header with zero-size
tensors, null metadata and an unknown entry key).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from helpers import example, read_tensors
from safetensors import safe_open
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import ExpqError, SourceError
from expq.io.safetensors import read_header
from expq.source import open_source


def run_cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def assert_clean_everywhere(src: Path, out: Path, line: str) -> None:
    """``line`` is the error of inspect and convert, from the API and the CLI (exit 1, no traceback); OUT not made."""
    with pytest.raises(ExpqError) as ei:
        expq.inspect(src)
    assert str(ei.value) == line
    for args in (("inspect", src), ("convert", src, out, "--device", "cpu")):
        code, text = run_cli(*args)
        assert code == 1, text
        assert "Traceback" not in text and f"error: {line}" in text.splitlines(), text
    assert not out.exists() or list(out.iterdir()) == []


@pytest.fixture
def src(tmp_path, tmp_path_factory) -> Path:
    s = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), s)
    return s


def first_shard(src: Path) -> Path:
    return sorted(src.glob("model-*.safetensors"))[0]


def blob(header, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype="U8", shape=(4,), offsets=(0, 4)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


A = '{"a": {"dtype": "U8", "shape": %s, "data_offsets": %s}}'
HEADER_CASES = {  # id: (file bytes, message after "file F" / "file F, tensor T")
    "array": (blob([1, 2]), ": not a safetensors file (header is [1, 2], not a JSON object)"),
    "number": (blob(5), ": not a safetensors file (header is 5, not a JSON object)"),
    "string": (blob("hi"), ': not a safetensors file (header is "hi", not a JSON object)'),
    "deeply-nested": (blob(None, raw=b"[" * 100_000 + b"]" * 100_000),
                      ": not a safetensors file (header JSON is nested too deeply)"),
    "offsets-strings": (blob({"a": entry(offsets=("0", "4"))}, b"abcd"),
                        ', tensor a: malformed header entry: data_offsets must be [begin, end] (non-negative integers), '
                        'got ["0", "4"]'),
    "offsets-floats": (blob(None, b"abcd", raw=(A % ("[4]", "[0.0, 4.0]")).encode()),
                       ", tensor a: malformed header entry: data_offsets must be [begin, end] (non-negative integers), "
                       "got [0.0, 4.0]"),
    "offsets-negative": (blob({"a": entry(offsets=(-1, 3))}, b"abcd"),
                         ", tensor a: malformed header entry: data_offsets must be [begin, end] (non-negative "
                         "integers), got [-1, 3]"),
    "offsets-three": (blob({"a": entry(offsets=(0, 4, 4))}, b"abcd"),
                      ", tensor a: malformed header entry: data_offsets must be [begin, end] (non-negative integers), "
                      "got [0, 4, 4]"),
    "offsets-reversed": (blob({"a": entry(shape=(0,), offsets=(4, 0))}, b"abcd"),
                         ", tensor a: malformed header entry: data_offsets [4, 0] end before they begin"),
    "offsets-over-u64": (blob({"a": entry(offsets=(0, 2**64))}, b"abcd"),
                         ", tensor a: malformed header entry: data_offsets must be [begin, end] (non-negative "
                         "integers), got [0, 18446744073709551616]"),
    "infinity-in-shape": (blob(None, b"abcd", raw=(A % ("[Infinity]", "[0, 4]")).encode()),
                          ": not a safetensors file (header is not JSON: Infinity is not JSON)"),
    "nan-in-offsets": (blob(None, b"abcd", raw=(A % ("[4]", "[0, NaN]")).encode()),
                       ": not a safetensors file (header is not JSON: NaN is not JSON)"),
    "bool-in-shape": (blob({"a": entry(shape=(True,), offsets=(0, 1))}, b"a"),
                      ", tensor a: malformed header entry: shape must be a list of non-negative integers, got [true]"),
    "string-in-shape": (blob({"a": entry(shape=("4",))}, b"abcd"),
                        ', tensor a: malformed header entry: shape must be a list of non-negative integers, got ["4"]'),
    "huge-shape": (blob({"a": entry(shape=(2**40, 2**40), offsets=(0, 4))}, b"abcd"),
                   ", tensor a: malformed header entry: shape [1099511627776, 1099511627776] is too large"),
    "entry-not-object": (blob({"a": [1, 2]}), ", tensor a: malformed header entry: expected an object with dtype, "
                                              "shape, data_offsets, got [1, 2]"),
    "entry-no-dtype": (blob({"a": {"shape": [4], "data_offsets": [0, 4]}}, b"abcd"),
                       ", tensor a: malformed header entry: no dtype"),
    "unknown-dtype": (blob({"a": entry(dtype="u8")}, b"abcd"), ', tensor a: unknown dtype "u8"'),
    "sub-byte": (blob({"a": entry(dtype="F4", shape=(3,), offsets=(0, 2))}, b"ab"),
                 ", tensor a: malformed header entry: F4[3] does not fill whole bytes (12 bits)"),
    "overlap": (blob({"a": entry(offsets=(0, 4)), "b": entry(shape=(2,), offsets=(2, 4))}, b"abcd"),
                ", tensor b: tensor data overlaps or leaves a gap (corrupt header)"),
    "gap": (blob({"a": entry(shape=(2,), offsets=(0, 2)), "b": entry(shape=(1,), offsets=(3, 4))}, b"abcd"),
            ", tensor b: tensor data overlaps or leaves a gap (corrupt header)"),
    "offsets-past-the-end": (blob({"a": entry(offsets=(1000, 1004)), "b": entry()}, b"abcd"),
                             ", tensor a: tensor data at bytes 1134-1138 lies past the end of the file (138 bytes; "
                             "corrupt header)"),
    "trailing-bytes": (blob({"a": entry()}, b"abcdXYZ"),
                       ", tensor a: 3 bytes after the end of the last tensor's data (byte 72): the header does not "
                       "cover the file"),
    "metadata-int-value": (blob({"__metadata__": {"format": 1}, "a": entry()}, b"abcd"),
                           ": __metadata__['format'] must be a string, got 1"),
    "metadata-list": (blob({"__metadata__": ["pt"], "a": entry()}, b"abcd"),
                      ': __metadata__ must be an object of strings, got ["pt"]'),
    "lone-surrogate-name": (blob(None, b"abcd", raw=b'{"\\ud800": ' + json.dumps(entry()).encode() + b"}"),
                            ": tensor name '\\ud800' is not valid Unicode"),
    "not-utf8": (blob(None, raw=b'{"\xe9": 1}'), ": not a safetensors file (header is not UTF-8: byte 2)"),
    "lfs-pointer": (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 123456\n",
                    ": a Git LFS pointer, not the weights (run git lfs pull)"),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_bad_header_is_one_line_naming_file_and_tensor(src, tmp_path, case):
    data, tail = HEADER_CASES[case]
    f = first_shard(src)
    f.write_bytes(data)
    with pytest.raises(SourceError) as ei:
        read_header(f, f.name)
    assert str(ei.value) == f"file {f}{tail}"
    assert ei.value.file == str(f)
    assert ei.value.tensor == ("a" if ", tensor a:" in tail else "b" if ", tensor b:" in tail else None)
    with pytest.raises(Exception):  # noqa: B017 - the safetensors library refuses each file, with its own error
        safe_open(str(f), "pt")
    assert_clean_everywhere(src, tmp_path / "out", f"file {f}{tail}")


def test_header_larger_than_the_library_limit(tmp_path):
    f = tmp_path / "big.safetensors"
    with open(f, "wb") as fh:  # a sparse file: a 100,000,001-byte header length, and the bytes to hold it
        fh.write(struct.pack("<Q", 100_000_001))
        fh.truncate(8 + 100_000_001)
    with pytest.raises(SourceError) as ei:
        read_header(f, f.name)
    assert str(ei.value) == f"file {f}: not a safetensors file (header length 100000001, file size 100000009)"


def test_library_valid_headers_are_accepted(tmp_path):
    """What safetensors 0.8 opens, expq opens: zero-size tensors sharing an offset, unsorted entries, null metadata,
    padding spaces, unknown keys inside an entry (the library ignores them)."""
    f = tmp_path / "ok.safetensors"
    header = {"__metadata__": None, "c": entry(shape=(2,), offsets=(2, 4)), "z": entry(shape=(0,), offsets=(0, 0)),
              "b": {**entry(shape=(2,), offsets=(0, 2)), "note": 1}}
    text = json.dumps(header).encode() + b"    "
    f.write_bytes(blob(None, b"abcd", raw=text))
    got = read_header(f, f.name)
    base = 8 + len(text)
    assert [(t.name, t.shape, t.start - base, t.end - base) for t in got.tensors] == [
        ("z", (0,), 0, 0), ("b", (2,), 0, 2), ("c", (2,), 2, 4)]
    assert got.metadata == {}
    with safe_open(str(f), "pt") as lib:
        assert sorted(lib.keys()) == ["b", "c", "z"]


CONFIG_CASES = {  # id: (change, message after "file <config>: " or "file config.json: ")
    "text_config-string": (dict(text_config="qwen3_moe"), 'text_config must be a JSON object, got "qwen3_moe"'),
    "architectures-string": (dict(architectures="MixtralForCausalLM"),
                             'architectures must be a list of strings, got "MixtralForCausalLM"'),
    "architectures-ints": (dict(architectures=[1, 2]), "architectures must be a list of strings, got [1, 2]"),
    "model_type-list": (dict(model_type=["mixtral"]), 'model_type must be a string, got ["mixtral"]'),
    "model_type-int": (dict(model_type=7), "model_type must be a string, got 7"),
    "nested-model_type": (dict(text_config={"model_type": {"a": 1}}),
                          "text_config.model_type must be a string, got an object"),
    "num_local_experts-float": (dict(num_local_experts=8.0), "@num_local_experts = 8.0 is not an integer"),
    "num_hidden_layers-list": (dict(num_hidden_layers=[2, 2]), "@num_hidden_layers = [2, 2] is not an integer"),
    "num_hidden_layers-huge": (dict(num_hidden_layers=2**64),
                               "@num_hidden_layers = 18446744073709551616 is too large (at most 1048576)"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_type_is_one_line_naming_key(src, tmp_path, case):
    change, tail = CONFIG_CASES[case]
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    where = "config.json" if tail.startswith("@") else str(src / "config.json")
    assert_clean_everywhere(src, tmp_path / "out", f"file {where}: {tail.removeprefix('@')}")


# --- sources stay inside SRC -------------------------------------------------------------------------------------
OUTSIDE = ", outside the checkpoint directory (copy the file into the checkpoint directory instead of linking to it)"


def test_side_file_link_out_of_src_refused(src, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (src / "notes.txt").symlink_to(secret)
    assert_clean_everywhere(src, tmp_path / "out", f"file {src}/notes.txt: side file resolves to {secret}{OUTSIDE}")
    assert open_source(src, allow_outside_links=True).side_files.count("notes.txt") == 1  # the opt-out


def test_config_link_out_of_src_refused(src, tmp_path):
    shutil.move(src / "config.json", tmp_path / "config.json")
    (src / "config.json").symlink_to(tmp_path / "config.json")
    assert_clean_everywhere(src, tmp_path / "out",
                            f"file {src}/config.json: config.json resolves to {tmp_path}/config.json{OUTSIDE}")


def test_shard_link_out_of_src_refused(src, tmp_path):
    f = first_shard(src)
    shutil.move(f, tmp_path / f.name)
    f.symlink_to(tmp_path / f.name)
    assert_clean_everywhere(src, tmp_path / "out", f"file {f}: listed in model.safetensors.index.json, but resolves "
                                                   f"to {tmp_path / f.name}{OUTSIDE}")


def test_index_entry_through_a_linked_folder_refused(src, tmp_path):
    """An index entry that is lexically inside SRC (``sub/...``) but resolves outside, through a folder link."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    f = first_shard(src)
    shutil.move(f, outside / f.name)
    (src / "sub").symlink_to(outside)
    idx_path = src / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"] = {k: (f"sub/{v}" if v == f.name else v) for k, v in idx["weight_map"].items()}
    idx_path.write_text(json.dumps(idx))
    assert_clean_everywhere(src, tmp_path / "out", f"file {src}/sub/{f.name}: listed in model.safetensors.index.json, "
                                                   f"but resolves to {outside / f.name}{OUTSIDE}")


def test_broken_side_file_link_refused(src, tmp_path):
    (src / "tokenizer.json").unlink(missing_ok=True)
    (src / "tokenizer.json").symlink_to("gone.json")
    assert_clean_everywhere(src, tmp_path / "out",
                            f"file {src}/tokenizer.json: side file is a symbolic link to a missing file (gone.json)")


def test_links_inside_src_accepted(src, tmp_path):
    (src / "docs").mkdir()
    (src / "docs" / "card.md").write_text("# card")
    (src / "README.md").symlink_to("docs/card.md")
    expq.convert(src, tmp_path / "out", device="cpu")
    out = tmp_path / "out" / "README.md"
    assert not out.is_symlink() and out.read_text() == "# card"


def hub_snapshot(src: Path, cache: Path) -> Path:
    """``src`` laid out as huggingface_hub's cache does: blobs named by hash, snapshot files linking to them."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("a" * 40)
    for i, p in enumerate(sorted(q for q in src.rglob("*") if q.is_file())):
        rel = p.relative_to(src)
        blob_name = f"{i:064x}"
        shutil.copy(p, repo / "blobs" / blob_name)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob_name, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    return snap


def test_hub_snapshot_links_into_blobs_accepted(src, tmp_path):
    snap = hub_snapshot(src, tmp_path / "hub")
    assert os.readlink(snap / "config.json").startswith("../../blobs/")
    source = open_source(snap)
    assert len(source.shards) == len(list(src.glob("model-*.safetensors")))
    expq.convert(snap, tmp_path / "from-hub", device="cpu")
    expq.convert(src, tmp_path / "from-dir", device="cpu")
    a, b = read_tensors(tmp_path / "from-hub"), read_tensors(tmp_path / "from-dir")
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    assert not any(p.is_symlink() for p in (tmp_path / "from-hub").rglob("*"))


def test_hub_snapshot_link_outside_blobs_refused(src, tmp_path):
    snap = hub_snapshot(src, tmp_path / "hub")
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (snap / "notes.txt").symlink_to(os.path.relpath(secret, snap))
    assert_clean_everywhere(snap, tmp_path / "out", f"file {snap}/notes.txt: side file resolves to {secret}{OUTSIDE}")

"""The source's identity catches any changed byte: a byte flipped in the middle of a shard (more than 1 MiB from
either end, where no header or edge sample sees it) makes a re-run "other settings", never "up to date"; a resume
after such a change never mixes old and new shards; a change while the conversion runs stops the commit; a Hub
source is identified by its commit and the Hub's own sha256 of each shard."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import example, tree_digest

import expq
from expq.errors import SourceError, UsageError
from expq.examples import build_example

MIB = 1 << 20
SHARD = "4MB"  # output shards: several, so that a resume keeps some


@pytest.fixture(scope="module")
def big_src(tmp_path_factory):
    """A Mixtral whose shards are ~12 MB (so a byte can be more than 1 MiB from both ends of one)."""
    return build_example("mixtral", tmp_path_factory.mktemp("big") / "src", dtype=torch.bfloat16,
                         max_shard_size="12MB", hidden_size=512, intermediate_size=1024, num_local_experts=4)


@pytest.fixture
def src(big_src, tmp_path):
    s = tmp_path / "src"
    shutil.copytree(big_src, s)
    return s


def flip_middle_byte(src) -> str:
    """Flip the lowest mantissa bit of a bf16 element in the middle of the largest shard (finite stays finite);
    returns the shard's name."""
    shard = max(src.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    pos = (size // 2) & ~1  # an element's low byte: data starts at a multiple of 8, bf16 elements are 2 bytes
    assert header + MIB < pos < size - MIB - 1, (header, pos, size)
    with open(shard, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 1]))
    return shard.name


def cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "expq.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_rerun_after_a_mid_shard_change_is_not_up_to_date(src, tmp_path):
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    assert expq.convert(src, out, device="cpu", max_shard_size=SHARD).up_to_date  # control: nothing changed
    name = flip_middle_byte(src)
    with pytest.raises(UsageError, match=rf"other settings \(source\.files: {name} differs \(size or content\)\)"):
        expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    rep = expq.convert(src, out, device="cpu", max_shard_size=SHARD, overwrite=True)
    assert not rep.up_to_date
    assert expq.verify(out, source=src, device="cpu", tokens=4).ok  # OUT is the changed source's conversion


def test_resume_after_a_mid_shard_change_never_mixes_shards(src, tmp_path):
    out = tmp_path / "out"
    # hold the run at a tensor write half way, then SIGTERM it: some shards finished and recorded, the rest not
    p = cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD, env_extra={"EXPQ_FAULT": "write:30:stall"})
    journal = tmp_path / ".out.expq-journal.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (journal.exists() and json.loads(journal.read_text())["files"]):
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 143, text
    kept = json.loads(journal.read_text())["files"]
    assert kept, text  # at least one shard of the old source is finished and kept for a resume
    flip_middle_byte(src)
    # the re-runs in this process (a UsageError is exit 2 on the command line: test_reliability's
    # test_rerun_on_a_complete_out_is_a_quick_noop runs that refusal as a real process)
    with pytest.raises(UsageError, match="a partial conversion into OUT with other settings is waiting"):
        expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    expq.convert(src, out, device="cpu", max_shard_size=SHARD, overwrite=True)
    clean = tmp_path / "clean" / "out"
    expq.convert(src, clean, device="cpu", max_shard_size=SHARD)
    assert tree_digest(out) == tree_digest(clean)  # every shard from the changed source: none kept from the old


def test_a_change_during_the_conversion_stops_the_commit(src, tmp_path):
    out = tmp_path / "out"
    flipped = []

    def change_once(nbytes, shards):
        if not flipped:
            flipped.append(flip_middle_byte(src))

    with pytest.raises(SourceError, match="changed while it was being converted") as ei:
        expq.convert(src, out, device="cpu", max_shard_size=SHARD, on_progress=change_once)
    assert ei.value.file == str(src / flipped[0])
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # staging and journal removed: a re-run starts anew
    assert expq.convert(src, out, device="cpu", max_shard_size=SHARD).shards == len(list(out.glob("*.safetensors")))


def test_local_identity_is_every_file_hashed_whole(src, tmp_path):
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    files = json.loads((out / "expq.json").read_text())["settings"]["source"]["files"]
    want = {p.name: [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()]
            for p in src.iterdir() if p.is_file() and p.name != "model.safetensors.index.json"}
    assert {name: [size, digest] for name, size, digest in files} == want


def test_hub_identity_is_the_commit_and_the_hubs_sha256(hub_server, tmp_path, tmp_path_factory):
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    commit = hub_server.add_repo("org/tiny-mixtral", folder)
    expq.convert("org/tiny-mixtral", tmp_path / "out", device="cpu")
    source = json.loads((tmp_path / "out" / "expq.json").read_text())["settings"]["source"]
    assert source == {"repo_id": "org/tiny-mixtral", "commit": commit,
                      "shards_sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                        for p in sorted(folder.glob("*.safetensors"))}}

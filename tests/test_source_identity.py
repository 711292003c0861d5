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


@pytest.fixture
def early():
    from expq.io import early_hash

    early_hash.stop()
    yield early_hash
    early_hash.stop()


def test_early_hashes_are_taken_only_for_files_unchanged_since(src, tmp_path, early, monkeypatch):
    """``io.early_hash`` (what the command line starts while torch imports): config.json and every shard, each
    the sha256 of its bytes; the identity takes them, hashing only the side files itself; a shard rewritten since
    (same size, its modification time put back: only the change time tells) is hashed again, so the identity
    and expq.json describe its new bytes."""
    import expq.io.regular as regular

    shards = sorted(src.glob("*.safetensors"))
    assert len(shards) >= 2
    assert early.start(src, threads=2) == 1 + len(shards)
    early.join()
    for p in [src / "config.json", *shards]:
        assert early.take(p) == (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()), p.name
    early.stop()

    assert early.start(src, threads=2) == 1 + len(shards)
    early.join()
    changed = src / flip_middle_byte(src)
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns))  # what a careful rewrite could keep
    assert early.take(changed) is None
    hashed = []
    real = regular.sha256_regular
    monkeypatch.setattr(regular, "sha256_regular", lambda path, *a, **k: hashed.append(path.name) or real(path, *a, **k))
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    side = sorted(p.name for p in src.iterdir() if p.is_file() and p.suffix != ".safetensors" and
                  p.name not in ("config.json", "model.safetensors.index.json"))
    assert sorted(hashed) == sorted([changed.name, *side])  # every other shard's early hash was taken
    files = {name: [size, digest] for name, size, digest in
             json.loads((out / "expq.json").read_text())["settings"]["source"]["files"]}
    for p in [src / "config.json", *shards]:
        assert files[p.name] == [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()], p.name


def test_a_file_not_started_is_the_callers_to_hash(src, early):
    """With no thread free (``threads=0``), ``take`` hands each queued file back at once (None) and never waits."""
    assert early.start(src, threads=0) >= 2
    t = time.monotonic()
    assert [early.take(p) for p in sorted(src.glob("*.safetensors"))] == [None] * len(list(src.glob("*.safetensors")))
    assert early.take(src / "config.json") is None and early.take(src / "config.json") is None  # taken: still None
    assert time.monotonic() - t < 5


EARLY_CLI = """
import json, sys
import expq.io.early_hash as eh
seen = []
start = eh.start
eh.start = lambda root, *a, **k: seen.append(["torch" in sys.modules, start(root, *a, **k)]) or seen[-1][1]
from expq.cli import main
sys.argv = ["expq", "convert", sys.argv[1], sys.argv[2], "--device", "cpu", "--json", "--format", "compressed-tensors"]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps(seen))
"""


def test_the_command_line_starts_hashing_the_source_before_torch(src, tmp_path):
    """The command line queues config.json and every shard before its first import of torch (a named --format
    included: its check reads the registry's names only)."""
    r = subprocess.run([sys.executable, "-c", EARLY_CLI, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == [[False, 1 + len(list(src.glob("*.safetensors")))]], seen
    assert (tmp_path / "out" / "expq.json").is_file()


EARLY_LINK_OUT = """
import json, sys
import expq.io.early_hash as eh
seen, hashed = [], []
start, sha = eh.start, eh.sha256_regular
eh.start = lambda root, *a, **k: seen.append(start(root, *a, **k)) or seen[-1]
eh.sha256_regular = lambda path, *a, **k: hashed.append(str(path)) or sha(path, *a, **k)
from expq.cli import main
sys.argv = ["expq", "convert", sys.argv[1], sys.argv[2], "--device", "cpu"]
try:
    main()
except SystemExit as e:
    code = e.code
print(json.dumps([code, seen, hashed]))
"""


def test_the_command_line_never_reads_a_file_linked_out_of_the_checkpoint(src, tmp_path):
    """A shard that is a link to a file outside the checkpoint directory is refused by the conversion before it
    reads any byte of it (``source.open_source``); the hashing the command line starts while torch imports must not
    read it either (nor any other file of that source: the conversion stops anyway)."""
    shard = max(src.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    outside = tmp_path / "elsewhere.bin"
    shard.rename(outside)
    shard.symlink_to(outside)
    r = subprocess.run([sys.executable, "-c", EARLY_LINK_OUT, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300)
    code, seen, hashed = json.loads(r.stdout.strip().splitlines()[-1])
    assert code == 1 and "outside the checkpoint directory" in r.stderr, r.stderr[-2000:]
    assert seen == [0] and hashed == [], (seen, hashed)
    assert not (tmp_path / "out").exists()

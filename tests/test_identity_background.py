"""A large directory source converted into a fresh OUT has its identity (every file's sha256) hashed while the
conversion writes, not before it (``conversion.hash_in_background``): the same bytes as hashing first, a re-run is
up to date, and a run stopped before the identity reached the journal is never resumed from a journal that cannot
vouch for the source: a kill there leaves nothing under OUT and the re-run converts afresh, an interrupt there keeps
nothing and says so. Real subprocesses, a real SIGKILL (the ``settle`` fault point) and a real SIGINT.

The fixtures are small, so the threshold (``IDENTITY_IN_BACKGROUND_BYTES``, 1 GiB) is set to 0 here: in-process
with monkeypatch, in a subprocess by the same assignment before the CLI runs."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time

import pytest
from helpers import example, run_cli, start_cli, tree_digest

import expq
import expq.conversion as conversion
from expq.output.outdir import JOURNAL, beside

BACKGROUND = "import expq.conversion as c; c.IDENTITY_IN_BACKGROUND_BYTES = 0"


# BACKGROUND, with the hash held until the file GATE exists, and the file HASHED made once the identity thread is
# over (settled or not)
GATED = (
    "import os, time, expq.conversion as c; c.IDENTITY_IN_BACKGROUND_BYTES = 0; real = c.local_identity\n"
    "def gated(*a, **k):\n"
    "    while not os.path.exists(GATE): time.sleep(0.02)\n"
    "    return real(*a, **k)\n"
    "class Marked(c.BackgroundIdentity):\n"
    "    def _main(self, *a):\n"
    "        try: super()._main(*a)\n"
    "        finally: open(HASHED, 'w').close()\n"
    "c.local_identity, c.BackgroundIdentity = gated, Marked\n"
    "import expq.api; expq.api.BackgroundIdentity = Marked")


def start_cli_hashing_in_background(*args, fault: str | None = None, gated: tuple | None = None) -> subprocess.Popen:
    """``gated``: (gate file, hashed file) for ``GATED``."""
    if gated is None:
        return start_cli(*args, fault=fault, prelude=BACKGROUND)
    gate, hashed = map(str, gated)
    return start_cli(*args, fault=fault, prelude=f"GATE, HASHED = {gate!r}, {hashed!r}\n{GATED}")


@pytest.fixture(scope="module")
def src_and_reference(tmp_path_factory):
    """(a mixtral source, the digest of its conversion with the identity hashed first)."""
    src = example(tmp_path_factory, "mixtral")
    ref = tmp_path_factory.mktemp("ref") / "out"
    expq.convert(src, ref, device="cpu")
    return src, tree_digest(ref)


def test_hashed_while_writing_gives_the_same_bytes_and_a_rerun_is_up_to_date(src_and_reference, tmp_path,
                                                                              monkeypatch):
    src, ref = src_and_reference
    settled = []
    real_settle = conversion.OutputDir.settle
    monkeypatch.setattr(conversion, "IDENTITY_IN_BACKGROUND_BYTES", 0)
    monkeypatch.setattr(conversion.OutputDir, "settle", lambda self, fp: (settled.append(fp), real_settle(self, fp)))
    out = tmp_path / "out"
    rep = expq.convert(src, out, device="cpu")
    assert len(settled) == 1 and "files" in settled[0]["source"]  # the background path ran, and settled once
    assert tree_digest(out) == ref  # expq.json holds the same settings, identity included
    assert expq.convert(src, out, device="cpu").up_to_date is True  # same settings, nothing to do
    assert rep.bytes_out > 0
    # negative control: a large-source threshold keeps the plain order (no settle)
    monkeypatch.setattr(conversion, "IDENTITY_IN_BACKGROUND_BYTES", 1 << 62)
    expq.convert(src, tmp_path / "out2", device="cpu")
    assert len(settled) == 1 and tree_digest(tmp_path / "out2") == ref


def test_kill_before_the_identity_is_settled_then_rerun_converts_afresh(src_and_reference, tmp_path):
    src, ref = src_and_reference
    out = tmp_path / "out"
    p = start_cli_hashing_in_background("convert", src, out, "--device", "cpu", fault="settle:1:kill")
    text, _ = p.communicate(timeout=180)
    assert p.returncode == -signal.SIGKILL, text
    assert not out.exists()  # a fresh OUT: nothing under the final name
    journal = json.loads(beside(out.absolute(), JOURNAL).read_text())
    assert journal["settled"] is False and journal["fingerprint"]["source"] == {"pending": True}
    code, text = run_cli("convert", src, out, "--device", "cpu")
    assert code == 0, text
    assert tree_digest(out) == ref
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]  # staging and journal gone


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_interrupt_before_the_identity_is_settled_keeps_nothing(src_and_reference, tmp_path):
    src, ref = src_and_reference
    out = tmp_path / "out"
    # the identity thread holds at the settle point until the run is interrupted
    p = start_cli_hashing_in_background("convert", src, out, "--device", "cpu", fault="settle:1:stall")
    journal = beside(out.absolute(), JOURNAL)
    deadline = time.monotonic() + 120
    while not journal.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT, text
    assert "before the source's identity was recorded; nothing is kept" in text
    assert sorted(x.name for x in tmp_path.iterdir()) == []  # no OUT, no staging, no journal
    code, text = run_cli("convert", src, out, "--device", "cpu")
    assert code == 0, text
    assert tree_digest(out) == ref


@pytest.mark.slow  # make test-slow (CI runs it after make test)
def test_a_source_file_written_after_it_was_read_and_before_it_was_hashed_is_never_resumed(tmp_path,
                                                                                            tmp_path_factory):
    # The pipelines read the source shards before the background hash does: a shard rewritten in between gave an
    # identity of the new bytes settled over output shards of the old ones, and an interrupted run resumed them
    # (a checkpoint mixing two sources, which verify passes).
    old, new = example(tmp_path_factory, "mixtral"), example(tmp_path_factory, "mixtral", seed=1)
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(old, src)
    gate, hashed = tmp_path / "gate", tmp_path / "hashed"
    args = ("convert", src, out, "--device", "cpu", "--max-shard-size", "60KB")
    # the 38th tensor write stalls until the interrupt: by then 3 of the 4 output shards are recorded
    p = start_cli_hashing_in_background(*args, fault="write:38:stall", gated=(gate, hashed))
    journal = beside(out.absolute(), JOURNAL)
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(journal.read_text())["files"]:
                break
        time.sleep(0.05)
    assert p.poll() is None and json.loads(journal.read_text())["files"]  # output shards of the old bytes
    for f in sorted(new.glob("*.safetensors")):  # same names and sizes, other bytes, written in place
        assert f.stat().st_size == (src / f.name).stat().st_size
        with open(src / f.name, "r+b") as dst:
            dst.write(f.read_bytes())
    gate.touch()
    while not hashed.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hashed.exists()
    p.send_signal(signal.SIGINT)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT, text
    assert "nothing is kept" in text
    assert sorted(x.name for x in tmp_path.iterdir()) == ["gate", "hashed", "src"]
    code, text = run_cli(*args)
    assert code == 0, text
    assert "resumed" not in text
    ref_new, ref_old = tmp_path_factory.mktemp("ref") / "new", tmp_path_factory.mktemp("ref") / "old"
    expq.convert(src, ref_new, device="cpu", max_shard_size="60KB")  # the source as it is now, in one run
    expq.convert(old, ref_old, device="cpu", max_shard_size="60KB")
    assert tree_digest(ref_old) != tree_digest(ref_new)  # negative control: the rewrite changes the output
    assert tree_digest(out) == tree_digest(ref_new)

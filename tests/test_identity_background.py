"""A large directory source converted into a fresh OUT has its identity (every file's sha256) hashed while the
conversion writes, not before it (``conversion.hash_in_background``): the same bytes as hashing first, a re-run is
up to date, and a run stopped before the identity reached the journal is never resumed from a journal that cannot
vouch for the source: a kill there leaves nothing under OUT and the re-run converts afresh, an interrupt there keeps
nothing and says so. Real subprocesses, a real SIGKILL (the ``settle`` fault point) and a real SIGINT.

The fixtures are small, so the threshold (``IDENTITY_IN_BACKGROUND_BYTES``, 1 GiB) is set to 0 here: in-process
with monkeypatch, in a subprocess by the same assignment before the CLI runs."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from helpers import example, run_cli, start_cli, tree_digest

import expq
import expq.conversion as conversion
from expq.output.outdir import JOURNAL, beside

BACKGROUND = "import expq.conversion as c; c.IDENTITY_IN_BACKGROUND_BYTES = 0"


def start_cli_hashing_in_background(*args, fault: str | None = None) -> subprocess.Popen:
    return start_cli(*args, fault=fault, prelude=BACKGROUND)


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
    assert "while the source was still being hashed; nothing is kept" in text
    assert sorted(x.name for x in tmp_path.iterdir()) == []  # no OUT, no staging, no journal
    code, text = run_cli("convert", src, out, "--device", "cpu")
    assert code == 0, text
    assert tree_digest(out) == ref

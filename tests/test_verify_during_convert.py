"""verify (and push) read OUT under a shared lock that a conversion into OUT takes exclusively only to swap OUT and
delete the old checkpoint: a commit waits for a reader, a reader for a commit in progress, and verify never sees OUT
change under it. Real subprocesses overlapping on one OUT, a commit held at its exchange (the writer's EXPQ_FAULT
``stall``), and the last one out removing the lock file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import example, start_cli, tree_digest

import expq
from expq.output.outdir import reading


start = start_cli


def wait_for(pred, what: str, proc: subprocess.Popen | None = None, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        assert proc is None or proc.poll() is None, f"{what}: the process ended: {proc.stdout.read()}"
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def journal_phase(out) -> str | None:
    try:
        return json.loads((out.parent / f".{out.name}.expq-journal.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(source A, source B, digest of A's conversion, digest of B's conversion)."""
    a, b = example(tmp_path_factory, "mixtral"), example(tmp_path_factory, "olmoe")
    ra, rb = tmp_path_factory.mktemp("a") / "out", tmp_path_factory.mktemp("b") / "out"
    expq.convert(a, ra, device="cpu")
    expq.convert(b, rb, device="cpu")
    return a, b, tree_digest(ra), tree_digest(rb)


def test_a_commit_waits_for_a_reader_and_the_reader_sees_the_old_checkpoint_whole(checkpoints, tmp_path):
    a, b, da, db = checkpoints
    out = tmp_path / "out"
    expq.convert(a, out, device="cpu")
    with reading(out):  # a verify or push in progress
        p = start("convert", b, out, "--device", "cpu", "--overwrite")
        wait_for(lambda: journal_phase(out) == "swap", "the conversion reaches its commit", p)
        time.sleep(0.5)
        assert p.poll() is None and tree_digest(out) == da  # waiting: OUT is still the old one
        report = expq.verify(out, device="cpu")  # a second reader meanwhile
        assert report.ok
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 0, text
    assert tree_digest(out) == db and sorted(os.listdir(tmp_path)) == ["out"]


def test_verify_waits_for_a_commit_in_progress_then_reads_the_new_checkpoint(checkpoints, tmp_path):
    a, b, da, db = checkpoints
    out = tmp_path / "out"
    expq.convert(a, out, device="cpu")
    conv = start("convert", b, out, "--device", "cpu", "--overwrite", fault="rename:1:stall")
    wait_for(lambda: journal_phase(out) == "swap", "the conversion holds its commit", conv)
    time.sleep(0.5)  # at its exchange, holding the commit lock
    ver = start("verify", out, "--device", "cpu", "--json")
    time.sleep(2)
    assert ver.poll() is None  # waiting for the commit
    conv.send_signal(signal.SIGINT)  # the stall ends; the commit goes on
    text, _ = conv.communicate(timeout=120)
    assert conv.returncode in (0, 130), text
    vtext, _ = ver.communicate(timeout=180)
    assert ver.returncode == 0, vtext
    assert "Traceback" not in vtext and "FileNotFoundError" not in vtext
    final = tree_digest(out)
    assert final in (da, db)
    assert not (tmp_path / ".out.expq-lock").exists()


@pytest.mark.slow
def test_overlapping_verifies_and_overwrites_never_fail_verify(checkpoints, tmp_path):
    """Three rounds of a convert --overwrite between two models with a verify started alongside: every verify
    passes (on one whole checkpoint), every conversion succeeds, nothing is left beside OUT."""
    a, b, da, db = checkpoints
    out = tmp_path / "out"
    expq.convert(a, out, device="cpu")
    for src in (b, a, b):
        conv = start("convert", src, out, "--device", "cpu", "--overwrite")
        ver = start("verify", out, "--device", "cpu")
        ctext, _ = conv.communicate(timeout=240)
        vtext, _ = ver.communicate(timeout=240)
        assert conv.returncode == 0, ctext
        assert ver.returncode == 0 and "Traceback" not in vtext, vtext
    assert tree_digest(out) == db and sorted(os.listdir(tmp_path)) == ["out"]

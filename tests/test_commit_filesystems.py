"""The commit keeps its promise on every filesystem, or refuses before any work: a filesystem without
``renameat2(RENAME_EXCHANGE)`` (emulated with ``strace -e inject=renameat2:error=EINVAL``), OUT that is a mount point
(a real tmpfs, a real bind mount), a kill at every step of a commit that replaces an OUT holding a pushed model
card (real SIGKILL through the writer's EXPQ_FAULT seam): OUT always holds the complete old or the complete new
checkpoint, the card is carried across byte for byte, what a kill leaves beside OUT goes with the next command, and
anything else in OUT that expq did not write is refused, never deleted."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import reference_conversions, tree_digest
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.output import faults

STRACE = shutil.which("strace")
CARD = "---\nlicense: apache-2.0\n---\n# the model card `expq push` wrote\n"


def cli(*args, fault=None, prefix=()) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EXPQ_FAULT", None)
    if fault:
        env["EXPQ_FAULT"] = fault
    p = subprocess.run([*prefix, sys.executable, "-m", "expq.cli", *map(str, args)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    return p.returncode, p.stdout


def in_process(*args) -> tuple[int, str]:
    """The same command line in this process (typer's CliRunner), where a real process is proven by another call."""
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def beside(out) -> list[str]:
    """What lies beside OUT, OUT aside."""
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def without_card(digest: dict) -> dict:
    return {k: v for k, v in digest.items() if k != "README.md"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(source, its conversion's digest, an earlier conversion of another family and its digest)."""
    return reference_conversions(tmp_path_factory)


# --- no RENAME_EXCHANGE ----------------------------------------------------------------------------------------------
def _strace_works() -> bool:
    if STRACE is None:
        return False
    return subprocess.run([*NO_EXCHANGE, "true"], capture_output=True).returncode == 0


# --seccomp-bpf: the kernel stops the process only at renameat2 (not at every syscall); the same calls fail
NO_EXCHANGE = (STRACE or "strace", "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null", "-e", "trace=renameat2", "-e",
               "inject=renameat2:error=EINVAL")


@pytest.mark.slow
@pytest.mark.skipif(not _strace_works(), reason="needs strace (and ptrace) to emulate a filesystem without "
                                                 "RENAME_EXCHANGE")
def test_without_exchange_replacing_is_refused_up_front_and_a_new_out_still_converts(reference, tmp_path):
    src, new, old_dir, old = reference
    out = tmp_path / "out"
    shutil.copytree(old_dir, out)
    code, text = cli("convert", src, out, "--device", "cpu", "--overwrite", prefix=NO_EXCHANGE)
    assert code == 2 and len(error_lines(text)) == 1, text
    assert "cannot swap two folders atomically" in text and "remove OUT yourself" in text, text
    assert "converted:" not in text  # refused before any work
    assert tree_digest(out) == old and beside(out) == []
    fresh = tmp_path / "fresh"  # no exchange is needed onto a missing OUT: it converts as always
    code, text = cli("convert", src, fresh, "--device", "cpu", prefix=NO_EXCHANGE)
    assert code == 0, text
    assert tree_digest(fresh) == new
    shutil.rmtree(out)  # what the line says
    code, text = cli("convert", src, out, "--device", "cpu", prefix=NO_EXCHANGE)
    assert code == 0 and tree_digest(out) == new, text


@pytest.mark.skipif(not _strace_works(), reason="needs strace (and ptrace)")
def test_without_exchange_a_waiting_partial_run_is_kept(reference, tmp_path):
    src, new, old_dir, old = reference
    out = tmp_path / "out"
    shutil.copytree(old_dir, out)
    code, text = cli("convert", src, out, "--device", "cpu", "--overwrite", fault="rename:1:kill")
    assert code == -signal.SIGKILL, text  # killed at the commit: a complete staging folder waits
    staged = tree_digest(tmp_path / ".out.expq-partial")
    code, text = cli("convert", src, out, "--device", "cpu", "--overwrite", prefix=NO_EXCHANGE)
    assert code == 2 and "cannot swap two folders atomically" in text, text
    assert tree_digest(out) == old and tree_digest(tmp_path / ".out.expq-partial") == staged
    report = expq.convert(src, out, device="cpu", overwrite=True)  # where the exchange works, it resumes
    assert report.shards_resumed == 1 and tree_digest(out) == new and beside(out) == []


# --- OUT on another filesystem ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def mounted(*args):
    target = args[-1]
    if os.geteuid() != 0 or subprocess.run(["mount", *map(str, args)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount here (needs root and mount permission)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize("kind", ["bind", pytest.param("tmpfs", marks=pytest.mark.slow)])
def test_out_that_is_a_mount_point_is_refused_before_any_work(kind, reference, tmp_path):
    src, new, _, _ = reference
    out = tmp_path / "volume"
    out.mkdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    args = ("-t", "tmpfs", "tmpfs", out) if kind == "tmpfs" else ("--bind", other, out)
    with mounted(*args):
        (out / "data.txt").write_text("the volume's own file\n")
        code, text = cli("convert", src, out, "--device", "cpu")
        assert code == 2 and len(error_lines(text)) == 1, text
        assert "OUT is a mount point" in text and str(out / "model") in text and "converted:" not in text, text
        assert sorted(os.listdir(out)) == ["data.txt"] and beside(out) == ["elsewhere"]
        code, text = cli("convert", src, out / "model", "--device", "cpu")  # what the line says
        assert code == 0, text
        assert tree_digest(out / "model") == new and (out / "data.txt").read_text() == "the volume's own file\n"


# --- the model card, carried across ----------------------------------------------------------------------------------
def test_a_pushed_card_is_carried_across_a_rebuild_and_an_overwrite(reference, tmp_path):
    src, new, _, _ = reference
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    (out / "README.md").write_text(CARD)
    os.utime(out / "README.md", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    (out / "model.safetensors").write_bytes(b"x" * (out / "model.safetensors").stat().st_size)  # damaged: rebuilt
    report = expq.convert(src, out, device="cpu")
    assert not report.up_to_date and without_card(tree_digest(out)) == new
    assert (out / "README.md").read_text() == CARD
    assert (out / "README.md").stat().st_mtime_ns == 1_600_000_000_000_000_000
    code, text = cli("convert", src, out, "--device", "cpu", "--max-shard-size", "40KB", "--overwrite")
    assert code == 0, text
    assert (out / "README.md").read_text() == CARD and len(list(out.glob("*.safetensors"))) > 1
    assert expq.verify(out, device="cpu").ok and beside(out) == []


def test_the_sources_card_is_replaced_by_the_new_sources_but_an_edited_one_is_kept(reference, tmp_path):
    src0, _, _, _ = reference
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    (src / "README.md").write_text("# source card v1\n")
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    assert (out / "README.md").read_text() == "# source card v1\n"
    (src / "README.md").write_text("# source card v2\n")
    expq.convert(src, out, device="cpu", overwrite=True)
    assert (out / "README.md").read_text() == "# source card v2\n"  # the copy expq made follows the source
    (out / "README.md").write_text("# my edits\n")
    (src / "README.md").write_text("# source card v3\n")
    expq.convert(src, out, device="cpu", overwrite=True)
    assert (out / "README.md").read_text() == "# my edits\n"  # a card someone wrote is kept


def test_an_empty_folder_a_user_made_in_out_is_refused_never_deleted(reference, tmp_path):
    src, new, _, _ = reference
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    (out / "mine" / "later").mkdir(parents=True)
    for run, extra in ((cli, ()), (in_process, ("--overwrite", "--max-shard-size", "40KB"))):
        code, text = run("convert", src, out, "--device", "cpu", *extra)
        assert code == 2 and "mine/" in text and "expq did not write" in text, text
        assert (out / "mine" / "later").is_dir()


# --- a kill at every step of a commit that replaces OUT --------------------------------------------------------------
def fsync_points(src, old_dir, tmp_path) -> int:
    """How many fsync points a conversion of ``src`` replacing ``old_dir`` (with a card) passes, counted in this
    process through the fault seam (``expq.output.faults``) (a rule set past the last one never fires)."""
    out = tmp_path / "count" / "out"
    shutil.copytree(old_dir, out)
    (out / "README.md").write_text(CARD)
    saved, faults.active = faults.active, faults.Faults("fsync:1000000:kill")
    try:
        expq.convert(src, out, device="cpu", overwrite=True)
        return faults.active.count["fsync"]
    finally:
        faults.active = saved
        shutil.rmtree(out.parent)


@pytest.mark.slow
def test_a_kill_at_each_step_of_the_commit_leaves_old_or_new_and_the_card(reference, tmp_path):
    """The last fsync points of a replacing conversion (the staged folders, the journal's ``swap``, the card's
    copy, the parent after the exchange) and the exchange itself: after each kill OUT is the old or the new
    checkpoint with the card; verify passes and takes away the lock; the same command finishes and leaves
    nothing beside OUT."""
    src, new, old_dir, old = reference
    last = fsync_points(src, old_dir, tmp_path)
    faults = [f"fsync:{n}:kill" for n in range(last - 4, last + 1)] + ["rename:1:kill"]
    states = []
    for k, fault in enumerate(faults):
        out = tmp_path / f"k{k}" / "out"
        shutil.copytree(old_dir, out)
        (out / "README.md").write_text(CARD)
        code, text = cli("convert", src, out, "--device", "cpu", "--overwrite", fault=fault)
        assert code == -signal.SIGKILL, (fault, text)
        state = without_card(tree_digest(out))
        assert state in (without_card(old), new), f"{fault}: OUT is a mixture"
        assert (out / "README.md").read_text() == CARD, fault
        states.append("new" if state == new else "old")
        assert ".out.expq-lock" in beside(out)
        report = expq.verify(out, device="cpu")
        assert report.ok and ".out.expq-lock" not in beside(out), fault  # the last reader out removes it
        expq.convert(src, out, device="cpu", overwrite=True)  # the same command again
        assert without_card(tree_digest(out)) == new and (out / "README.md").read_text() == CARD, fault
        assert beside(out) == [], (fault, beside(out))
    assert states[-2] == "new" and states[-1] == "old", states  # the exchange is the commit point

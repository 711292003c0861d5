"""expq never writes, reads or deletes through a symbolic link at one of its own names: ``.<OUT>.expq-partial``
(an interrupted run's staging moved to another disk and linked back), ``.<OUT>.expq-lock``, the journal and its
``.tmp``, OUT itself, and links inside the staging folder. Each is refused with one line naming it (exit 2), the
link and what it points to are left exactly as they were, and once the link is gone the same command finishes.
Real links, real subprocesses, a real SIGKILL (the writer's EXPQ_FAULT seam)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import example, tree_digest

import expq

SHARD = "40KB"


def cli(*args, fault=None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EXPQ_FAULT", None)
    if fault:
        env["EXPQ_FAULT"] = fault
    p = subprocess.run([sys.executable, "-m", "expq.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=240)
    return p.returncode, p.stdout


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def victim_tree(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what an attack would change)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(source, digest of its conversion with 40 kB shards)."""
    src = example(tmp_path_factory, "mixtral")
    ref = tmp_path_factory.mktemp("ref") / "out"
    expq.convert(src, ref, device="cpu", max_shard_size=SHARD)
    return src, tree_digest(ref)


def killed_partial(src, out) -> None:
    """A conversion into ``out`` killed from outside (SIGKILL) once its journal records two finished shards: the
    staging folder and journal an interrupted run leaves."""
    plan = expq.inspect(src, max_shard_size=SHARD)
    writes = sum(1 for j in plan.jobs if j.kind != "copy" for o in j.outputs if o.value is None)
    env = {**os.environ, "EXPQ_FAULT": f"write:{writes - 2}:stall"}
    p = subprocess.Popen([sys.executable, "-m", "expq.cli", "convert", str(src), str(out), "--device", "cpu",
                          "--max-shard-size", SHARD], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = out.parent / f".{out.name}.expq-journal.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if len(json.loads(journal.read_text()).get("files", {})) >= 2:
                break
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL and len(json.loads(journal.read_text())["files"]) >= 2


def test_a_staging_folder_linked_from_another_disk_is_refused_and_nothing_in_it_deleted(reference, tmp_path):
    src, ref = reference
    out = tmp_path / "run" / "out"
    killed_partial(src, out)
    staging = out.parent / ".out.expq-partial"
    elsewhere = tmp_path / "bigdisk" / "partial"
    elsewhere.parent.mkdir()
    shutil.move(staging, elsewhere)  # moved to a larger disk and linked back
    (elsewhere / "mine.txt").write_text("not expq's")
    (elsewhere / "notes").mkdir()
    (elsewhere / "notes" / "todo.md").write_text("also not expq's")
    staging.symlink_to(elsewhere)
    before = victim_tree(elsewhere)
    code, text = cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD)
    assert code == 2 and len(error_lines(text)) == 1, text
    assert ".out.expq-partial" in text and "symbolic link" in text and "mv" in text, text
    assert victim_tree(elsewhere) == before and staging.is_symlink() and not out.exists()
    staging.unlink()  # what the line says: move the folder itself back (after taking one's own files out of it)
    (elsewhere / "mine.txt").unlink()
    shutil.rmtree(elsewhere / "notes")
    shutil.move(elsewhere, staging)
    report = expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    assert report.shards_resumed > 0 and tree_digest(out) == ref


def test_a_link_inside_the_staging_folder_is_refused_not_followed(reference, tmp_path):
    src, ref = reference
    out = tmp_path / "out"
    killed_partial(src, out)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious" * 100)
    staging = tmp_path / ".out.expq-partial"
    name = sorted(p.name for p in staging.iterdir())[0]
    (staging / name).unlink()
    (staging / name).symlink_to(victim)  # a finished shard's name, linked out
    code, text = cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD)
    assert code == 2 and len(error_lines(text)) == 1 and name in text and "link" in text, text
    assert victim.read_bytes() == b"precious" * 100 and (staging / name).is_symlink()
    (staging / name).unlink()
    expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    assert tree_digest(out) == ref and victim.read_bytes() == b"precious" * 100


@pytest.mark.parametrize("name", [".out.expq-lock", ".out.expq-journal.json", ".out.expq-journal.json.tmp"])
def test_a_link_at_the_lock_or_journal_is_refused_and_its_target_untouched(name, reference, tmp_path):
    """Another user's link in a shared models directory: the file it points to is neither truncated nor written,
    the link is not removed; after it is removed, the same command converts."""
    src, ref = reference
    work = tmp_path / "shared"
    work.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("a file the converting user can write\n")
    (work / name).symlink_to(victim)
    out = work / "out"
    code, text = cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD)
    assert code == 2 and len(error_lines(text)) == 1, text
    assert name in text and "symbolic link" in text and "Traceback" not in text, text
    assert victim.read_text() == "a file the converting user can write\n" and (work / name).is_symlink()
    assert not out.exists() and sorted(p.name for p in work.iterdir()) == [name]
    (work / name).unlink()
    expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    assert tree_digest(out) == ref and sorted(p.name for p in work.iterdir()) == ["out"]


def test_a_link_at_the_lock_is_refused_by_verify_too(reference, tmp_path):
    src, ref = reference
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", max_shard_size=SHARD)
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    (tmp_path / ".out.expq-lock").symlink_to(victim)
    code, text = cli("verify", out, "--device", "cpu")
    assert code == 2 and ".out.expq-lock" in text and "symbolic link" in text, text
    assert victim.read_text() == "x"


@pytest.mark.parametrize("existing", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["replacing", "new"])
def test_out_that_is_a_symlink_is_refused_naming_its_target(existing, reference, tmp_path, tmp_path_factory):
    src, ref = reference
    real = tmp_path / "real"
    if existing:
        expq.convert(example(tmp_path_factory, "olmoe"), real, device="cpu")
    else:
        real.mkdir()
    before = tree_digest(real)
    out = tmp_path / "out"
    out.symlink_to(real)
    code, text = cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD, "--overwrite")
    assert code == 2 and len(error_lines(text)) == 1, text
    assert "OUT is a symbolic link" in text and str(real) in text, text
    assert out.is_symlink() and os.readlink(out) == str(real) and tree_digest(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "real"]
    expq.convert(src, real, device="cpu", max_shard_size=SHARD, overwrite=True)  # the folder it points to, as the
    # line says (in this process, as this file's other negative controls)
    assert tree_digest(real) == ref



def test_an_out_name_too_long_for_the_files_beside_it_is_a_usage_error(reference, tmp_path):
    """OUT's name fits the filesystem but ``.<OUT>.expq-journal.json.tmp`` does not: one usage line saying the
    longest OUT name that works (it was 'the journal of an earlier conversion is unreadable' of a journal that
    does not exist; found by a hostile-user pass); a name of exactly that length converts."""
    src, _ = reference
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    room = limit - len(".expq-journal.json.tmp") - 1
    code, text = cli("convert", src, tmp_path / ("b" * (room + 1)), "--device", "cpu")
    assert code == 2 and error_lines(text) == [
        f"error: file {tmp_path / ('b' * (room + 1))}: OUT's name is {room + 1} bytes: the files expq keeps beside OUT "
        f"while it works (.<OUT>.expq-journal.json.tmp and others) would exceed this filesystem's {limit}-byte "
        f"limit on a name (give OUT a name of at most {room} bytes)"], text
    assert list(tmp_path.iterdir()) == []
    expq.convert(src, tmp_path / ("b" * room), device="cpu", max_shard_size=SHARD)
    assert (tmp_path / ("b" * room) / "expq.json").is_file()

@pytest.fixture
def hub_repo(hub_server, tmp_path, tmp_path_factory):
    """A tiny Mixtral in six shards on the test Hub (tests/hub_server.py)."""
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    hub_server.add_repo("org/links-mixtral", folder)
    return "org/links-mixtral", sorted(p.name for p in folder.glob("*.safetensors"))


def test_a_stream_folder_linked_to_a_scratch_disk_is_refused_and_nothing_there_deleted(hub_repo, tmp_path):
    repo, _ = hub_repo
    scratch = tmp_path / "scratch"
    (scratch / "datasets").mkdir(parents=True)
    (scratch / "datasets" / "train.jsonl").write_text('{"text": "mine"}\n')
    (scratch / "other-run.safetensors").write_bytes(b"\0" * 4096)
    before = victim_tree(scratch)
    out = tmp_path / "models" / "out"
    out.parent.mkdir()
    stream = out.parent / ".out.expq-stream"
    stream.symlink_to(scratch)
    code, text = cli("convert", repo, out, "--stream", "--device", "cpu")
    assert code == 2 and len(error_lines(text)) == 1, text
    assert ".out.expq-stream" in text and "symbolic link" in text and "Traceback" not in text, text
    assert victim_tree(scratch) == before and stream.is_symlink() and not out.exists()
    stream.unlink()
    expq.convert(repo, out, stream=True, device="cpu")  # in this process, as this file's other negative controls
    assert expq.verify(out, device="cpu").ok and sorted(p.name for p in out.parent.iterdir()) == ["out"]
    assert victim_tree(scratch) == before


def test_a_link_inside_the_stream_folder_is_refused_not_followed(hub_repo, tmp_path):
    repo, shards = hub_repo
    out = tmp_path / "out"
    stream = tmp_path / ".out.expq-stream"
    stream.mkdir()  # as a killed run leaves it, with one of its shard names linked to a file elsewhere
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 64)
    (stream / shards[0]).symlink_to(victim)
    code, text = cli("convert", repo, out, "--stream", "--device", "cpu")
    assert code == 2 and len(error_lines(text)) == 1 and shards[0] in text and "link" in text, text
    assert victim.read_bytes() == b"precious" * 64 and (stream / shards[0]).is_symlink() and not out.exists()

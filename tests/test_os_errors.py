"""Every OSError during convert is one line naming the file: ENOSPC writing the first journal, the staging folder,
config.json, expq.json or a side file, EIO reading a source shard. After a successful commit, a failed flush of
OUT's parent and an old checkpoint that cannot be deleted are warnings (exit 0, OUT complete), naming what is left.

Faults are injected at exact syscalls on exact paths with ``strace -P PATH -e inject=SYSCALL:error=ERRNO`` on a real
``expq convert`` process (skipped without strace), and through the writer's ``EXPQ_FAULT`` seam."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import example, tree_digest

import expq

STRACE = shutil.which("strace")
# --seccomp-bpf: the kernel stops the process only at the traced syscalls (not at every one, which made each traced
# conversion 3-5 times slower); the same syscalls fail on the same paths
STRACE_FAST = (STRACE or "strace", "-f", "--seccomp-bpf")


def _strace_works() -> bool:
    if STRACE is None:
        return False
    r = subprocess.run([*STRACE_FAST, "-qq", "-o", os.devnull, "true"], capture_output=True)
    return r.returncode == 0  # ptrace can be forbidden in a container


pytestmark = pytest.mark.skipif(not _strace_works(), reason="strace is not installed or cannot trace here")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(source, the digest of its conversion)."""
    src = example(tmp_path_factory, "mixtral")
    ref = tmp_path_factory.mktemp("ref") / "out"
    expq.convert(src, ref, device="cpu")
    return src, tree_digest(ref)


def convert_injected(src, out, path, syscalls: str, errno_name: str, *extra, when: str = ""):
    """``expq convert`` with every ``syscalls`` call on ``path`` (or an fd open on it) failing with ``errno_name``."""
    inject = f"{syscalls}:error={errno_name}" + (f":when={when}" if when else "")
    cmd = [*STRACE_FAST, "-qq", "-o", os.devnull, "-P", str(path), "-e", f"trace={syscalls}", "-e", f"inject={inject}",
           sys.executable, "-m", "expq.cli", "convert", str(src), str(out), "--device", "cpu", *map(str, extra)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


ENOSPC = "No space left on device"


def test_enospc_on_the_first_journal_names_it(reference, tmp_path):
    src, _ = reference
    journal_tmp = tmp_path / ".out.expq-journal.json.tmp"
    code, text = convert_injected(src, tmp_path / "out", journal_tmp, "write", "ENOSPC")
    assert code == 1
    assert error_line(text) == f"error: file {journal_tmp}: cannot write the journal: {ENOSPC}"


def test_enospc_making_the_staging_folder_names_it(reference, tmp_path):
    src, _ = reference
    staging = tmp_path / ".out.expq-partial"
    code, text = convert_injected(src, tmp_path / "out", staging, "mkdir,mkdirat", "ENOSPC")
    assert code == 1
    assert error_line(text) == f"error: file {staging}: cannot make the staging folder: {ENOSPC}"


@pytest.mark.parametrize("name", ["config.json", pytest.param("expq.json", marks=pytest.mark.slow),
                                  pytest.param("tokenizer.json", marks=pytest.mark.slow)])
def test_enospc_on_a_small_file_names_it_and_the_same_command_resumes(name, reference, tmp_path):
    src, digest = reference
    staged = tmp_path / ".out.expq-partial" / name
    code, text = convert_injected(src, tmp_path / "out", staged, "write,pwrite64", "ENOSPC")
    assert code == 1
    assert error_line(text) == f"error: file {staged}: cannot write: {ENOSPC}"
    assert not (tmp_path / "out").exists()
    rep = expq.convert(src, tmp_path / "out", device="cpu")  # disk space back: the same command finishes
    assert rep.shards_resumed == rep.shards and tree_digest(tmp_path / "out") == digest


@pytest.mark.parametrize("which", ["tensor", pytest.param("shard", marks=pytest.mark.slow),
                                   pytest.param("index", marks=pytest.mark.slow)])
def test_eio_reading_a_source_file_names_it(which, reference, tmp_path):
    """``shard``/``index``: every read fails (the header, the identity's hash); ``tensor``: from the third read of a
    thread on (strace counts per thread), which is the pipeline reading the shard's tensors."""
    src, _ = reference
    mine = tmp_path / "src"
    shutil.copytree(src, mine)
    shard = sorted(mine.glob("model-*.safetensors"))[2] if which != "index" else mine / "model.safetensors.index.json"
    code, text = convert_injected(mine, tmp_path / "out", shard, "read,pread64,copy_file_range", "EIO",
                                  when="3+" if which == "tensor" else "")
    assert code == 1
    line = error_line(text)
    where = f"error: file {shard}, tensor " if which == "tensor" else f"error: file {shard}: cannot read"
    assert line.startswith(where) and line.endswith("Input/output error"), line
    assert not (tmp_path / "out").exists()


def test_eio_flushing_the_parent_after_the_commit_warns_and_exits_0(reference, tmp_path):
    src, digest = reference
    parent = tmp_path / "models"
    parent.mkdir()
    code, text = convert_injected(src, parent / "out", parent, "fsync", "EIO")
    assert code == 0, text
    warning = [ln for ln in text.splitlines() if ln.startswith("WARNING: ")]
    assert warning == [f"WARNING: the new conversion is in {parent / 'out'}, but file {parent}: cannot flush to disk: "
                       "Input/output error: it may not survive a power loss until the folder is flushed (run sync)"]
    assert tree_digest(parent / "out") == digest
    assert sorted(p.name for p in parent.iterdir()) == ["out"]  # journal and lock gone


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning(reference, tmp_path):
    src, _ = reference
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu", dtype="float16")  # the checkpoint to replace
    staging = tmp_path / ".out.expq-partial"  # after the exchange it holds the old checkpoint
    code, text = convert_injected(src, out, staging, "unlinkat", "EACCES", "--overwrite")
    assert code == 0, text
    assert "cannot move the finished conversion into place" not in text
    warning = [ln for ln in text.splitlines() if ln.startswith("WARNING: ")]
    assert warning == [f"WARNING: the new conversion is in {out}, but the checkpoint it replaced could not be "
                       f"deleted (Permission denied): remove {staging} by hand"]
    assert expq.verify(out, source=src, device="cpu", tokens=4).ok
    assert (staging / "expq.json").is_file()  # the leftover is the old checkpoint, named in the warning


def test_fault_seam_enospc_on_a_side_file_names_it(reference, tmp_path):
    """The same through EXPQ_FAULT: the 4th fsync of a one-shard conversion is the first side file's (1: the first
    journal, 2: the shard, 3: the journal recording it)."""
    src, _ = reference
    env = {**os.environ, "EXPQ_FAULT": "fsync:4:enospc"}
    r = subprocess.run([sys.executable, "-m", "expq.cli", "convert", src, tmp_path / "out", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1
    staged = tmp_path / ".out.expq-partial" / "generation_config.json"
    assert error_line(r.stdout + r.stderr) == f"error: file {staged}: cannot flush to disk: {ENOSPC}"

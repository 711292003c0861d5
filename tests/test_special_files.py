"""Special files are refused before anything reads them, with one line naming them: a named pipe (FIFO), a
character device or a socket as a side file in SRC, a FIFO as a shard, a FIFO or /dev/zero as ``--layout``; nothing
hangs, nothing reads without end. A huge sparse side file (a valid input) is hashed and copied in chunks: memory
stays small and the copy keeps its holes."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import example
from helpers import run_cli as run_helper

import expq
from expq.errors import LayoutError, SourceError
from expq.io.regular import open_regular

TIMEOUT = 180  # a hang fails the test instead of stopping the suite


@pytest.fixture
def src(tmp_path, tmp_path_factory) -> Path:
    s = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), s)
    return s


def run_cli(*args) -> tuple[int, str]:
    return run_helper(*args, timeout=TIMEOUT)


def assert_refused(src: Path, out: Path, line: str, *extra) -> None:
    """``expq convert``, a real process (a hang fails it at ``TIMEOUT``), gives exactly ``line`` (exit 1, no
    traceback) and writes nothing."""
    code, text = run_cli("convert", src, out, "--device", "cpu", *extra)
    assert code == 1, text
    assert f"error: {line}" in text.splitlines() and "Traceback" not in text, text
    assert not out.exists()


def char_device(path: Path) -> None:
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        pytest.skip("no permission to make a character device here")


def test_fifo_side_file_refused(src, tmp_path):
    os.mkfifo(src / "notes.txt")
    assert_refused(src, tmp_path / "out",
                   f"file {src / 'notes.txt'}: cannot read the side file: it is a named pipe (FIFO), not a regular file")


def test_character_device_side_file_refused(src, tmp_path):
    char_device(src / "vocab.json")
    with pytest.raises(SourceError, match="it is a character device, not a regular file") as ei:
        expq.inspect(src)
    assert ei.value.file == str(src / "vocab.json")
    assert_refused(src, tmp_path / "out",
                   f"file {src / 'vocab.json'}: cannot read the side file: it is a character device, not a regular file")


def test_socket_side_file_refused(src, tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(src / "agent.sock"))
        with pytest.raises(SourceError, match="it is a socket, not a regular file"):
            expq.convert(src, tmp_path / "out", device="cpu")
    finally:
        sock.close()
    assert not (tmp_path / "out").exists()


def test_fifo_shard_refused(src, tmp_path):
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    assert_refused(src, tmp_path / "out",
                   f"file {shard}: cannot read the safetensors file: it is a named pipe (FIFO), not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_special_layout_refused(kind, src, tmp_path):
    layout = tmp_path / "layout.toml"
    if kind == "fifo":
        os.mkfifo(layout)
        what = "a named pipe (FIFO)"
    else:
        layout = Path("/dev/zero")
        what = "a character device"
    with pytest.raises(LayoutError, match="not a regular file"):
        expq.inspect(src, layout=layout)
    assert_refused(src, tmp_path / "out", f"file {layout}: cannot read the layout file: it is {what}, not a regular "
                                          "file", "--layout", layout)


def test_open_regular_never_blocks_on_a_fifo(tmp_path):
    """The public primitive itself: a FIFO with no writer is refused at once (an open would block forever)."""
    os.mkfifo(tmp_path / "p")
    with pytest.raises(SourceError, match=r"cannot read the shard: it is a named pipe \(FIFO\)"):
        open_regular(tmp_path / "p", "shard")
    fd = open_regular(__file__, "test file")  # a regular file opens, and reads from it block as usual
    try:
        assert os.read(fd, 4) == Path(__file__).read_bytes()[:4]
    finally:
        os.close(fd)


@pytest.mark.slow
def test_huge_sparse_side_file_costs_little_memory_and_stays_sparse(src, tmp_path):
    size = 3 << 30
    with open(src / "big.dat", "wb") as f:
        f.seek(size // 2)
        f.write(b"data in the middle")
        f.truncate(size)
    out = tmp_path / "out"
    meter = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", meter, sys.executable, "-m", "expq.cli", "convert", src, out,
                        "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rss = int(r.stdout.split("maxrss_kib")[-1]) << 10
    assert rss < 1 << 30, rss  # reading the side file whole would take 3 GiB
    copied = (out / "big.dat").stat()
    assert copied.st_size == size and copied.st_blocks * 512 < 64 << 20  # the holes were not written
    with open(out / "big.dat", "rb") as f:
        f.seek(size // 2)
        assert f.read(18) == b"data in the middle"
    assert expq.verify(out, device="cpu", tokens=4).ok

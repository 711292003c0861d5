"""``expq convert REPO OUT --stream`` against the test Hub (tests/hub_server.py): planning from ranged header reads,
shards downloaded ahead of the converter into ``.<OUT>.expq-stream/`` and deleted once converted, output
byte-identical to a conversion from the Hub cache, the disk bound (ahead + 1 shards), a real SIGKILL mid-way that a
re-run resumes downloading only what is still needed, corrupt shards on the server, and usage errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import example, tree_digest
from hub_server import set_hf_offline
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import HubError, SourceError, UsageError
from expq.pipeline import make_units
from expq.hub.stream import DEFAULT_AHEAD, StreamFeeder, open_stream, stream_folder

REPO = "org/stream-mixtral"
SHARD = "40KB"  # output shards: several, each fed by more than one source shard


@pytest.fixture
def repo(hub_server, tmp_path, tmp_path_factory):
    """A tiny Mixtral in 6 source shards (about 40-51 kB each) on the test Hub: (local copy, commit, shard sizes)."""
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    commit = hub_server.add_repo(REPO, folder)
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    assert len(sizes) == 6
    return folder, commit, sizes


@pytest.fixture
def reference(repo, tmp_path):
    """The same repo converted the normal way (through the Hub cache), and the cache emptied afterwards, so that
    a stream run can only get shards from the server."""
    ref = tmp_path / "ref" / "out"
    expq.convert(REPO, ref, device="cpu", max_shard_size=SHARD)
    shutil.rmtree(hf_cache())
    return tree_digest(ref)


def hf_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def side_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors")


def bound(sizes: dict[str, int], folder: Path, ahead: int = DEFAULT_AHEAD) -> int:
    """ahead + 1 of the largest shards, the side files, and 1 kB of huggingface_hub bookkeeping per file."""
    files = len(sizes) + sum(1 for p in folder.iterdir() if p.is_file())
    return sum(sorted(sizes.values())[-(ahead + 1):]) + side_bytes(folder) + 1000 * files


def whole_shards(hub_server) -> list[str]:
    """The shards the server sent whole (not the ranged header reads), in order."""
    return [p for p, status, *_ in hub_server.transfers(REPO) if status == 200 and p.endswith(".safetensors")]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != "out")


def read_order(folder: Path) -> list[str]:
    """The source shards in the order a one-device pipeline first reads them (its units, in file order)."""
    plan = expq.inspect(folder, max_shard_size=SHARD)
    return list(dict.fromkeys(p.file for u in make_units(plan, list(enumerate(plan.jobs)), largest_first=False)
                              for _, j in u for p in j.tensor.parts))


def test_stream_matches_the_cached_conversion_within_the_disk_bound(hub_server, repo, reference, tmp_path):
    folder, commit, sizes = repo
    out = tmp_path / "run" / "out"
    hub_server.reset_stats()
    at_plan = []
    report = expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True,
                          on_plan=lambda plan: at_plan.append(list(hub_server.transfers(REPO))))
    assert tree_digest(out) == reference  # every file, expq.json included
    assert report.commit == commit and report.shards_resumed == 0
    # the stream folder is gone, nothing else was left beside OUT, and the Hub cache holds no weights
    assert not stream_folder(out).exists() and leftovers(out.parent) == []
    assert not [p for p in hf_cache().rglob("*") if p.suffix == ".safetensors"]
    # peak disk: at most ahead + 1 shards (the largest ones) beside the side files
    assert side_bytes(folder) < report.stream_peak_bytes <= bound(sizes, folder), report.stream_peak_bytes
    assert report.stream_peak_bytes >= side_bytes(folder) + min(sizes.values())
    # planning read the shard headers only: two ranged reads per shard (the length, then the header), no data
    (before,) = at_plan
    heads = [t for t in before if t[0].endswith(".safetensors")]
    assert sorted(p for p, *_ in heads) == sorted(2 * list(sizes))
    for path, status, first, length in heads:
        header_end = 8 + int.from_bytes((folder / path).read_bytes()[:8], "little")
        assert status == 206 and first + length <= header_end, (path, first, length)
    assert {p for p, st, *_ in before if st == 200} == {p.name for p in folder.iterdir()
                                                        if p.suffix != ".safetensors"}
    # then each shard was downloaded once, whole, in the order the pipeline first reads them (file order)
    order = read_order(folder)
    assert order == sorted(sizes)
    after = hub_server.transfers(REPO)[len(before):]
    assert [(p, st, a, n) for p, st, a, n in after] == [(p, 200, 0, sizes[p]) for p in order]
    # the same command again: OUT is up to date, no shard is downloaded, nothing is left
    hub_server.reset_stats()
    again = expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert again.up_to_date and whole_shards(hub_server) == [] and leftovers(out.parent) == []
    assert side_bytes(folder) <= again.stream_peak_bytes < side_bytes(folder) + min(sizes.values())
    assert tree_digest(out) == reference


def test_a_shard_needed_out_of_order_is_fetched_at_once(hub_server, repo, tmp_path):
    """ahead=0: one shard on disk at a time, except that a worker waiting for a shard beyond the window gets it
    fetched at once instead of waiting for a done() that may never come; a shard start() did not list too."""
    _, _, sizes = repo
    n = sorted(sizes)
    source, feeder = open_stream(REPO, tmp_path / "run" / "out", ahead=0)
    on_disk = lambda: sorted(p.name for p in feeder.folder.glob("*.safetensors"))  # noqa: E731
    try:
        assert [sh.path for sh in source.shards] == [feeder.folder / x for x in n] and on_disk() == []
        feeder.start(n[:3])
        feeder.wait(n[0])
        assert on_disk() == [n[0]]  # the window is full: n[1] waits for done(n[0])
        feeder.wait(n[2])  # beyond the window: fetched now
        feeder.wait(n[5])  # never listed: fetched now
        assert on_disk() == [n[0], n[2], n[5]] and feeder.downloaded == [n[0], n[2], n[5]]
        for x in (n[0], n[2], n[5]):
            feeder.done(x)
        feeder.wait(n[1])  # the window has room again
        assert on_disk() == [n[1]] and feeder.downloaded == [n[0], n[2], n[5], n[1]]
        assert feeder.peak_bytes <= bound(sizes, feeder.folder, ahead=2)
    finally:
        feeder.remove()
    assert not feeder.folder.exists() and list(feeder.folder.parent.iterdir()) == []


@pytest.mark.parametrize("case", ["hidden", "offline"])
def test_stream_hub_errors(case, hub_server, repo, tmp_path, monkeypatch):
    """A listed shard the Hub will not serve (404) is named, exit 3; offline, --stream says to use the cache
    (exit 6). Nothing is left beside OUT."""
    _, _, sizes = repo
    name = sorted(sizes)[1]
    if case == "hidden":
        hub_server.hide_file(REPO, name)
    else:
        set_hf_offline(monkeypatch)
    out = tmp_path / "run" / "out"
    r = CliRunner().invoke(app, ["convert", REPO, str(out), "--stream", "--device", "cpu"])
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    if case == "hidden":
        assert r.exit_code == 3 and f"file {name}" in lines[0] and "answers 404" in lines[0], lines[0]
    else:
        assert r.exit_code == 6 and "HF_HUB_OFFLINE is set" in lines[0] and "without --stream" in lines[0]
    assert not out.parent.exists() or leftovers(out.parent) == []


def test_peak_disk_follows_ahead(hub_server, repo, reference, tmp_path, monkeypatch):
    """With ahead=0 each shard is deleted before the next is downloaded: one shard at a time."""
    folder, _, sizes = repo
    monkeypatch.setattr("expq.hub.stream.DEFAULT_AHEAD", 0)
    seen = []
    real_done = StreamFeeder.done

    def done(self, file):
        seen.append(sorted(p.name for p in self.folder.glob("*.safetensors")))
        real_done(self, file)

    monkeypatch.setattr(StreamFeeder, "done", done)
    out = tmp_path / "run" / "out"
    report = expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert tree_digest(out) == reference and leftovers(out.parent) == []
    assert all(len(names) == 1 for names in seen) and len(seen) == len(sizes), seen
    assert report.stream_peak_bytes <= bound(sizes, folder, ahead=0)


def cli(*args, fault=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # HF_ENDPOINT & co. point at the test Hub (the fixture set them)
    env.pop("EXPQ_FAULT", None)
    if fault:
        env["EXPQ_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "expq.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_killed_stream_resumes_downloading_only_what_is_still_needed(hub_server, repo, reference, tmp_path,
                                                                    monkeypatch):
    folder, _, sizes = repo
    out = tmp_path / "run" / "out"
    stream, journal = stream_folder(out), out.parent / ".out.expq-journal.json"
    hub_server.reset_stats()
    # the writer stalls at its 20th tensor (in the third shard); once output shards are finished and the stream
    # holds its full window (ahead + 1 shards), the process is killed from outside with SIGKILL
    p = cli("convert", REPO, out, "--stream", "--device", "cpu", "--max-shard-size", SHARD, fault="write:20:stall")
    deadline = time.monotonic() + 90
    while p.poll() is None and time.monotonic() < deadline:
        finished = json.loads(journal.read_text() or "{}").get("files", {}) if journal.exists() else {}
        if finished and len(list(stream.glob("*.safetensors"))) == DEFAULT_AHEAD + 1:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    text, _ = p.communicate()
    assert p.returncode == -signal.SIGKILL, text
    first = whole_shards(hub_server)
    kept = sorted(json.loads(journal.read_text())["files"])
    on_disk = sorted(x.name for x in stream.glob("*.safetensors"))
    assert kept and len(on_disk) == DEFAULT_AHEAD + 1 and not out.exists()
    order = read_order(folder)
    assert set(on_disk) <= set(first) and first == [f for f in order if f in first]  # in order, by the killed run
    # one of the shards the killed run left is cut short since: fetched again, not trusted
    cut = on_disk[-1]
    (stream / cut).write_bytes((stream / cut).read_bytes()[:1000])
    started = []
    real_start = StreamFeeder.start
    monkeypatch.setattr(StreamFeeder, "start", lambda self, files: (started.append(list(files)),
                                                                   real_start(self, files))[1])
    hub_server.reset_stats()
    report = expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert tree_digest(out) == reference and leftovers(out.parent) == []
    assert report.shards_resumed == len(kept)
    (needed,) = started  # what the pipeline still reads: the journal's finished output shards spare the rest
    assert set(on_disk) <= set(needed) and len(needed) < len(sizes), (needed, kept)
    # downloaded again: exactly the needed shards that were not complete on disk (the cut one included)
    reused = [f for f in on_disk if f != cut]
    assert whole_shards(hub_server) == [f for f in needed if f not in reused] and cut in whole_shards(hub_server)
    assert {t[1] for t in hub_server.transfers(REPO) if t[0] in reused} == {206}  # only their header, for the plan


def test_interrupt_while_a_download_hangs_stops_at_once_and_resumes(hub_server, repo, reference, tmp_path):
    """SIGINT while the Hub holds back the third shard: exit 130 at once (the worker waiting for that download
    stops, the download is abandoned), the stream folder and staging stay, and the same command finishes."""
    _, _, sizes = repo
    requested, release = hub_server.hold(REPO, sorted(sizes)[2])
    out = tmp_path / "run" / "out"
    p = cli("convert", REPO, out, "--stream", "--device", "cpu", "--max-shard-size", SHARD)
    try:
        assert requested.wait(90)
        p.send_signal(signal.SIGINT)
        text, _ = p.communicate(timeout=30)
        assert not release.is_set()  # it stopped while the download was still held back
    finally:
        release.set()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "re-run the same command to resume" in text, text
    assert stream_folder(out).is_dir() and not out.exists()
    report = expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert tree_digest(out) == reference and leftovers(out.parent) == []
    assert report.stream_peak_bytes is not None


def test_corrupt_shard_on_the_server_is_one_clear_line(hub_server, repo, reference, tmp_path):
    folder, _, sizes = repo
    name = sorted(sizes)[2]
    data = bytearray((folder / name).read_bytes())
    data[-1] ^= 0xFF  # same size, one byte of tensor data differs: the sha256 check catches it
    out = tmp_path / "run" / "out"
    # a bad header is refused at planning, named as the Hub file, before any shard is downloaded
    hub_server.serve_instead(REPO, name, b"\xff" * 8 + bytes(data[8:]))
    hub_server.reset_stats()
    with pytest.raises(SourceError) as e:
        expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert str(e.value) == (f"file hf://{REPO}/{name}: not a safetensors file (header length {2**64 - 1}, file size "
                            f"{sizes[name]})")
    assert whole_shards(hub_server) == [] and leftovers(out.parent) == []
    hub_server.serve_instead(REPO, name, bytes(data))
    with pytest.raises(HubError) as e:
        expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    line = str(e.value)
    assert "\n" not in line and f"file {name}" in line and "LFS oid (sha256)" in line, line
    assert not (stream_folder(out) / name).exists()  # the bad copy is not kept
    # a truncated copy: huggingface_hub's size check, reported as such, through the CLI
    hub_server.serve_instead(REPO, name, bytes(data[:-100]))
    r = CliRunner().invoke(app, ["convert", REPO, str(out), "--stream", "--device", "cpu", "--max-shard-size", SHARD])
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert f"file {name}" in lines[0] and f"downloaded {sizes[name] - 100} bytes but the Hub lists {sizes[name]}" \
        in lines[0], lines[0]
    # the server serves the right bytes again: the same command resumes and finishes
    hub_server.replaced.clear()
    expq.convert(REPO, out, device="cpu", max_shard_size=SHARD, stream=True)
    assert tree_digest(out) == reference and leftovers(out.parent) == []


def test_stream_needs_a_hub_repo(hub_server, repo, tmp_path):
    folder, _, _ = repo
    with pytest.raises(UsageError, match="--stream applies to Hub repo ids"):
        expq.convert(folder, tmp_path / "out", device="cpu", stream=True)
    r = CliRunner().invoke(app, ["convert", str(folder), str(tmp_path / "out"), "--stream"])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "SRC is a local directory" in lines[0], r.output
    assert not [p.name for p in tmp_path.iterdir() if "out" in p.name]  # no OUT, staging or stream folder

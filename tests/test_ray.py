"""``expq convert --ray``: one local Ray cluster (2 CPUs) for the module. Every output is compared byte for byte with
``expq.convert`` on one process: a directory SRC (two families, both formats), Hub to Hub through the test Hub
(tests/hub_server.py, which tells which process downloaded what), a worker killed by SIGKILL mid-task (retried), a
driver interrupted by SIGINT (a re-run redoes only the missing shards), and the one-line errors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import sys

import pytest
from pathlib import Path
from helpers import edit_shard_tensors, example, tree_digest
from hub_server import configure_hf_client
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.cluster import FAULT_ENV, task_groups
from expq.errors import Interrupted
from expq.hub import model_card

ray = pytest.importorskip("ray")

SHARD = "40KB"  # six output shards from the six 60 KB source shards of the fixtures


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def driver_reads_no_weights():
    """Within: in this (the driver's) process, reading a tensor or a source's data bytes fails the test; the
    workers are other processes and are not affected."""
    import expq.conversion
    import expq.front_pass
    import expq.pipeline

    def forbidden(*a, **k):
        raise AssertionError("the driver read weight bytes")

    with pytest.MonkeyPatch.context() as mp:
        for mod, name in ((expq.pipeline, "read_tensor"), (expq.front_pass, "copy_bytes"),
                          (expq.front_pass, "map_tensor"), (expq.conversion, "local_identity")):
            mp.setattr(mod, name, forbidden)
        yield


def single(tmp_path, src, **kw) -> dict:
    ref = tmp_path / "ref"
    expq.convert(src, ref, device="cpu", max_shard_size=SHARD, **kw)
    return tree_digest(ref)


@pytest.mark.parametrize("family,fmt", [("mixtral", "auto"), ("granitemoe", "experts-int8")])
def test_directory_is_byte_identical(tmp_path, tmp_path_factory, family, fmt):
    src = example(tmp_path_factory, family)
    with driver_reads_no_weights():
        rep = expq.convert(src, tmp_path / "ray", device="cpu", max_shard_size=SHARD, format=fmt, ray="local")
    want = single(tmp_path, src, format=fmt)
    assert tree_digest(tmp_path / "ray") == want
    shards = sorted(n for n in want if n.endswith(".safetensors"))
    written = [n for t in rep.ray_tasks for n in t]
    assert sorted(written) == shards and len(rep.ray_tasks) > 1  # each shard by exactly one task
    assert rep.shards == len(shards) and rep.format == json.loads((tmp_path / "ray" / "expq.json").read_text())[
        "format"]


def test_groups_join_shards_fed_by_one_tensor(tmp_path_factory):
    """A tensor whose matrices land in two output shards puts them in one task; every shard is in one group."""
    plan = expq.inspect(example(tmp_path_factory, "gpt_oss"), max_shard_size="9KB")  # fused experts tensors
    groups = task_groups(plan)
    assert sorted(k for g in groups for k in g.shards) == list(range(len(plan.shard_names)))
    for j in plan.jobs:
        ks = {o.shard for o in j.outputs}
        assert sum(1 for g in groups if ks & set(g.shards)) == 1
        assert ks <= next(set(g.shards) for g in groups if ks & set(g.shards))
    assert any(len(g.shards) > 1 for g in groups) and len(groups) > 1


def test_relative_source_path(tmp_path, tmp_path_factory, monkeypatch):
    """A SRC given relative to the working directory: the tasks, which run elsewhere, read the same files."""
    src = example(tmp_path_factory, "mixtral")
    monkeypatch.chdir(src.parent)
    expq.convert(Path(src.name), tmp_path / "ray", device="cpu", max_shard_size=SHARD, ray="local")
    assert tree_digest(tmp_path / "ray") == single(tmp_path, src)


def test_killed_worker_is_retried(tmp_path, tmp_path_factory, monkeypatch):
    src = example(tmp_path_factory, "mixtral")
    marker = tmp_path / "killed-once"
    monkeypatch.setenv(FAULT_ENV, f"kill-once:{marker}")
    expq.convert(src, tmp_path / "ray", device="cpu", max_shard_size=SHARD, ray="local")
    assert marker.exists()  # a worker did die by SIGKILL after writing a tensor
    monkeypatch.delenv(FAULT_ENV)
    assert tree_digest(tmp_path / "ray") == single(tmp_path, src)


def test_rerun_after_driver_interrupt_redoes_only_missing_shards(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "ray"

    def interrupt(nbytes, shards):  # the driver gets SIGINT as the first task's result comes in
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted, match="re-run the same command to resume"):
        expq.convert(src, out, device="cpu", max_shard_size=SHARD, ray="local", on_progress=interrupt)
    journal = json.loads((tmp_path / ".ray.expq-journal.json").read_text())
    kept = set(journal["files"])
    staging = tmp_path / ".ray.expq-partial"
    inodes = {n: (staging / n).stat().st_ino for n in kept}
    assert kept and not out.exists()
    rep = expq.convert(src, out, device="cpu", max_shard_size=SHARD, ray="local")
    redone = {n for t in rep.ray_tasks for n in t}
    shards = {p.name for p in out.glob("*.safetensors")}
    assert rep.shards_resumed == len(kept) and not (redone & kept) and redone | kept == shards
    assert {n: (out / n).stat().st_ino for n in kept} == inodes  # the kept files themselves, not rewritten
    assert tree_digest(out) == single(tmp_path, src)


class _SignalAfterRename:
    """``os`` as ``expq.output.outdir`` sees it, except that the commit's rename onto ``out`` signals this process
    right after it: the moment OUT is already the new checkpoint and the run has not yet recorded it."""

    def __init__(self, out: Path, sig: int):
        self.out, self.sig = out, sig

    def rename(self, a, b):
        os.rename(a, b)
        if Path(b) == self.out:
            os.kill(os.getpid(), self.sig)

    def __getattr__(self, name):
        return getattr(os, name)


def test_a_signal_during_the_drivers_commit_waits_for_it(tmp_path, tmp_path_factory, monkeypatch):
    """SIGINT as the driver's commit renames the new checkpoint into place: the commit ends whole (no journal left)
    and the interrupt says so; it was a KeyboardInterrupt mid-commit saying "1 of 1 shards are kept: re-run the same
    command to resume" beside a committed OUT and a journal; found by a hostile-user pass."""
    import expq.output.outdir

    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "ray"
    monkeypatch.setattr(expq.output.outdir, "os", _SignalAfterRename(out.absolute(), signal.SIGINT))
    with pytest.raises(Interrupted) as e:
        expq.convert(src, out, device="cpu", max_shard_size=SHARD, ray="local")
    monkeypatch.undo()
    assert str(e.value) == "interrupted by SIGINT after the commit: OUT holds the complete new checkpoint; nothing " \
                           "to resume" and e.value.exit_code == 130
    assert sorted(os.listdir(tmp_path)) == ["ray"] and tree_digest(out) == single(tmp_path, src)


def test_ray_init_leaves_expqs_signal_handlers(monkeypatch):
    """``ray.init`` installs a SIGTERM handler in the driver (``sys.exit(15)``: a silent exit 15, or Ray's own crash
    report, where expq says one line and exits 143); ``connected`` puts the process's handlers back."""
    from expq.cluster import connected

    def init(**kw):  # as ray.init does in a driver
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    mine = lambda signum, frame: None  # noqa: E731
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    before = signal.signal(signal.SIGTERM, mine)
    try:
        with connected("local"):
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_sigterm_after_the_drivers_commit_is_one_line_and_143(tmp_path, tmp_path_factory):
    """The command line with ``--ray local`` (its own ``ray.init``): SIGTERM right after the commit's rename is the
    one line saying OUT is complete, and 143 (it was a silent exit 15, Ray's SIGTERM handler)."""
    from helpers import start_cli

    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "ray"
    prelude = ("import os, signal\nreal = os.rename\ndef rename(a, b, *k, **kw):\n    real(a, b, *k, **kw)\n"
               f"    if str(b) == {str(out)!r}:\n        os.kill(os.getpid(), signal.SIGTERM)\nos.rename = rename")
    p = start_cli("convert", src, out, "--device", "cpu", "--max-shard-size", SHARD, "--ray", "local",
                  prelude=prelude)
    text, _ = p.communicate(timeout=300)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert p.returncode == 143 and errors == ["error: interrupted by SIGTERM after the commit: OUT holds the complete "
                                              "new checkpoint; nothing to resume"], text
    assert sorted(os.listdir(tmp_path)) == ["ray"] and tree_digest(out) == single(tmp_path, src)


# --- Hub to Hub -------------------------------------------------------------------------------------------------------
SRC_REPO, DST_REPO = "org/ray-mixtral", "test-user/ray-mixtral-int8"


def test_hub_to_hub(hub_server, tmp_path, tmp_path_factory):
    folder = tmp_path / "publish"
    shutil.copytree(example(tmp_path_factory, "mixtral"), folder)
    hub_server.add_repo(SRC_REPO, folder)
    ref = tmp_path / "ref"
    expq.convert(SRC_REPO, ref, device="cpu", max_shard_size=SHARD)  # one process, through the Hub cache
    hub_server.reset_stats()
    hub_server.track_clients = True
    with driver_reads_no_weights():
        rep = expq.convert(SRC_REPO, to_hub=DST_REPO, ray="local", device="cpu", max_shard_size=SHARD)

    remote = hub_server.list_files(DST_REPO)
    want = {n: {"size": (ref / n).stat().st_size, "sha256": h} for n, h in tree_digest(ref).items()}
    card = model_card(ref, DST_REPO).encode()
    want["README.md"] = {"size": len(card), "sha256": hashlib.sha256(card).hexdigest()}
    assert {n: {"size": e["size"], "sha256": e["sha256"]} for n, e in remote.items() if n != ".gitattributes"} == want
    ours = [c for c in hub_server.history(DST_REPO) if c.title != "initial commit"]
    assert len(ours) == 1 and rep.hub_commits and rep.out == f"hf://{DST_REPO}"

    sent = hub_server.transfers_by_pid(SRC_REPO)
    me = os.getpid()
    assert all(pid is not None for pid, *_ in sent), sent
    by_driver = [(p, st, n) for pid, p, st, a, n in sent if pid == me and p.endswith(".safetensors")]
    assert by_driver and all(st == 206 and n <= 4096 for _, st, n in by_driver)  # header range reads only
    whole = [p for pid, p, st, *_ in sent if st == 200 and p.endswith(".safetensors")]
    assert sorted(set(whole)) == sorted(p.name for p in folder.glob("*.safetensors"))
    assert all(pid != me for pid, p, st, *_ in sent if st == 200 and p.endswith(".safetensors"))


@pytest.mark.parametrize("at,said", [
    pytest.param("placeholder_shard", "interrupted by SIGINT before its commit: the repo is unchanged (the shards "
                 "the tasks uploaded are in no commit); re-run the same command to publish to " + DST_REPO,
                 marks=pytest.mark.slow),
    ("publish", "interrupted by SIGINT while publishing: its one commit may or may not have been made (the repo's "
                "history says); re-run the same command to publish to " + DST_REPO),
])
def test_a_signal_while_publishing_to_the_hub_says_what_the_repo_holds(hub_server, tmp_path, tmp_path_factory,
                                                                        monkeypatch, at, said):
    """--to-hub: a signal after the tasks, as the driver lays its stand-in folder down or publishes it, says what
    the repo holds, which only the one commit changes. It said "after the commit: OUT holds the complete new
    checkpoint; nothing to resume" (the driver's stand-in folder had committed) while the repo had nothing new."""
    import expq.cluster

    real = getattr(expq.cluster, at)

    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler: KeyboardInterrupt at the next bytecode
        return real(*a, **k)

    monkeypatch.setattr(expq.cluster, at, signalled)
    with pytest.raises(Interrupted) as e:
        expq.convert(example(tmp_path_factory, "mixtral"), to_hub=DST_REPO, ray="local", device="cpu",
                     max_shard_size=SHARD)
    assert str(e.value) == said and e.value.exit_code == 130
    assert [c.title for c in hub_server.history(DST_REPO)] == ["initial commit"]  # made by prepare_repo only


# --- one-line errors --------------------------------------------------------------------------------------------------
def one_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_task_failure_names_shard_and_cause(tmp_path, tmp_path_factory):
    src = tmp_path / "nan"
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    edit_shard_tensors(src, name, lambda t: t[name].__setitem__((3, 5), float("nan")))
    res = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), "--device", "cpu",
                                   "--max-shard-size", SHARD, "--ray", "local", "--json"])
    line = one_line(res)
    assert res.exit_code == 1 and "the Ray task writing model-0000" in line and name in line and "NaN" in line
    assert not (tmp_path / ".out.expq-partial").exists()  # not resumable: nothing left behind


@pytest.mark.parametrize("args,expect", [
    (["--to-hub", "me/x"], "--to-hub needs --ray"),
    (["--to-hub", "not a repo", "--ray", "local"], "is not a model repo id"),
    (["--to-hub", "datasets/x", "--ray", "local"], "is not a model repo id"),
])
def test_usage_errors(tmp_path, tmp_path_factory, args, expect):
    src = example(tmp_path_factory, "mixtral")
    res = CliRunner().invoke(app, ["convert", str(src), *args])
    assert res.exit_code == 2 and expect in one_line(res)


def test_no_token(tmp_path, tmp_path_factory, monkeypatch):
    configure_hf_client(monkeypatch, "http://127.0.0.1:9", tmp_path / "home", None)
    res = CliRunner().invoke(app, ["convert", str(example(tmp_path_factory, "mixtral")), "--to-hub", "me/x",
                                   "--ray", "local"])
    assert res.exit_code == 1 and "no Hugging Face token" in one_line(res)


def test_to_hub_refused_by_the_hub_exits_as_push_does(hub_server, tmp_path, tmp_path_factory):
    """--to-hub's Hub failures are named as push's and a download's are (hub.errors.translate): the token
    rejected is 5, no write access 4; nothing is committed."""
    src = str(example(tmp_path_factory, "mixtral"))
    secret = "hf_wrong_secret_value_42"
    res = CliRunner().invoke(app, ["convert", src, "--to-hub", "me/x", "--ray", "local", "--token", secret])
    line = one_line(res)
    assert res.exit_code == 5 and line.startswith("error: repo me/x: the Hub rejected the token (401") and \
        secret not in res.output
    hub_server.deny_write("forbidden")
    res = CliRunner().invoke(app, ["convert", src, "--to-hub", "forbidden/x", "--ray", "local"])
    assert res.exit_code == 4 and "no write permission with this token (HTTP 403" in one_line(res)
    assert not hub_server.repo_exists("me/x") and not hub_server.repo_exists("forbidden/x")


def test_no_ray_installed(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    res = CliRunner().invoke(app, ["convert", str(example(tmp_path_factory, "mixtral")), str(tmp_path / "o"),
                                   "--ray", "local"])
    assert res.exit_code == 2 and 'pip install "expq[ray]"' in one_line(res)


def test_cannot_connect(tmp_path, tmp_path_factory, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process: connect to ADDRESS
    res = CliRunner().invoke(app, ["convert", str(example(tmp_path_factory, "mixtral")), str(tmp_path / "o"),
                                   "--ray", f"127.0.0.1:{port}"])
    assert res.exit_code == 1
    assert one_line(res).startswith(f"error: cannot connect to the Ray cluster at 127.0.0.1:{port}: ")


def test_ray_refuses_what_a_plain_convert_refuses(tmp_path, tmp_path_factory):
    """--stream on a local directory and a SRC that is neither a directory nor a repo id: the same one-line errors
    as without --ray."""
    from expq.errors import UsageError

    src = example(tmp_path_factory, "mixtral")
    with pytest.raises(UsageError, match="--stream applies to Hub repo ids"):
        expq.convert(src, tmp_path / "a", ray="local", stream=True, device="cpu")
    with pytest.raises(UsageError, match="no such directory, and not a Hub repo id"):
        expq.convert(tmp_path / "no such dir [bold]", tmp_path / "b", ray="local", device="cpu")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

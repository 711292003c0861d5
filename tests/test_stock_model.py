"""The cache of transformers' parameter sizes behind the experts-int8 marker check (``expq.formats.stock_model``):
a warm cache gives the verdict a cold one gives, without transformers; an entry that is damaged, forged or
answers another question is never used; a cache folder that cannot be written (or is not a folder) changes
nothing but the time taken; the folder follows ``EXPQ_CACHE_DIR`` and ``XDG_CACHE_HOME``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import example

import expq
from expq.errors import LayoutError
from expq.formats.stock_model import CACHE_ENV, cache_dir, stock_parameter_sizes

BAD_MARKER = r"marker model\.layers\.0\.mlp\.experts\.bogus_proj .*random experts"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(source, config, the right layout file, a layout whose markers transformers' model does not have)."""
    src = example(tmp_path_factory, "mixtral")
    d = tmp_path_factory.mktemp("layouts")
    good = (Path(expq.__file__).parent / "configs" / "mixtral.toml").read_text()
    assert 'forward = "topk"\n' in good
    (d / "good.toml").write_text(good)
    (d / "bogus.toml").write_text(good.replace('forward = "topk"\n', 'forward = "topk"\nweight = "bogus_proj"\n', 1))
    return src, json.loads((src / "config.json").read_text()), d / "good.toml", d / "bogus.toml"


def markers(src: Path, good: Path) -> tuple[list[str], list[str]]:
    """The layer markers an experts-int8 conversion with the right layout writes (the plan's
    quantization_config), and those the bogus layout would write."""
    from expq.plan import make_plan
    from expq.source import resolve_source

    right = make_plan(resolve_source(src), layout=good, format="experts-int8").quantization_config()["markers"]
    return right, [m.rpartition(".")[0] + ".bogus_proj" for m in right]


def verdict(src: Path, layout: Path) -> str:
    """``ok`` or the LayoutError of planning an experts-int8 conversion of ``src`` with ``layout``."""
    try:
        expq.inspect(src, layout=layout, format="experts-int8")
    except LayoutError as e:
        return str(e)
    return "ok"


def entries(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_transformers(monkeypatch):
    """``import transformers`` fails (as where it is not installed): only a cache hit can answer."""
    def block():
        monkeypatch.setitem(sys.modules, "transformers", None)
    return block


def reference_sizes(config: dict, names: list[str]) -> dict[str, int]:
    """transformers' model built on the meta device here, literally: each name's element count, 0 if absent."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    params = dict(model.named_parameters())
    return {n: params[n].numel() if n in params else 0 for n in names}


def test_a_warm_cache_gives_the_cold_verdict_without_transformers(mixtral, tmp_path, monkeypatch, no_transformers):
    src, config, good, bogus = mixtral
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    right, wrong = markers(src, good)
    names = right + wrong
    want = reference_sizes(config, names)
    assert len(right) >= 2 and all(want[n] > 0 for n in right) and all(want[n] == 0 for n in wrong)
    assert stock_parameter_sizes(config, names) == want  # cold: computed, stored
    assert verdict(src, good) == "ok"
    assert re.search(BAD_MARKER, verdict(src, bogus))
    assert len(entries(tmp_path / "cache")) == 3  # one per question: these names, the good and the bogus markers

    no_transformers()
    assert stock_parameter_sizes(config, names) == want  # warm: the stored answer, no transformers needed
    assert verdict(src, good) == "ok"
    assert re.search(BAD_MARKER, verdict(src, bogus))  # the bad layout still fails from the cache
    # negative control: without the cache and without transformers the check cannot tell (it passes everything)
    monkeypatch.setenv(CACHE_ENV, "off")
    assert stock_parameter_sizes(config, names) is None and verdict(src, bogus) == "ok"


DAMAGES = {
    "garbage": lambda raw, other: b"\x00\xff not json",
    "empty": lambda raw, other: b"",
    "cut short": lambda raw, other: raw[: len(raw) // 2],
    "one bit flipped": lambda raw, other: raw.replace(b'"sizes": {"model.layers.0.mlp.experts.bogus_proj": 0',
                                                      b'"sizes": {"model.layers.0.mlp.experts.bogus_proj": 1'),
    "another question's entry": lambda raw, other: other,
    "not a dict": lambda raw, other: b"[1, 2, 3]",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_entry_is_never_used(mixtral, tmp_path, monkeypatch, no_transformers, damage):
    """The bogus layout's entry damaged, or replaced by the good layout's entry (whole and self-consistent, but
    the answer to another question: it says every marker has elements): still refused, and the entry is rewritten
    right (a later hit without transformers refuses too)."""
    src, config, good, bogus = mixtral
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "bad"))
    assert verdict(src, bogus) != "ok"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "good"))
    assert verdict(src, good) == "ok"
    (bad_name, raw), = entries(tmp_path / "bad").items()
    (_, other), = entries(tmp_path / "good").items()
    damaged = DAMAGES[damage](raw, other)
    assert damaged != raw
    (tmp_path / "bad" / bad_name).write_bytes(damaged)

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "bad"))
    assert re.search(BAD_MARKER, verdict(src, bogus))
    assert entries(tmp_path / "bad") == {bad_name: raw}  # rewritten as it was
    no_transformers()
    assert re.search(BAD_MARKER, verdict(src, bogus))


def test_an_entry_from_another_transformers_is_a_miss(mixtral, tmp_path, monkeypatch):
    """The question names transformers' version and files: an entry whose key says another version is not used,
    even with a matching sha256 (a cache shared by two environments)."""
    import hashlib

    src, config, good, bogus = mixtral
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert verdict(src, bogus) != "ok"
    (name, raw), = entries(tmp_path / "c").items()
    entry = json.loads(raw)
    key = json.loads(entry["key"])
    key["transformers"]["version"] = "0.0.1"
    sizes = {n: 7 for n in entry["sizes"]}  # that other transformers' (made up) answer: every marker a weight
    entry["key"] = json.dumps(key, sort_keys=True, separators=(",", ":"))
    entry["sizes"] = sizes
    entry["sha256"] = hashlib.sha256(json.dumps({"key": entry["key"], "sizes": sizes}, sort_keys=True,
                                                separators=(",", ":")).encode()).hexdigest()
    (tmp_path / "c" / name).write_text(json.dumps(entry))
    assert re.search(BAD_MARKER, verdict(src, bogus))


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only: mode 0o555 for a user, the immutable attribute for root (whom modes do not stop;
    skipped where chattr is not allowed)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"root, and chattr +i is not allowed here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_cache_folder(mixtral, tmp_path, monkeypatch, no_transformers):
    src, config, good, bogus = mixtral
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert verdict(src, good) == "ok"
    folder = cache / "stock-parameter-sizes"
    before = entries(cache)
    with read_only(folder):
        with pytest.raises(OSError):
            (folder / "probe").write_text("x")
        assert re.search(BAD_MARKER, verdict(src, bogus))  # a miss: computed, not stored
        assert entries(cache) == before
        no_transformers()
        assert verdict(src, good) == "ok"  # a hit: read from the read-only folder
        assert stock_parameter_sizes(config, markers(src, good)[0]) is not None


def test_a_cache_path_that_is_not_a_folder(mixtral, tmp_path, monkeypatch):
    src, config, good, bogus = mixtral
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))
    assert verdict(src, good) == "ok"
    assert re.search(BAD_MARKER, verdict(src, bogus))
    assert (tmp_path / "file").read_text() == "not a folder"


def test_the_cache_folder_follows_the_environment(mixtral, tmp_path, monkeypatch):
    src, config, good, _ = mixtral
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "xdg" / "expq"
    assert verdict(src, good) == "ok"
    assert list(entries(tmp_path / "xdg" / "expq")) and not (tmp_path / "home").exists()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative values are ignored
    assert cache_dir() == tmp_path / "home" / ".cache" / "expq"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(CACHE_ENV, "off")
    assert cache_dir() is None
    assert verdict(src, good) == "ok" and not (tmp_path / "home").exists()


def forge(folder: Path, positive: bool) -> None:
    """Rewrite every entry of ``folder`` with all its sizes set (positive: 64, else 0) and its sha256 recomputed:
    what someone who can write the cache folder can do (the digest guards against damage, not forgery)."""
    from expq.formats import stock_model

    for p in folder.rglob("*.json"):
        e = json.loads(p.read_text())
        e["sizes"] = {n: 64 if positive else 0 for n in e["sizes"]}
        e["sha256"] = stock_model._digest(e["key"], e["sizes"])
        p.write_text(json.dumps(e))


def test_verify_never_trusts_the_cache(mixtral, tmp_path, monkeypatch):
    """A forged entry can make a conversion with a wrong layout pass the plan's check (the plan trusts the cache,
    as it trusts the installed packages), but never ``verify``: verify computes the marker check itself, however
    the output's entry is forged, and a forged refusal does not fail a good checkpoint's verify."""
    src, config, good, bogus = mixtral
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert re.search(BAD_MARKER, verdict(src, bogus))
    forge(cache, positive=True)
    assert verdict(src, bogus) == "ok"  # the plan believed the forged entry
    out = tmp_path / "bad"
    expq.convert(src, out, layout=bogus, format="experts-int8", device="cpu")
    for _ in range(2):  # the second time with the output config's entry (written by the first verify) forged too
        rep = expq.verify(out, source=src, device="cpu")
        assert not rep.ok and re.search(r"marker .*bogus_proj.*random experts", str(rep.to_dict()))
        forge(cache, positive=True)
    good_out = tmp_path / "good"
    forge(cache, positive=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache2"))
    expq.convert(src, good_out, layout=good, format="experts-int8", device="cpu")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    forge(cache, positive=False)
    assert expq.verify(good_out, source=src, device="cpu").ok


def test_an_entry_that_is_not_a_regular_file_is_a_miss(mixtral, tmp_path, monkeypatch):
    """A FIFO (or a link) where an entry belongs is a miss: never opened blocking, never followed."""
    src, config, good, bogus = mixtral
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert re.search(BAD_MARKER, verdict(src, bogus))
    (entry,) = [p for p in cache.rglob("*.json")]
    forged = tmp_path / "forged.json"
    forged.write_text(entry.read_text())
    forge(tmp_path, positive=True)  # forged.json now says every marker has elements
    entry.unlink()
    entry.symlink_to(forged)
    assert re.search(BAD_MARKER, verdict(src, bogus))  # the link is not followed
    entry.unlink()
    os.mkfifo(entry)
    code = "import expq, sys; expq.inspect(sys.argv[1], layout=sys.argv[2], format='experts-int8')"
    r = subprocess.run([sys.executable, "-c", code, str(src), str(bogus)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, CACHE_ENV: str(cache)})
    assert r.returncode != 0 and "bogus_proj" in r.stderr  # refused, computed: the FIFO was not waited on


# --- the check beside a conversion (plan.ModelCheck): computed in a child process, never left behind -------------------
BESIDE = """
import json, os, sys
import expq, expq.plan
expq.plan.BACKGROUND_CHECK_MIN_BYTES = 0  # the small fixture converts beside the check as a large source does
from expq.errors import LayoutError
src, out, layout = sys.argv[1:4]
try:
    expq.convert(src, out, layout=layout, format="experts-int8", device="cpu")
    verdict = "converted"
except LayoutError as e:
    verdict = str(e)
print(json.dumps({"verdict": verdict, "out": os.path.exists(out), "transformers": "transformers" in sys.modules}))
"""


def test_a_conversion_checks_its_markers_beside_the_run_in_a_child(mixtral, tmp_path):
    """On a cold cache the conversion's marker check runs in a child process while the conversion runs: the
    converting process never imports transformers, the bad layout is refused all the same (nothing committed), and
    the child's answer is the one transformers gives, stored in the cache for the next run."""
    src, config, good, bogus = mixtral
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", BESIDE, str(src), str(tmp_path / "out"), str(bogus)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, CACHE_ENV: str(cache)})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert re.search(BAD_MARKER, got["verdict"]) and not got["out"] and not got["transformers"]
    assert not (tmp_path / ".out.expq-staging").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert len(entries(cache)) == 1
    right, wrong = markers(src, good)
    want = reference_sizes(config, wrong)
    with pytest.MonkeyPatch.context() as m:
        m.setenv(CACHE_ENV, str(cache))
        m.setitem(sys.modules, "transformers", None)  # only the entry the child's answer made can answer
        assert stock_parameter_sizes(config, wrong) == want


@pytest.mark.parametrize("interpreter", ["/bin/echo", "/bin/false"])  # answers its arguments; fails
def test_a_child_that_fails_leaves_the_answer_to_this_process(mixtral, tmp_path, monkeypatch, interpreter):
    """A child that fails, or answers something that is not an answer, changes nothing: the block raises
    ``NotComputed``, the answer is computed by the process that asked, outside the block, and stored."""
    from expq.formats import stock_model

    src, config, good, bogus = mixtral
    right, wrong = markers(src, good)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "executable", interpreter)  # what the child is started with
    with pytest.raises(stock_model.NotComputed), stock_model.in_child_process():
        stock_parameter_sizes(config, right + wrong)
    assert not (tmp_path / "cache").exists() or not entries(tmp_path / "cache")  # no answer: nothing stored
    assert stock_parameter_sizes(config, right + wrong) == reference_sizes(config, right + wrong)
    assert len(entries(tmp_path / "cache")) == 1


def _children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (d / "stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) == pid and \
                        b"expq.formats.stock_model" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
    return out


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_interrupted_conversion_leaves_no_check_running(mixtral, tmp_path, monkeypatch):
    """SIGINT while the marker check's child runs: the conversion ends as interrupted (130, one line) and the
    child is ended with it (the command ends with ``os._exit``: no atexit hook would run)."""
    import signal
    import time

    from helpers import start_cli

    src, config, good, bogus = mixtral
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    p = start_cli("convert", src, tmp_path / "out", "--format", "experts-int8", "--device", "cpu",
                  prelude="import expq.plan\nexpq.plan.BACKGROUND_CHECK_MIN_BYTES = 0")
    deadline, kids = time.monotonic() + 120, []
    while not kids and p.poll() is None and time.monotonic() < deadline:
        kids = _children_of(p.pid)
        time.sleep(0.05)
    assert kids, p.communicate()[0]
    p.send_signal(signal.SIGINT)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 130 and "interrupted by SIGINT" in text and "Traceback" not in text, text
    assert all(_gone(k) for k in kids)  # ended before the command's end, not left to finish on its own
    assert not (tmp_path / "out").exists() and not entries(tmp_path / "cache")


def test_a_hung_child_is_ended_and_the_answer_computed_here(mixtral, tmp_path, monkeypatch):
    """A child that never answers is killed at ``CHILD_TIMEOUT_S`` (no conversion waits on it for ever)."""
    import time

    from expq.formats import stock_model

    src, config, good, bogus = mixtral
    right, _ = markers(src, good)
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "executable", str(hang))
    monkeypatch.setattr(stock_model, "CHILD_TIMEOUT_S", 1)
    t = time.monotonic()
    with pytest.raises(stock_model.NotComputed), stock_model.in_child_process():
        stock_parameter_sizes(config, right)
    assert time.monotonic() - t < 10
    assert stock_parameter_sizes(config, right) == reference_sizes(config, right)


class _LateFormat:
    """A format whose check gives no answer in the child's block (as when the child fails), then takes ``delay``
    seconds to find ``problem`` outside it."""

    def __init__(self, delay: float, problem: str):
        self.delay, self.problem, self.calls = delay, problem, 0
        from types import SimpleNamespace

        self.experts = SimpleNamespace(layout=SimpleNamespace(path="late.toml"))

    def check_model(self, config, *, use_cache=True):
        from expq.formats.stock_model import NotComputed

        self.calls += 1
        if self.calls == 1:
            raise NotComputed
        import time

        time.sleep(self.delay)
        return [self.problem]


def test_a_stop_is_seen_while_the_check_is_computed_here():
    """Where the child gave no answer, ``ModelCheck.wait`` computes the check itself, and a stop (a signal) still
    ends the wait within a fraction of a second; without the stop it waits and raises the check's finding."""
    import threading
    import time

    from expq.plan import ModelCheck

    check, stop = ModelCheck(_LateFormat(3.0, "late problem"), {}), threading.Event()
    threading.Timer(0.3, stop.set).start()
    t = time.monotonic()
    check.wait(stop)
    assert time.monotonic() - t < 1.5
    check = ModelCheck(_LateFormat(0.5, "late problem"), {})
    with pytest.raises(LayoutError, match="late problem") as e:  # negative control: no stop, the finding
        check.wait(threading.Event())
    assert "late.toml" in str(e.value)


# A check that has not answered when the first tensor is written (``pending``: it never answers) or that refuses
# then (``refused``: it waits for that write); the process signals itself at that write, once the refusal is known.
CHECK_AT_FIRST_WRITE = """
import os, signal, threading, time
import expq.plan
from expq.errors import LayoutError
from expq.output.faults import Faults
expq.plan.BACKGROUND_CHECK_MIN_BYTES = 0
VERDICT, checks, writing = {verdict!r}, [], threading.Event()
init = expq.plan.ModelCheck.__init__
def recorded(self, *a):
    checks.append(self)
    init(self, *a)
def check(fmt, config):
    (writing if VERDICT == "refused" else threading.Event()).wait()  # pending: never answers
    raise LayoutError("marker m is not a weight of the model", file="bogus.toml")
hit = Faults.hit
def at_write(self, point):
    if point == "write" and not writing.is_set():
        writing.set()
        while VERDICT == "refused" and not checks[0].failed():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
    return hit(self, point)
expq.plan.ModelCheck.__init__, expq.plan._check_model, Faults.hit = recorded, check, at_write
"""


@pytest.mark.parametrize("verdict", ["pending", "refused"])
def test_an_interrupt_promises_no_resume_the_check_refuses(verdict, mixtral, tmp_path, monkeypatch):
    """SIGINT while the marker check is still running: the line makes the resume depend on it and the finished
    shards are kept; once it has refused the source: the line says the refusal (what the re-run would say), and
    nothing is kept (there is nothing to resume)."""
    from helpers import start_cli

    src = mixtral[0]
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    p = start_cli("convert", src, tmp_path / "out", "--format", "experts-int8", "--device", "cpu",
                  prelude=CHECK_AT_FIRST_WRITE.format(verdict=verdict))
    text, _ = p.communicate(timeout=120)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert p.returncode == 130 and len(errors) == 1 and "Traceback" not in text, text
    left = sorted(q.name for q in tmp_path.iterdir() if q.name != "cache")
    if verdict == "pending":
        assert errors[0].endswith("re-run the same command to resume it if the check of the output against "
                                  "transformers' model class, not finished when the signal came, passes"), text
        assert left == [".out.expq-journal.json", ".out.expq-partial"]
    else:
        assert errors[0] == ("error: interrupted by SIGINT; nothing is kept, as the same command would be refused: "
                             "file bogus.toml: marker m is not a weight of the model"), text
        assert left == []

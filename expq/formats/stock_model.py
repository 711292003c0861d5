"""Which parameters stock transformers' model class for a config.json has, and how many elements each holds
(``stock_parameter_sizes``): what the experts-int8 format checks its layer markers against.

The answer takes building transformers' model on the meta device: importing transformers and the model's module
and constructing every layer, about 3 CPU s (more with a cold page cache), where the rest of a plan takes 0.01 s.
It depends only on the config, the names asked about and the transformers installed, so it is kept in a small
cache, one JSON file per question, under ``EXPQ_CACHE_DIR`` (default ``$XDG_CACHE_HOME/expq``, else
``~/.cache/expq``; ``EXPQ_CACHE_DIR=off``: no cache). A hit imports no transformers at all.

An entry holds its whole question (``key``: the canonical config JSON, the names, transformers' version, where it
is installed and the size and time of its ``__init__.py``, torch's and Python's versions) beside the answer, and a
sha256 over both. It is used only when it parses, the sha256 matches, its question is this one character for
character and the answer has exactly the names asked about with non-negative integer counts; anything else (a
file cut short, bits flipped, an entry copied to another file's name, a cache made by another transformers) is a
miss: the answer is computed, as without a cache. A cache folder that cannot be created, read or written (read-only,
full, not a folder) only means the answer is computed each time. An editable transformers (its files change
without its version) is never cached, and neither is a model transformers cannot build (that may be passing).
Entries are written to a temporary file then renamed into place, so concurrent runs never see half an entry. An
entry is read only as a regular file, never through a link (a FIFO there is a miss, not a wait). The sha256 finds damage, not forgery: whoever can
write the folder can make the plan's check pass, so ``verify`` never reads the cache (``use_cache=False``).

Inside ``in_child_process()`` (a conversion's plan checks its markers so, on a thread of its own, while the
conversion runs: ``plan.ModelCheck``, unless transformers is imported already and the answer costs hundredths of a
second, ``answered_at_once``), a miss is computed in a child process (``python -m expq.formats.stock_model``): the
import is seconds of the interpreter's time, which in a thread of the converting process would hold the lock its
pipeline threads need, and hundreds of MB that would stay resident; and building the model sets torch's default
dtype, which is the whole process's. A child that gives no answer raises ``NotComputed``: the caller computes it
itself, once its other threads are done.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import torch

CACHE_ENV = "EXPQ_CACHE_DIR"
SCHEMA = "expq-stock-parameter-sizes/1"  # changes when what is computed or how the key is formed changes
MAX_ENTRY_BYTES = 64 << 20  # an entry is the config and one count per name: far below this
CHILD_TIMEOUT_S = 300  # a child that has not answered by then never will (it takes 4-17 s): computed here instead
_here = threading.local()  # .children: this thread computes a miss in a child process (``in_child_process``)
_live: "weakref.WeakSet[ChildProcesses]" = weakref.WeakSet()  # ended at exit (``_end_all``)


def cache_dir() -> Path | None:
    """The folder of the cache: ``EXPQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/expq``, else ``~/.cache/expq``; None
    when ``EXPQ_CACHE_DIR`` is ``off`` (or no home folder is known)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is to be ignored
        return Path(xdg) / "expq"
    try:
        return Path.home() / ".cache" / "expq"
    except RuntimeError:  # no home folder to be found
        return None


def stock_parameter_sizes(config: dict, names: Sequence[str], *, use_cache: bool = True) -> dict[str, int] | None:
    """name -> element count, for each of ``names``, of that parameter of the transformers model ``config``
    (config.json as a dict) describes; 0 for a name that is not one of its parameters. None when transformers
    cannot build the model (an unknown or remote-code model type: stock transformers cannot load it either).

    Cached (see the module docstring): a hit gives the answer computed the first time, which is the answer
    computing it again gives. ``use_cache=False`` never reads the cache (``verify`` does not trust it: an entry is
    checked for damage, not for forgery by someone who can write the folder) and writes the computed answer (which
    replaces a forged entry). Inside ``in_child_process`` a miss is computed in a child process.

    Raises:
        Cancelled: inside ``in_child_process``, its ``ChildProcesses`` were ended.
        NotComputed: inside ``in_child_process``, the child gave no answer (the caller computes it outside).
    """
    names = sorted(set(names))
    key = _key(config, names)
    path = _entry_path(key)
    if path is not None and use_cache:
        hit = _read(path, key, names)
        if hit is not None:
            return hit
    children = getattr(_here, "children", None)
    if children is not None:
        sizes = _sizes_in_child(config, names, children)
        if sizes is False:
            raise NotComputed
    else:
        sizes = _sizes_here(config, names)
    if sizes is None:
        return None
    if path is not None:
        _write(path, key, sizes)
    return sizes


class Cancelled(Exception):
    """``ChildProcesses.end`` was called: the answer is no longer wanted."""


class NotComputed(Exception):
    """The child process gave no answer (it could not start, failed, was killed, or answered another question):
    compute it outside ``in_child_process``, where the process's other threads build no tensors meanwhile."""


def answered_at_once() -> bool:
    """Whether a miss is answered here in hundredths of a second (transformers is imported already: building the
    model on the meta device is all that is left), so that nothing is gained by computing it elsewhere."""
    return "transformers" in sys.modules


class ChildProcesses:
    """The child processes of one ``in_child_process`` block; ``end`` kills those running and cancels the block's
    later questions (``stock_parameter_sizes`` then raises ``Cancelled``). Ended at the process's exit too, so
    that none outlives its parent (for a process that ends with ``os._exit``, its owner ends them first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.ended = False
        _live.add(self)

    def add(self, child: subprocess.Popen) -> bool:
        """Track ``child``; False (and ``child`` killed) once ended."""
        with self._lock:
            if not self.ended:
                self._running.add(child)
                return True
        _kill(child)
        return False

    def discard(self, child: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(child)

    def end(self) -> None:
        """Kill the running children (waiting for each to be gone) and cancel any later question."""
        with self._lock:
            self.ended = True
            running, self._running = list(self._running), set()
        for child in running:
            _kill(child)


def _kill(child: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        child.kill()
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        child.wait(5)


@atexit.register
def _end_all() -> None:
    for children in list(_live):
        children.end()


@contextlib.contextmanager
def in_child_process(children: ChildProcesses | None = None) -> Iterator[ChildProcesses]:
    """Within it, on the calling thread, ``stock_parameter_sizes`` computes a miss in a child process, never here:
    building transformers' model sets torch's default dtype, which is the whole process's, while the process's
    other threads convert (see the module docstring); the calling thread waits on a pipe. Yields the block's
    ``ChildProcesses`` (``children``, else new ones; another thread may ``end`` them)."""
    before = getattr(_here, "children", None)
    _here.children = children = children or ChildProcesses()
    try:
        yield children
    finally:
        _here.children = before


def _sizes_in_child(config: dict, names: list[str], children: ChildProcesses) -> dict[str, int] | None | bool:
    """The answer computed by ``python -m expq.formats.stock_model`` (the question on its stdin, the answer on its
    stdout; its own session, so that a terminal's Ctrl-C is this process's to handle); False when the child gives
    none (it cannot start, fails, is killed, answers another question).

    Raises:
        Cancelled: ``children`` were ended.
    """
    if children.ended:
        raise Cancelled
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
    except OSError:  # no interpreter to start (an embedded Python)
        return False
    if not children.add(child):
        raise Cancelled
    try:
        out, _ = child.communicate(json.dumps({"config": config, "names": names}).encode(), timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # hung: no answer
        _kill(child)
        out = b""
    except (OSError, ValueError):
        out = b""
    finally:
        children.discard(child)
    if children.ended:
        raise Cancelled
    if child.returncode != 0:  # failed, killed, or timed out (killed)
        return False
    try:
        sizes = json.loads(out)["sizes"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return False
    if sizes is None:
        return None
    return sizes if _answers(sizes, names) else False


def _sizes_here(config: dict, names: list[str]) -> dict[str, int] | None:
    """The answer computed in this process: each name's element count (0: not a parameter), or None."""
    params = _build(config)
    return None if params is None else {n: params.get(n, 0) for n in names}


def _answers(sizes, names: list[str]) -> bool:
    """Whether ``sizes`` (read from a cache entry or a child) answers the question about ``names``: exactly those
    names, each with a non-negative integer count."""
    return isinstance(sizes, dict) and sorted(sizes) == names and \
        all(type(v) is int and v >= 0 for v in sizes.values())


def _build(config: dict) -> dict[str, int] | None:
    """name -> element count of every parameter of the model (built on the meta device: no memory), or None."""
    try:
        from transformers import AutoModelForCausalLM, PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cfg = CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
        if not isinstance(cfg, PretrainedConfig):
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001 - an unknown or remote-code model: stock transformers cannot load it either
        return None
    return {n: p.numel() for n, p in model.named_parameters()}


# --- the cache ---------------------------------------------------------------------------------------------------------
def _transformers_identity() -> dict | None:
    """What tells one installed transformers from another, found without importing it; None when that cannot be
    told (not installed as a distribution, installed editable) and the answer must not be cached."""
    import importlib.machinery
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("transformers")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if not isinstance(direct, dict) or (direct.get("dir_info") or {}).get("editable"):
            return None
        spec = importlib.machinery.PathFinder.find_spec("transformers")  # on sys.path; sys.modules not consulted
        if spec is None or not spec.origin:
            return None
        st = os.stat(spec.origin)
    except Exception:  # noqa: BLE001 - broken metadata or finders: compute, never cache
        return None
    return {"version": dist.version, "origin": spec.origin, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _key(config: dict, names: list[str]) -> str | None:
    """The question as canonical JSON (sorted keys, no spaces), or None when it cannot be cached."""
    tf = _transformers_identity()
    if tf is None:
        return None
    try:
        return json.dumps({"schema": SCHEMA, "transformers": tf, "torch": torch.__version__,
                           "python": list(sys.version_info[:2]), "config": config, "names": names},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError):  # not JSON data (a config dict built by hand)
        return None


def _entry_path(key: str | None) -> Path | None:
    folder = cache_dir()
    if key is None or folder is None:
        return None
    return folder / "stock-parameter-sizes" / (hashlib.sha256(key.encode()).hexdigest() + ".json")


def _digest(key: str, sizes: dict[str, int]) -> str:
    body = json.dumps({"key": key, "sizes": sizes}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _read(path: Path, key: str, names: list[str]) -> dict[str, int] | None:
    """The entry's answer when the entry is whole and answers exactly this question; else None."""
    try:
        # a regular file only, never through a link (a FIFO or device there must not block or be read)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(MAX_ENTRY_BYTES + 1)
        if len(raw) > MAX_ENTRY_BYTES:
            return None
        entry = json.loads(raw)
    except (OSError, ValueError, RecursionError):  # missing, unreadable, not JSON (UnicodeDecodeError included)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    sizes = entry.get("sizes")
    if not _answers(sizes, names):
        return None
    if entry.get("sha256") != _digest(key, sizes):
        return None
    return sizes


def _write(path: Path, key: str, sizes: dict[str, int]) -> None:
    """Store the entry (a temporary file renamed into place); any failure leaves the cache as it was."""
    data = json.dumps({"key": key, "sizes": sizes, "sha256": _digest(key, sizes)}, sort_keys=True).encode()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError:  # read-only, full, not a folder: the answer stands, uncached
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _child() -> None:
    """``python -m expq.formats.stock_model``: ``{"config", "names"}`` as JSON on stdin, ``{"sizes": {name: count}
    | null}`` on stdout (``_sizes_in_child``)."""
    q = json.loads(sys.stdin.buffer.read())
    sys.stdout.write(json.dumps({"sizes": _sizes_here(q["config"], q["names"])}))


if __name__ == "__main__":
    _child()

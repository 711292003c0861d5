"""requirements.lock is the whole environment `make install` builds: every distribution installed in it (expq itself
aside, installed editable from this checkout) is locked at its installed version, every locked package is installed,
each lock entry carries sha256 hashes, and torch is its CPU build (PyPI's torch of the same version is a CUDA build).
A drift (a package installed by hand, a lock edited without `make install`) fails here, naming the packages."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{64})*)", re.M)


def read_lock(text: str) -> dict[str, tuple[Version, list[str]]]:
    """{canonical name: (version, sha256 hashes)} of a pip-compile lock; a line that pins anything else fails."""
    entries = {canonicalize_name(m[1]): (Version(m[2]), re.findall(r"sha256:([0-9a-f]{64})", m[3]))
               for m in ENTRY.finditer(text)}
    requirement_lines = [ln for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert len(requirement_lines) == len(entries), "a lock line that is not name==version with hashes"
    return entries


def installed_distributions() -> dict[str, Version]:
    """{canonical name: version} of the distributions in this environment's own site-packages."""
    paths = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    return {canonicalize_name(d.metadata["Name"]): Version(d.version)
            for d in importlib.metadata.distributions(path=paths)}


def drift(installed: dict[str, Version], locked: dict[str, tuple[Version, list[str]]]) -> list[str]:
    """What differs between an environment and a lock, one line per package (empty: none)."""
    out = [f"{n} {v} is installed but not locked" for n, v in installed.items() if n not in locked]
    out += [f"{n} is locked at {locked[n][0]} but {v} is installed" for n, v in installed.items()
            if n in locked and locked[n][0] != v]
    out += [f"{n} {locked[n][0]} is locked but not installed" for n in locked if n not in installed]
    return sorted(out)


def test_every_lock_entry_is_pinned_with_hashes_and_torch_is_the_cpu_build():
    locked = read_lock(LOCK.read_text())
    assert {"pip", "setuptools", "torch", "pytest"} <= set(locked)
    assert all(hashes for _, hashes in locked.values()), [n for n, (_, h) in locked.items() if not h]
    assert locked["torch"][0].local == "cpu"


@pytest.mark.skipif(not (Path(sys.prefix) / ".expq-installed").exists(),
                    reason="not an environment that `make install` built")
def test_the_environment_is_the_lock():
    installed = installed_distributions()
    installed.pop("expq")  # this checkout, editable
    assert drift(installed, read_lock(LOCK.read_text())) == []


def test_drift_names_each_difference():
    locked = read_lock(LOCK.read_text())
    installed = {n: v for n, (v, _) in locked.items()}
    assert drift(installed, locked) == []
    installed["numpy"] = Version("1.0")
    installed["left-pad"] = Version("1.3")
    del installed["rich"]
    assert drift(installed, locked) == [
        "left-pad 1.3 is installed but not locked", f"numpy is locked at {locked['numpy'][0]} but 1.0 is installed",
        f"rich {locked['rich'][0]} is locked but not installed"]

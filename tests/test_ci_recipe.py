"""The CI recipe (examples/ci/prequantize.sh, docs/ci.md) run end to end as a real subprocess against the local
Hub-compatible server (tests/hub_server.py): a push the Hub refuses, its re-run from the cached OUT, a no-op re-run,
a new upstream commit, a broken upstream commit; usage errors and an unknown upstream repo."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import expq
from expq.examples import build_example

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ci" / "prequantize.sh"
SRC, TARGET = "org/tiny-mixtral", "org/tiny-mixtral-int8"


@pytest.fixture
def recipe(hub_server, tmp_path):
    """(run, folder): ``run()`` runs the recipe with the environment the hub_server fixture set (HF_ENDPOINT,
    HF_TOKEN, HF_HOME...) plus the recipe's inputs; ``folder`` is the published upstream checkpoint."""
    folder = build_example("mixtral", tmp_path / "upstream")
    hub_server.add_repo(SRC, folder)
    bindir = tmp_path / "bin"  # `expq` from this checkout, whatever the virtualenv's own install points at
    bindir.mkdir()
    (bindir / "expq").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m expq.cli "$@"\n')
    (bindir / "expq").chmod(0o755 | stat.S_IXUSR)
    work = tmp_path / "work"

    def run(**extra):
        env = {**os.environ, "SRC_REPO": SRC, "TARGET_REPO": TARGET, "WORK": str(work), "EXPQ_DEVICE": "cpu",
               "PYTHON": sys.executable, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra}
        env.pop("GITHUB_OUTPUT", None)
        p = subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
        result = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else None
        return p.returncode, result, p.stderr

    return run, folder, work


def _published(hub_server) -> dict[str, dict]:
    return hub_server.list_files(TARGET)


def _same_bytes(remote: dict[str, dict], local: Path) -> None:
    """Every converted file on the Hub has the local conversion's size and sha256 (expq.json and the card aside:
    they name the source as a repo id there and as a directory here; config.json too, which holds expq.json's
    hash)."""
    import hashlib

    want = {p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in local.iterdir() if p.is_file() and p.name not in ("expq.json", "README.md", "config.json")}
    got = {k: (v["size"], v["sha256"]) for k, v in remote.items() if k in want}
    assert got == want


@pytest.mark.slow  # five runs of the recipe, each a dozen expq subprocesses: make test-slow
def test_recipe_end_to_end(hub_server, recipe, tmp_path):
    run, folder, work = recipe
    first = hub_server.head(SRC)

    # 1. first run: convert and verify --source pass, the Hub fails the commit (507, an outage: 6 as on a download),
    # nothing published
    hub_server.inject_fault("commit", status=507, times=1)
    code, res, err = run()
    assert code == 6 and res["step"] == "push" and res["pushed"] is False and res["commit"] == first, err
    assert json.loads((work / "verify.json").read_text())["ok"] is True
    assert "expq.json" not in _published(hub_server)

    # 2. the same again: OUT (the CI cache) already holds the conversion (convert's no-op), and the push goes through
    code, res, err = run()
    assert code == 0, err
    assert res["step"] == "push" and res["pushed"] is True and res["commit"] == first and res["exit"] == 0
    assert json.loads((work / "convert.json").read_text())["up_to_date"] is True
    assert hub_server.repo_exists(TARGET)
    remote = _published(hub_server)
    local = tmp_path / "local"
    expq.convert(folder, local, device="cpu")
    _same_bytes(remote, local)
    assert {"config.json", "expq.json", "README.md", "model.safetensors", "tokenizer.json"} <= set(remote)
    manifest = json.loads(hub_server.read_file(TARGET, "expq.json"))
    assert manifest["source"] == {"repo_id": SRC, "revision": first, "commit": first, "name": SRC}
    assert json.loads((work / "push.json").read_text())["checked_remote"] == len(remote) - 1  # .gitattributes
    commits = len(hub_server.history(TARGET))

    # 3. the same upstream commit again: nothing downloaded, converted, uploaded or committed
    hub_server.reset_stats()
    code, res, err = run()
    assert code == 0, err
    assert res["step"] == "up-to-date" and res["pushed"] is False and res["commit"] == first
    assert len(hub_server.history(TARGET)) == commits
    assert hub_server.stats["commit"] == 0 and hub_server.uploaded_oids == []
    assert [p for p in hub_server.downloaded(SRC) if p.endswith(".safetensors")] == []
    assert hub_server.downloaded(TARGET) == ["expq.json"]

    # 4. a new upstream commit (config changed): a new conversion at that commit and a new push
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 3.25e-6
    second = hub_server.commit_files(SRC, {"config.json": json.dumps(cfg, indent=2)})
    hub_server.reset_stats()
    code, res, err = run()
    assert code == 0, err
    assert res["step"] == "push" and res["pushed"] is True and res["commit"] == second != first
    assert len(hub_server.history(TARGET)) == commits + 1 and hub_server.stats["commit"] == 1
    assert json.loads(hub_server.read_file(TARGET, "expq.json"))["source"]["commit"] == second
    assert json.loads(hub_server.read_file(TARGET, "config.json"))["rms_norm_eps"] == 3.25e-6
    assert json.loads((work / "convert.json").read_text())["up_to_date"] is False
    assert Path(res["out"]) == work / "out" / f"{second}-auto"
    commits += 1

    # 5. a broken upstream commit (a truncated shard): convert's status (1, the source cannot be converted), no push
    shard = sorted(folder.glob("*.safetensors"))[-1]
    third = hub_server.commit_files(SRC, {shard.name: shard.read_bytes()[:-100]})
    hub_server.reset_stats()
    code, res, err = run()
    assert code == 1, err
    assert res == {"step": "convert", "exit": 1, "pushed": False, "source": SRC, "commit": third,
                   "target": TARGET, "out": str(work / "out" / f"{third}-auto"), "commit_url": None}
    assert shard.name in err and "step 'convert' failed with exit status 1" in err
    assert len(hub_server.history(TARGET)) == commits and hub_server.stats["commit"] == 0
    assert hub_server.uploaded_oids == []


@pytest.mark.parametrize("missing", ["SRC_REPO", "TARGET_REPO"])
def test_recipe_usage_errors_exit_2(missing, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SRC_REPO", "TARGET_REPO")}
    env.update({"SRC_REPO": SRC, "TARGET_REPO": TARGET, "WORK": str(tmp_path)})
    del env[missing]
    p = subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and missing in p.stderr


def test_recipe_unknown_upstream_exits_3(hub_server, recipe):
    run, _, _ = recipe
    code, res, err = run(SRC_REPO="org/no-such-model")
    assert code == 3 and res["step"] == "resolve", err
    assert not hub_server.repo_exists(TARGET)

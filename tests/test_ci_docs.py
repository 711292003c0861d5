"""docs/ci.md's `--json` tables list exactly the keys each command prints (so the documentation cannot drift), and
the recipe and the workflow it describes exist and parse."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import example
from typer.testing import CliRunner

from expq.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ci.md"


def documented(command: str) -> tuple[set[str], set[str]]:
    """(keys, keys marked "only with --tensors") of the table under ``### `expq COMMAND --json` ``."""
    text = DOC.read_text()
    m = re.search(rf"^### `expq {command} --json`\n(.*?)(?=^#|\Z)", text, re.S | re.M)
    assert m, f"no section for expq {command} --json in docs/ci.md"
    keys, optional = set(), set()
    for line in m.group(1).splitlines():
        row = re.match(r"^\| `([^`]+)` \| ([^|]+) \| (.*) \|$", line)
        if row:
            assert row.group(1) not in keys, f"{row.group(1)} listed twice"
            keys.add(row.group(1))
            if row.group(3).startswith("only with `--tensors`"):
                optional.add(row.group(1))
    assert keys, f"empty table for expq {command}"
    return keys, optional


def printed(obj: dict) -> set[str]:
    """Top-level keys, and ``key[].field`` for lists of records (every record's fields)."""
    keys = set(obj)
    for k, v in obj.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            keys |= {f"{k}[].{f}" for x in v for f in x}
    return keys


def cli_json(*args) -> dict:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path_factory.mktemp("ci-docs") / "out"
    return src, out, cli_json("convert", src, out, "--json", "--device", "cpu")


def test_convert_keys_are_documented(converted):
    assert printed(converted[2]) == documented("convert")[0]


def test_inspect_keys_are_documented(converted):
    src = converted[0]
    keys, optional = documented("inspect")
    assert printed(cli_json("inspect", src, "--json")) == keys - optional
    assert printed(cli_json("inspect", src, "--json", "--tensors")) == keys


def test_verify_keys_are_documented(converted):
    src, out, _ = converted
    rep = cli_json("verify", out, "--source", src, "--json", "--device", "cpu", "--tokens", "8")
    assert rep["ok"] is True and rep["checks"] and rep["layers"]
    assert printed(rep) == documented("verify")[0]


def test_push_keys_are_documented(converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    rep = cli_json("push", converted[1], "org/model", "--dry-run", "--json")
    assert rep["dry_run"] is True and rep["files"]
    assert printed(rep) == documented("push")[0]


def test_run_has_no_json_option():
    r = CliRunner().invoke(app, ["run", "--help"])
    assert r.exit_code == 0 and "--json" not in r.output
    assert "`expq run` has no `--json`" in DOC.read_text()


def test_documented_exit_statuses_match_expq():
    """Every status the recipe's table names is one expq uses (errors.py, cli.py), and each expq status is there."""
    from expq import errors

    codes = {c.exit_code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ExpqError)
             and isinstance(c.exit_code, int)} | {0, 129, 130, 143}
    table = re.search(r"^## Exit statuses\n(.*?)(?=^## )", DOC.read_text(), re.S | re.M).group(1)
    listed = set()
    for cell in re.findall(r"^\| ([0-9 /]+) \|", table, re.M):
        listed |= {int(x) for x in cell.split("/")}
    assert listed == codes


def test_recipe_files_parse():
    assert subprocess.run(["sh", "-n", str(ROOT / "examples/ci/prequantize.sh")]).returncode == 0
    wf = yaml.safe_load((ROOT / "examples/ci/github-actions.yml").read_text())
    steps = [s for job in wf["jobs"].values() for s in job["steps"]]
    assert any("prequantize.sh" in s.get("run", "") for s in steps)
    assert any(s.get("uses", "").startswith("actions/cache") for s in steps)

"""The model card ``push`` writes: what it tells a reader to run, and what it says about the checkpoint."""

from __future__ import annotations

import subprocess

import pytest
from helpers import example
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.hub import Install, _checkout_remote, install_line, model_card

GIVEN = 'pip install "expq @ git+https://example.org/expq@0123abc"'


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "mixtral-int8"
    expq.convert(example(tmp_path_factory, "mixtral"), out, format="experts-int8", device="cpu")
    return out


def test_card_install_line_is_the_one_given(int8_out, monkeypatch):
    monkeypatch.delenv("EXPQ_INSTALL", raising=False)
    card = model_card(int8_out, "me/m", install=GIVEN)
    how = card.split("## How it was made", 1)[1].split("```")[1]
    assert how.strip().splitlines()[1] == GIVEN
    usage = card.split("## How to use it", 1)[1]
    vllm = usage.split("### vLLM", 1)[1].split("```")[1]
    assert vllm.splitlines()[1].startswith(GIVEN + "  # expq's vLLM plugin"), vllm
    assert usage.count(GIVEN) == 2  # the install block, and the vLLM one (the plugin lives in expq)
    assert "pip install expq==" not in card and "expq[" not in card  # no package an index would have to hold


def test_card_install_line_from_the_environment(int8_out, monkeypatch):
    monkeypatch.setenv("EXPQ_INSTALL", GIVEN)
    assert install_line() == Install(GIVEN, True, "from $EXPQ_INSTALL")
    assert GIVEN in model_card(int8_out, "me/m")
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True)
    assert rep.warnings == [] and GIVEN in rep.card


def test_unknown_install_line_is_a_placeholder_and_a_warning(int8_out, monkeypatch):
    """This checkout has no remote holding its commit: the card says so rather than naming a package no index
    holds, and push warns, naming the option as the caller spells it."""
    monkeypatch.delenv("EXPQ_INSTALL", raising=False)
    how = install_line()
    if how.runnable:
        pytest.skip(f"this expq was installed from somewhere anyone can install it from: {how.command}")
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True)
    assert len(rep.warnings) == 1 and "placeholder" in rep.warnings[0] and "install='...'" in rep.warnings[0]
    assert "<the expq repository>" in rep.card
    r = CliRunner().invoke(app, ["push", str(int8_out), "me/m", "--dry-run", "--skip-verify"])
    assert r.exit_code == 0 and "WARNING: the card's install line is a placeholder" in r.output
    assert "--install ..." in r.output


def git(root, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_install_line_from_a_checkout_whose_remote_holds_its_commit(tmp_path):
    root = tmp_path / "expq"
    root.mkdir()
    git(root, "init", "-q")
    (root / "f").write_text("x")
    git(root, "add", "f")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git(root, "rev-parse", "HEAD")
    assert _checkout_remote(root) == (None, head)  # no remote
    git(root, "remote", "add", "origin", "git@example.org:org/expq.git")
    assert _checkout_remote(root) == (None, head)  # a remote that does not hold HEAD (never fetched)
    git(root, "update-ref", "refs/remotes/origin/main", head)
    assert _checkout_remote(root) == (f"git+ssh://git@example.org/org/expq.git@{head}", head)
    git(root, "remote", "set-url", "origin", str(tmp_path / "elsewhere"))
    assert _checkout_remote(root) == (None, head)  # a local path is no place a reader can install from

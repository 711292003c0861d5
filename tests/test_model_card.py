"""The model card ``push`` writes: what it tells a reader to run, and what it says about the checkpoint."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import example
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.hub import Install, install_line, model_card
from expq.hub.card import _checkout_remote

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
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True, base_model="org/m", license="mit")
    assert rep.warnings == [] and GIVEN in rep.card


def test_unknown_install_line_is_a_placeholder_and_a_warning(int8_out, monkeypatch):
    """This checkout has no remote holding its commit: the card says so rather than naming a package no index
    holds, and push warns, naming the option as the caller spells it."""
    monkeypatch.delenv("EXPQ_INSTALL", raising=False)
    how = install_line()
    if how.runnable:
        pytest.skip(f"this expq was installed from somewhere anyone can install it from: {how.command}")
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True, base_model="org/m", license="mit")
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


def card_yaml(card: str) -> dict:
    import yaml

    return yaml.safe_load(card.split("---\n")[1])


def test_local_source_card_base_model_and_licence(int8_out, monkeypatch):
    """A checkpoint converted from a plain local directory: the card has neither base_model nor licence unless
    given, and push warns about each (in the caller's terms); given, both are in the card's metadata and the intro
    links the model."""
    monkeypatch.setenv("EXPQ_INSTALL", GIVEN)
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True)
    meta = card_yaml(rep.card)
    assert "base_model" not in meta and "license" not in meta
    assert [w.split(":")[0] for w in rep.warnings] == ["the card has no base_model", "the card has no licence (the "
                                                       "source card has none)"]
    assert "base_model='ORG/NAME'" in rep.warnings[0] and "license='ID'" in rep.warnings[1]
    rep = expq.push(int8_out, "me/m", dry_run=True, skip_verify=True, base_model="org/tiny-mixtral",
                    license="apache-2.0")
    meta = card_yaml(rep.card)
    assert meta["base_model"] == "org/tiny-mixtral" and meta["license"] == "apache-2.0" and rep.warnings == []
    assert "[org/tiny-mixtral](https://huggingface.co/org/tiny-mixtral) at a revision expq did not record" in rep.card
    assert "`expq verify . --source org/tiny-mixtral`" in rep.card
    r = CliRunner().invoke(app, ["push", str(int8_out), "me/m", "--dry-run", "--skip-verify"])
    assert r.exit_code == 0 and "pass --base-model ORG/NAME" in r.output and "pass --license ID" in r.output
    r = CliRunner().invoke(app, ["push", str(int8_out), "me/m", "--dry-run", "--skip-verify", "--base-model",
                                 "org/tiny-mixtral", "--license", "mit"])
    assert r.exit_code == 0 and "WARNING" not in r.output and "base_model: org/tiny-mixtral" in r.output
    assert "license: mit" in r.output


def test_library_name_and_format_explanation_tell_the_truth(int8_out, tmp_path, tmp_path_factory):
    """experts-int8: stock transformers refuses it, so the card does not say library_name: transformers; gpt_oss's
    card explains its format without sending the reader to another format's output."""
    assert card_yaml(model_card(int8_out, "me/m"))["library_name"] == "expq"
    ct = tmp_path / "ct"
    expq.convert(example(tmp_path_factory, "mixtral"), ct, format="compressed-tensors", device="cpu")
    ct_card = model_card(ct, "me/m")
    assert card_yaml(ct_card)["library_name"] == "transformers"
    tf = ct_card.split("### transformers", 1)[1].split("###", 1)[0]
    assert "`Could not match ... in instance of ...`" in tf and "it is harmless" in tf  # said where it is seen
    gpt = tmp_path / "gpt"
    expq.convert(example(tmp_path_factory, "gpt_oss"), gpt, device="cpu")  # the default: experts-int8
    card = model_card(gpt, "me/g")
    assert card_yaml(card)["library_name"] == "expq"
    fmt = next(ln for ln in card.splitlines() if ln.startswith("Format: "))
    assert fmt.startswith("Format: **experts-int8** (this family's default: stock transformers cannot map per-expert "
                          "quantized tensors onto this family's stacked experts"), fmt
    assert "output of this family" not in card


def test_hf_download_local_dir_copy_records_its_commit(hub_server, tmp_path, tmp_path_factory, monkeypatch):
    """A `hf download --local-dir` copy: its .cache/huggingface/download metadata gives the commit (expq.json, the
    convert report, the card's revision); the repo id, which that metadata does not hold, comes from base_model,
    and without it the warning names the commit."""
    from huggingface_hub import snapshot_download

    monkeypatch.setenv("EXPQ_INSTALL", GIVEN)
    commit = hub_server.add_repo("org/tiny-mixtral", example(tmp_path_factory, "mixtral"))
    local = tmp_path / "tiny-mixtral"
    snapshot_download("org/tiny-mixtral", local_dir=local)
    assert any((local / ".cache" / "huggingface" / "download").glob("*.metadata"))
    out = tmp_path / "out"
    report = expq.convert(local, out, device="cpu")
    assert report.commit == commit and report.source == str(local)
    rep = expq.push(out, "me/m", dry_run=True, skip_verify=True, license="apache-2.0")
    assert rep.warnings == [f"the card has no base_model: the source was the local directory tiny-mixtral, a `hf "
                            f"download --local-dir` copy of commit {commit} (which does not record the repo id); "
                            "pass base_model='ORG/NAME'"]
    rep = expq.push(out, "me/m", dry_run=True, skip_verify=True, license="apache-2.0", base_model="org/tiny-mixtral")
    assert rep.warnings == [] and card_yaml(rep.card)["base_model"] == "org/tiny-mixtral"
    assert f"[org/tiny-mixtral](https://huggingface.co/org/tiny-mixtral) at revision `{commit}`" in rep.card
    # one file of another commit: no single commit to claim
    meta = local / ".cache" / "huggingface" / "download" / "config.json.metadata"
    meta.write_text(meta.read_text().replace(commit, "f" * 40, 1))
    assert expq.convert(local, tmp_path / "out2", device="cpu").commit is None


@pytest.mark.parametrize("before", ["none", "file"])
def test_card_in_place_puts_back_what_was_there(tmp_path, before):
    from expq.hub.push import card_in_place

    path = tmp_path / "README.md"
    if before == "file":
        path.write_text("the source's card\n")
    with pytest.raises(KeyboardInterrupt):
        with card_in_place(path, "# card\n"):
            assert path.read_text() == "# card\n" and not path.is_symlink()
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"none": [], "file": ["README.md"]}[before])
    if before == "file":
        assert path.read_text() == "the source's card\n"
    with card_in_place(path, "# card\n"):  # success: the card stays
        pass
    assert path.read_text() == "# card\n" and not path.is_symlink()


def test_card_in_place_never_writes_through_a_link(tmp_path):
    from expq.hub.push import card_in_place
    from expq.io.files import LinkRefused

    (tmp_path / "notes.md").write_text("notes\n")
    path = tmp_path / "README.md"
    path.symlink_to("notes.md")
    with pytest.raises(LinkRefused, match="symbolic link"):
        with card_in_place(path, "# card\n"):
            pass
    assert path.is_symlink() and str(path.readlink()) == "notes.md"
    assert (tmp_path / "notes.md").read_text() == "notes\n" and sorted(os.listdir(tmp_path)) == ["README.md",
                                                                                               "notes.md"]


def test_card_command_for_a_local_source_with_an_odd_name(tmp_path, tmp_path_factory):
    """The reproduce command quotes the whole placeholder path, as a shell reads it."""
    import shlex
    import shutil

    src = tmp_path / "src [a] b"
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    out = tmp_path / "out"
    expq.convert(src, out, device="cpu")
    how = model_card(out, "me/m", install=GIVEN).split("## How it was made", 1)[1].split("```")[1]
    line = how.strip().splitlines()[2]
    assert line == "expq convert 'path/to/src [a] b' m", line
    assert shlex.split(line)[2] == "path/to/src [a] b"

"""``push`` uploads exactly the files its listing shows (``--dry-run``, ``--json``), never a dotfile, and reads,
uploads or writes nothing through a symbolic link; ``verify`` refuses a link that leads out of OUT. Against the
local Hub-compatible server (tests/hub_server.py), with real dotfiles holding secrets and real links; the server's
whole store is searched for the secrets afterwards."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import example
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.hub import push

SECRET = b"HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123"
KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"


def cli(*args, stdout_only: bool = False) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # HF_ENDPOINT & co. point at the test Hub (the fixture set them)
    p = subprocess.run([sys.executable, "-m", "expq.cli", *map(str, args)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=240)
    return p.returncode, p.stdout if stdout_only else p.stdout + p.stderr


def in_process(*args) -> tuple[int, str]:
    """The same command line in this process (typer's CliRunner), where a real process is proven by another call."""
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def store_holds(hub_server, data: bytes) -> bool:
    """Whether any file the test Hub keeps (objects, commits, temporaries) holds ``data``, raw or base64."""
    forms = (data, base64.b64encode(data))
    return any(any(f in p.read_bytes() for f in forms) for p in hub_server.root.rglob("*") if p.is_file())


@pytest.fixture
def converted(hub_server, tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu", max_shard_size="40KB")
    return out


def test_push_uploads_exactly_its_listing_and_never_a_dotfile(hub_server, converted):
    (converted / ".env").write_bytes(SECRET)
    (converted / ".ssh").mkdir()
    (converted / ".ssh" / "id_ed25519").write_bytes(KEY)
    (converted / "sub").mkdir()
    (converted / "sub" / ".netrc").write_bytes(SECRET)
    code, text = cli("push", converted, "me/listed", "--skip-verify", "--dry-run", "--json", stdout_only=True)
    assert code == 0, text
    shown = {f["path"] for f in json.loads(text.splitlines()[-1])["files"]}
    assert not any(p.startswith(".") or "/." in p for p in shown) and "README.md" in shown
    res = push(converted, "me/listed", skip_verify=True)
    assert {f["path"] for f in res.files} == shown
    assert set(hub_server.list_files("me/listed")) - {".gitattributes"} == shown  # exactly the listing
    assert not store_holds(hub_server, SECRET) and not store_holds(hub_server, KEY)
    assert (converted / ".env").read_bytes() == SECRET  # OUT's own files stay as they were


@pytest.mark.parametrize("name", ["docs/extra.txt", pytest.param("NOTES.md", marks=pytest.mark.slow)])
def test_a_link_out_of_out_is_refused_by_verify_and_push_and_nothing_is_published(name, hub_server, converted,
                                                                                  tmp_path):
    outside = tmp_path / "private" / "secret.md"
    outside.parent.mkdir()
    outside.write_bytes(SECRET)
    (converted / name).parent.mkdir(exist_ok=True)
    (converted / name).symlink_to(outside)
    code, text = cli("verify", converted, "--device", "cpu")
    assert code == 2 and len(error_lines(text)) == 1, text
    assert name in text and "outside the checkpoint directory" in text, text
    for run in (cli, in_process):  # push --skip-verify in this process: the real one above proves the exit status
        code, text = run("push", converted, "me/linked", *(() if run is cli else ("--skip-verify",)))
        assert code == 2 and len(error_lines(text)) == 1 and name in text and "symbolic link" in text, text
    assert not hub_server.repo_exists("me/linked") and not store_holds(hub_server, SECRET)
    assert outside.read_bytes() == SECRET and (converted / name).is_symlink()


def test_the_card_is_never_written_through_a_linked_readme(hub_server, converted, tmp_path):
    victim = tmp_path / "elsewhere" / "README.md"
    victim.parent.mkdir()
    victim.write_text("someone else's file\n")
    (converted / "README.md").symlink_to(victim)
    code, text = cli("push", converted, "me/card", "--skip-verify")
    assert code == 2 and len(error_lines(text)) == 1 and "README.md" in text and "symbolic link" in text, text
    assert victim.read_text() == "someone else's file\n" and (converted / "README.md").is_symlink()
    assert not hub_server.repo_exists("me/card")
    assert sorted(p.name for p in converted.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_verify_refuses_a_shard_linked_out_of_out(converted, tmp_path):
    shard = sorted(converted.glob("*.safetensors"))[0]
    moved = tmp_path / "moved" / shard.name
    moved.parent.mkdir()
    shutil.move(shard, moved)
    shard.symlink_to(moved)  # the same bytes, from outside OUT
    code, text = cli("verify", converted, "--device", "cpu")
    assert code == 2 and len(error_lines(text)) == 1 and shard.name in text, text
    assert "outside the checkpoint directory" in text
    shard.unlink()
    shutil.move(moved, shard)
    code, text = in_process("verify", converted, "--device", "cpu")
    assert code == 0, text  # negative control: the same bytes in OUT pass

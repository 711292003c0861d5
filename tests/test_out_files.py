"""Which files OUT may hold, judged by one rule (``manifest.files_against_manifest``) in ``verify`` and in a re-run
of ``convert``: the files expq.json lists, the model card a push writes (listed or not, there or not), and
documentation a user adds are OUT's; anything else (a file, a named pipe, an empty folder) is not, and both say so
naming it. Each case is one that the two used to judge differently, plus negative controls both always agreed on."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import converted_factory, example, tree_digest

import expq
from expq.errors import UsageError
from expq.manifest import Manifest

KW = {"device": "cpu", "max_shard_size": "40KB"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_factory(tmp_path_factory, "outfiles", max_shard_size="40KB")("mixtral")


@pytest.fixture
def out(converted, tmp_path):
    mine = tmp_path / "out"
    shutil.copytree(converted[1], mine)
    return mine


def files_check(rep):
    return next(c for c in rep.checks if c.name == "files match expq.json (size, sha256)")


def test_untouched_out_is_ours_to_both(converted, out):
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok and files_check(rep).detail.endswith(" files")
    assert expq.convert(converted[0], out, **KW).up_to_date


def test_documentation_added_is_kept_by_both(converted, out):
    """verify reported it and passed; convert refused to run at all. Now the re-run has nothing to do and keeps it;
    a rebuild would delete it, so that is still refused (naming it)."""
    (out / "NOTES.md").write_text("my notes\n")
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok and files_check(rep).detail.endswith("files; documentation added since: NOTES.md"), rep.checks
    before = tree_digest(out)
    assert expq.convert(converted[0], out, **KW).up_to_date
    assert tree_digest(out) == before
    with pytest.raises(UsageError, match=r"OUT holds 1 file\(s\) expq did not write \(e\.g\. NOTES\.md\)"):
        expq.convert(converted[0], out, device="cpu", max_shard_size="30KB", overwrite=True)
    assert (out / "NOTES.md").read_text() == "my notes\n"


def test_the_card_removed_is_no_difference_to_either(tmp_path, tmp_path_factory):
    """The source's README.md, copied and listed, then deleted: verify failed (listed but missing) while the re-run
    had nothing to do. The card is the one file a push rewrites: neither needs it."""
    src = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), src)
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# the source's card\n")
    out = tmp_path / "out"
    expq.convert(src, out, **KW)
    assert "README.md" in {f.name for f in Manifest.load(out).files}
    (out / "README.md").unlink()
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok, rep.problems
    assert expq.convert(src, out, **KW).up_to_date and not (out / "README.md").exists()


@pytest.mark.parametrize("what", ["a named pipe", "an empty folder", "a config file"])
def test_anything_else_is_not_ours_to_both(converted, out, what):
    """A named pipe and an empty folder: verify did not see them, convert refused them. A file a loader could read
    (negative control): both always refused it."""
    name = {"a named pipe": "pipe (not a regular file)", "an empty folder": "mine/",
            "a config file": "preprocessor_config.json"}[what]
    if what == "a named pipe":
        os.mkfifo(out / "pipe")
    elif what == "an empty folder":
        (out / "mine").mkdir()
    else:
        (out / "preprocessor_config.json").write_text("{}")
    rep = expq.verify(out, device="cpu", tokens=4)
    assert not rep.ok and rep.exit_code == 1
    assert files_check(rep).detail == f"file {name}: in OUT but not in expq.json (not written by expq convert)"
    with pytest.raises(UsageError, match=rf"expq did not write \(e\.g\. {name.replace('(', '.').replace(')', '.')}\)"):
        expq.convert(converted[0], out, **KW)

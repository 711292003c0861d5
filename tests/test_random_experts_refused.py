"""An explicit ``--format`` that stock transformers would load with randomly initialised experts is refused, unless
acknowledged; ``inspect``, ``verify`` and ``push`` then say it loudly. Which families: the layout's ``[clients]
transformers = false`` (checked against transformers itself in tests/test_convert.py::
test_stock_transformers_cannot_load_stacked_families)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import example
from test_convert import TRANSFORMERS_CANNOT_LOAD
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import UsageError

FLAG = "--allow-random-experts-in-transformers"


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_data_names_fixture_families():
    """The refusal has fixtures to act on (else the tests below would test nothing)."""
    assert TRANSFORMERS_CANNOT_LOAD == {"granitemoe", "gpt_oss", "dbrx"}


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_CANNOT_LOAD))
def test_python_convert_refuses_before_writing(family, tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, family)
    out = tmp_path / "out"
    with pytest.raises(UsageError) as ei:
        expq.convert(src, out, format="compressed-tensors", device="cpu")
    msg = str(ei.value)
    assert f"the {family} family with randomly initialised routed experts" in msg, msg
    assert "format='experts-int8'" in msg and "allow_random_experts_in_transformers=True" in msg, msg
    assert "--" not in msg, msg  # Python callers get parameters, not command-line flags
    assert ei.value.exit_code == 2
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging, no journal, no lock


def test_cli_refuses_then_acknowledged_verify_inspect_and_card_say_it(tmp_path, tmp_path_factory):
    src = example(tmp_path_factory, "gpt_oss")
    out = tmp_path / "gpt-oss-ct"
    r = subprocess.run([sys.executable, "-m", "expq.cli", "convert", str(src), str(out), "--format",
                        "compressed-tensors"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "randomly initialised" in err, err
    assert "--format experts-int8" in err and FLAG in err and "format='" not in err, err
    assert not out.exists()

    r = cli("convert", src, out, "--format", "compressed-tensors", FLAG, "--device", "cpu")
    assert r.exit_code == 0, r.output
    insp = cli("inspect", src, "--format", "compressed-tensors")
    assert insp.exit_code == 0 and "WARNING: stock transformers loads compressed-tensors checkpoints of the gpt_oss " \
        "family with randomly initialised routed experts" in insp.output, insp.output
    v = cli("verify", out, "--tokens", "4", "--device", "cpu")
    assert v.exit_code == 0 and "WARNING: stock transformers loads" in v.output, v.output
    rep = expq.verify(out, device="cpu", tokens=4)
    assert rep.ok and len(rep.warnings) == 1 and "gpt_oss" in rep.warnings[0]
    p = cli("push", out, "me/gpt-oss-ct", "--dry-run", "--json")
    assert p.exit_code == 0
    res = json.loads(p.stdout.strip().splitlines()[-1])
    card = res["card"]
    body = card.split("\n---\n", 1)[1]
    first = next(ln for ln in body.splitlines() if ln.startswith(">"))
    assert first.startswith("> **Warning: do not load this checkpoint with stock transformers.**"), body[:400]
    assert "randomly initialised routed experts" in first
    assert first.endswith("`expq.load_model` loads it right.") and "vLLM" not in first  # vLLM cannot: GPT-OSS
    how = card.split("## How it was made", 1)[1].split("```")[1]
    assert "--format compressed-tensors" in how and FLAG in how, how
    assert res["warnings"][0] == rep.warnings[0]  # then what the card could not say (install line, licence...)


def test_no_warning_where_stock_transformers_loads_it(tmp_path, tmp_path_factory):
    """Negative control: mixtral's compressed-tensors output is what stock transformers loads right."""
    src = example(tmp_path_factory, "mixtral")
    out = tmp_path / "out"
    expq.convert(src, out, format="compressed-tensors", device="cpu")
    assert expq.inspect(src, format="compressed-tensors").summary()["warnings"] == []
    assert expq.verify(out, device="cpu", tokens=4).warnings == []
    from expq.hub import model_card

    card = model_card(out, "me/m")
    assert "Warning" not in card and FLAG not in card

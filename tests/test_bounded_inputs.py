"""Parsing is bounded: a layout file's size and nesting, its ``output.module`` template (no format spec), integers
longer than Python converts (in a layout and in config.json), text with escape sequences (a layout's ``name`` would
reach the terminal), and ``num_experts_per_tok`` above the expert count. Each is one line naming the file and the
key, from the API and the command line (exit 1, no traceback), before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import example, run_cli
from typer.testing import CliRunner

import expq
from expq.cli import app
from expq.errors import ExpqError, LayoutError, SourceError

MIXTRAL = Path(__file__).parent.parent / "configs" / "mixtral.toml"


@pytest.fixture
def src(tmp_path, tmp_path_factory) -> Path:
    s = tmp_path / "src"
    shutil.copytree(example(tmp_path_factory, "mixtral"), s)
    return s


def assert_one_line(src: Path, out: Path, line: str, *extra, subprocess_: bool = False) -> None:
    """``expq convert`` prints exactly ``line`` and exits 1, writing nothing (in this process through typer's runner,
    or, with ``subprocess_``, as a real process)."""
    if subprocess_:
        code, text = run_cli("convert", src, out, "--device", "cpu", *extra)
    else:
        r = CliRunner().invoke(app, ["convert", str(src), str(out), "--device", "cpu", *map(str, extra)])
        code, text = r.exit_code, r.output
    assert code == 1, text
    assert text.splitlines() == [f"error: {line}"], text
    assert not out.exists()


LAYOUTS = {  # layout text -> the error after "file PATH: "
    "format spec": (MIXTRAL.read_text() + '\n[output]\nmodule = "block_sparse_moe.experts.{expert:>200000000}"\n',
                    "output.module must hold a plain {expert}, without a format spec or conversion, got "
                    "'block_sparse_moe.experts.{expert:>200000000}'"),
    "conversion": (MIXTRAL.read_text() + '\n[output]\nmodule = "block_sparse_moe.experts.{expert!r}"\n',
                   "output.module must hold a plain {expert}, without a format spec or conversion, got "
                   "'block_sparse_moe.experts.{expert!r}'"),
    "50,000 nested tables": ("[" + ".".join(["t"] * 50000) + "]\nx = 1\n",
                             "key t.t.t.t.t.t.t.t.t: tables or arrays nested more than 8 deep"),
    "100,000 nested arrays": ("name = \"x\"\nbad = " + "[" * 100000 + "]" * 100000 + "\n",
                              "line 2 (key bad): arrays nested more than 8 deep"),
    "5000-digit integer": (MIXTRAL.read_text().replace('name = "mixtral"', 'name = "mixtral"\nsize = ' + "7" * 5000),
                           "line 2 (key size): an integer with more digits than Python reads (4300)"),
    "escape sequence in name": (MIXTRAL.read_text().replace('name = "mixtral"', 'name = "mix\\u001b[2Jtral"'),
                                "key name: the text holds a control character ('\\x1b' at position 3); layout text "
                                "must be printable"),
    "2 MiB": (MIXTRAL.read_text() + "#" * (2 << 20) + "\n",
              f"cannot read the layout file: it is {len(MIXTRAL.read_text()) + (2 << 20) + 1} bytes; at most "
              f"{1 << 20} are accepted"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_hostile_layout_is_one_line_naming_file_and_key(case, src, tmp_path):
    text, msg = LAYOUTS[case]
    layout = tmp_path / "layout.toml"
    layout.write_text(text)
    with pytest.raises(LayoutError) as ei:
        expq.inspect(src, layout=layout)
    assert str(ei.value) == f"file {layout}: {msg}"
    assert "\x1b" not in str(ei.value)
    assert_one_line(src, tmp_path / "out", f"file {layout}: {msg}", "--layout", layout,
                    subprocess_=case == "format spec")


def test_a_layout_in_a_manifest_is_bounded_too(tmp_path, tmp_path_factory):
    """The layout a checkpoint carries in expq.json goes through the same parser (verify reads it)."""
    out = tmp_path / "out"
    expq.convert(example(tmp_path_factory, "mixtral"), out, device="cpu")
    m = json.loads((out / "expq.json").read_text())
    m["layout_toml"] = LAYOUTS["format spec"][0]
    (out / "expq.json").write_text(json.dumps(m))
    code, text = run_cli("verify", out, "--device", "cpu")
    assert code == 2 and "output.module must hold a plain {expert}" in text and "Traceback" not in text, text


def edit_config(src: Path, fn) -> None:
    cfg = json.loads((src / "config.json").read_text())
    fn(cfg)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))


def test_config_integer_too_long_for_python_names_the_key(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    text = json.dumps(cfg, indent=2).replace('"rope_theta": ', '"rope_theta": ' + "9" * 5000 + ", \"was\": ", 1)
    (src / "config.json").write_text(text)
    line = f"file {src / 'config.json'}: rope_parameters.rope_theta is an integer of 5000 digits (at most 4300)"
    with pytest.raises(SourceError) as ei:
        expq.inspect(src)
    assert str(ei.value) == line
    assert_one_line(src, tmp_path / "out", line, subprocess_=True)


def test_config_integer_too_long_inside_a_nested_list_names_its_path(src):
    edit_config(src, lambda c: c.__setitem__("extra", {"table": [1, 2]}))
    text = (src / "config.json").read_text().replace("2\n", "2" * 4301 + "\n", 1)
    (src / "config.json").write_text(text)
    with pytest.raises(SourceError, match=r"extra\.table\[1\] is an integer of 4301 digits"):
        expq.inspect(src)


def test_top_k_above_the_expert_count_refused(src, tmp_path):
    edit_config(src, lambda c: c.__setitem__("num_experts_per_tok", 5))  # the fixture has 4 experts
    line = "file config.json: num_experts_per_tok = 5 is more than the 4 routed experts (num_local_experts)"
    with pytest.raises(LayoutError) as ei:
        expq.inspect(src)
    assert str(ei.value) == line
    assert_one_line(src, tmp_path / "out", line)


@pytest.mark.parametrize("top_k, why", [(0, "num_experts_per_tok = 0: each token must go to at least one routed "
                                                "expert"),
                                         (-1, "num_experts_per_tok = -1 is negative")])
def test_top_k_below_one_refused(src, tmp_path, top_k, why):
    edit_config(src, lambda c: c.__setitem__("num_experts_per_tok", top_k))
    with pytest.raises(LayoutError) as ei:
        expq.inspect(src)
    assert str(ei.value) == f"file config.json: {why}"
    assert_one_line(src, tmp_path / "out", f"file config.json: {why}")


def test_top_k_equal_to_the_expert_count_accepted(src, tmp_path):
    edit_config(src, lambda c: c.__setitem__("num_experts_per_tok", 4))  # negative control: every expert
    assert expq.inspect(src).summary()["top_k"] == 4


def test_known_layouts_and_a_plain_template_still_load(src, tmp_path):
    layout = tmp_path / "layout.toml"
    layout.write_text(MIXTRAL.read_text() + '\n[output]\nmodule = "block_sparse_moe.experts.{expert}"\n')
    try:
        plan = expq.inspect(src, layout=layout)
    except ExpqError as e:  # pragma: no cover - the failure says why
        pytest.fail(str(e))
    assert plan.layout.name == "mixtral"

"""Layout files (``layouts.parse_layout``): output templates and projection names the schema checks, each refused
in one line naming the layout file."""

from __future__ import annotations

from pathlib import Path

import pytest

from expq.errors import LayoutError
from expq.layouts import parse_layout

MIXTRAL = Path("configs/mixtral.toml").read_text()


@pytest.mark.parametrize("edit,match", [
    ('[output]\nmodule = "block_sparse_moe.experts.{expert}.{bogus}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts.{0}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts.{expert"\n', "output.module .* is not a valid template"),
    ('[output]\nmodule = "x.{expert}.{expert}"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nmodule = "block_sparse_moe.experts"\n', "output.module must hold {expert} exactly once"),
    ('[output]\nup = "w1"\n', "output.gate/up/down must be three different names"),
])
def test_layout_templates_and_names_are_checked(edit, match):
    with pytest.raises(LayoutError, match=match) as ei:
        parse_layout(MIXTRAL + "\n" + edit, "mine.toml")
    assert ei.value.file == "mine.toml"


def test_layout_duplicate_source_names_are_checked():
    with pytest.raises(LayoutError, match="experts.gate/up/down must be three different names"):
        parse_layout(MIXTRAL.replace('up = "w3"', 'up = "w1"'), "mine.toml")

"""Fuzzing (hypothesis) the safetensors header parser and the config reader: a bounded, derandomized run for CI.

The oracles live in ``fuzz_cases.py``; ``bench/fuzz.py N`` (``make fuzz``) runs the same strategies for longer and
reports counts.
"""

from __future__ import annotations

import json
import shutil

import pytest
from fuzz_cases import Counts, check_config, check_header, config_mutations, safetensors_blobs
from helpers import example
from hypothesis import HealthCheck, given, settings

CI = settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HEADER_COUNTS, CONFIG_COUNTS = Counts(), Counts()


@CI
@given(blob=safetensors_blobs())
def test_header_parser_fuzz(blob, tmp_path_factory):
    """Every file: read_header accepts it exactly when the safetensors library opens it, else one SourceError line."""
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    check_header(blob, path, HEADER_COUNTS)


def test_header_fuzz_saw_both_outcomes():
    """The generator reaches both sides of the oracle (ran after the fuzz test above, in file order)."""
    if HEADER_COUNTS.tried == 0:
        pytest.skip("run together with test_header_parser_fuzz")
    assert HEADER_COUNTS.clean_errors >= 50 and HEADER_COUNTS.accepted >= 20, HEADER_COUNTS.line("header")


@pytest.fixture(scope="module")
def fuzz_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("fuzz") / "src"
    shutil.copytree(example(tmp_path_factory, "qwen3_moe"), src)
    return src, json.loads((src / "config.json").read_text())


@settings(CI, max_examples=150)
@given(changes=config_mutations())
def test_config_reader_fuzz(changes, fuzz_src):
    """Every mutated config.json: inspect accepts it or raises one SourceError/LayoutError line, never a crash."""
    src, base = fuzz_src
    check_config(src, base, changes, CONFIG_COUNTS)


def test_config_fuzz_saw_both_outcomes():
    if CONFIG_COUNTS.tried == 0:
        pytest.skip("run together with test_config_reader_fuzz")
    assert CONFIG_COUNTS.clean_errors >= 30 and CONFIG_COUNTS.accepted >= 10, CONFIG_COUNTS.line("config")

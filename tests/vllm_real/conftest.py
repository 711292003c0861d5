"""Tests against the real vLLM package (``make test-vllm``: one virtualenv per vLLM line, CPU only). Skipped where
vLLM is not installed (``make test``'s environment)."""

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers


@pytest.fixture(scope="session")
def vllm_started():
    """vLLM's config and a one-rank gloo group for the whole session (see vllm_harness)."""
    import vllm_harness

    vllm_harness.start(tp_size=1)
    return vllm_harness

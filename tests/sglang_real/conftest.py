"""Tests against the real SGLang package (``make test-vllm`` runs them in its SGLang virtualenv, CPU only). Skipped
where SGLang is not installed."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

"""Byte-identical outputs: the sha256 of every file expq writes for every CI fixture (and the demo model), recorded
before the tree was reshaped (issue 8) and checked on every run, so that a refactor that changes one byte fails.

The fixtures are built by transformers from seeded tiny configs; their own sha256 is recorded too, so that a change
in the *source* (a new transformers version) is reported as such and not blamed on expq. Re-record (only after a
deliberate change of the output format, said in the commit) with ``EXPQ_UPDATE_GOLDENS=1 make test``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import example, tree_digest

import expq
from expq.demo import DEMO_CONFIG
from expq.examples import FAMILIES, build_example

GOLDENS = Path(__file__).parent / "goldens" / "outputs_sha256.json"
SHARD = "40KB"
# (case name, family, source dtype, convert options)
CASES = [(f, f, torch.bfloat16, {}) for f in FAMILIES] + [
    ("olmoe-fp32-auto", "olmoe", torch.float32, {}),
    ("olmoe-fp16-auto", "olmoe", torch.float16, {}),
    ("olmoe-fp32-float32", "olmoe", torch.float32, {"dtype": "float32"}),
    ("olmoe-bf16-float16", "olmoe", torch.bfloat16, {"dtype": "float16"}),
] + [(f"{f}-experts-int8", f, torch.bfloat16, {"format": "experts-int8"}) for f in ("mixtral", "gpt_oss", "dbrx")]
UPDATE = os.environ.get("EXPQ_UPDATE_GOLDENS") == "1"


def _recorded() -> dict:
    return json.loads(GOLDENS.read_text()) if GOLDENS.is_file() else {}


def _check(case: str, src: Path, out: Path) -> None:
    got = {"source": tree_digest(src), "output": tree_digest(out)}
    if UPDATE:
        data = _recorded()
        data[case] = got
        GOLDENS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return
    want = _recorded().get(case)
    assert want is not None, f"no golden for {case}: record with EXPQ_UPDATE_GOLDENS=1"
    assert got["source"] == want["source"], f"{case}: the fixture itself changed (transformers?), not expq's output"
    assert sorted(got["output"]) == sorted(want["output"]), f"{case}: different output files"
    changed = sorted(k for k in want["output"] if got["output"][k] != want["output"][k])
    assert not changed, f"{case}: output files changed: {changed}"


@pytest.mark.parametrize("case,family,dtype,opts", CASES, ids=[c[0] for c in CASES])
def test_fixture_outputs_byte_identical(case, family, dtype, opts, tmp_path, tmp_path_factory):
    src = tmp_path / "src"  # a fixed name: expq.json records the source directory's name
    shutil.copytree(example(tmp_path_factory, family, dtype=dtype), src)
    out = tmp_path / "out"
    # the acknowledgement that gpt_oss, granitemoe and dbrx in compressed-tensors are not for stock transformers:
    # it changes no byte
    expq.convert(src, out, max_shard_size=SHARD, device="cpu",
                 **{"format": "compressed-tensors", "allow_random_experts_in_transformers": True, **opts})
    _check(case, src, out)


def test_demo_output_byte_identical(tmp_path):
    src = build_example("mixtral", tmp_path / "mixtral-demo", dtype=torch.bfloat16, max_shard_size="10MB",
                        **DEMO_CONFIG)
    out = tmp_path / "mixtral-demo-int8"
    expq.convert(src, out, max_shard_size="10MB", device="cpu", format="compressed-tensors")
    _check("demo", src, out)

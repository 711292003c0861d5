"""``expq.options``: usage errors come first, before torch is imported or the source opened, with the same words
from the command line and the API; its names agree with the formats and dtypes they stand for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import expq
from expq.errors import UsageError
from expq.options import DTYPE_ALIASES, DTYPE_NAMES, parse_size

# (argv, environment, the one line expected on stderr): each must exit 2 before torch is imported
CASES = [
    (["convert", "SRC", "out", "--format", "gguf"], {}, "error: unknown --format 'gguf'; supported: auto, "
                                                       "compressed-tensors, experts-int8"),
    (["convert", "SRC", "out", "--dtype", "int4"], {}, "error: unknown --dtype 'int4'; use auto, bfloat16, float16, "
                                                      "float32"),
    (["convert", "SRC", "out", "--format", "experts-int8", "--dtype", "int4"], {},  # a known format: names only
     "error: unknown --dtype 'int4'; use auto, bfloat16, float16, float32"),
    (["convert", "SRC", "out", "--max-shard-size", "lots"], {}, "error: --max-shard-size: not a size: 'lots' (use "
                                                               "e.g. 5GB, 500MB, 2GiB)"),
    (["convert", "SRC", "out", "--device", "gpu"], {}, "error: unknown device 'gpu' (use auto, cpu, cuda, cuda:N or a "
                                                      "comma-separated list)"),
    (["convert", "./nope", "out"], {}, "error: file ./nope: no such directory, and not a Hub repo id"),
    (["convert", "SRC", "out", "--stream"], {}, "error: file SRC: --stream applies to Hub repo ids; SRC is a local "
                                               "directory (convert it without --stream)"),
    (["convert", "SRC", "--to-hub", "me/x"], {}, "error: --to-hub needs --ray: its tasks upload the shards they "
                                                "write (on one machine, convert to OUT and run `expq push OUT REPO`)"),
    (["convert", "SRC", "out"], {"EXPQ_PROGRESS_INTERVAL": "abc"}, "error: EXPQ_PROGRESS_INTERVAL='abc' is not a "
                                                                   "number of seconds >= 0 (unset it for the "
                                                                   "default, 5)"),
    (["inspect", "./nope"], {}, "error: file ./nope: no such directory, and not a Hub repo id"),
    (["inspect", "SRC", "--format", "gguf"], {}, "error: unknown --format 'gguf'; supported: auto, "
                                                "compressed-tensors, experts-int8"),
    (["verify", "SRC", "--tokens", "0"], {}, "error: --tokens must be at least 1"),
    (["verify", "SRC", "--device", "cuda:0,cuda:1"], {}, "error: unknown device 'cuda:0,cuda:1' (use auto, cpu, "
                                                         "cuda, cuda:N)"),
    (["run", "SRC", "--max-new-tokens", "0"], {}, "error: --max-new-tokens must be at least 1"),
    (["run", "SRC", "--prompt", " "], {}, "error: --prompt is empty"),
    (["push", "SRC", "datasets/me/x"], {}, "error: 'datasets/me/x' is not a model repo id (namespace/name)"),
    (["push", "SRC", "me/my model [x]"], {}, "error: 'me/my model [x]' is not a model repo id (namespace/name)"),
]

RUNNER = """
import contextlib, io, json, os, sys
from expq.cli import main
results = []
for argv, env in json.loads(sys.argv[1]):
    os.environ.pop("EXPQ_PROGRESS_INTERVAL", None)
    os.environ.update(env)
    sys.argv = ["expq", *argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
heavy = sorted(m for m in ("torch", "transformers", "huggingface_hub", "safetensors") if m in sys.modules)
print(json.dumps({"results": results, "heavy": heavy}))
"""


def test_usage_errors_come_before_torch(tmp_path, tmp_path_factory):
    from helpers import example

    src = str(example(tmp_path_factory, "mixtral"))
    cases = [([src if a == "SRC" else str(tmp_path / a) if a == "out" else a for a in argv], env)
             for argv, env, _ in CASES]
    r = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                       timeout=300, env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], got["heavy"]
    for (argv, _, want), (code, err) in zip(CASES, got["results"]):
        assert code == 2 and err.strip() == want.replace("file SRC", f"file {src}"), (argv, code, err)
    assert not (tmp_path / "out").exists()


def test_the_api_says_the_same(tmp_path, tmp_path_factory):
    from helpers import example

    src = example(tmp_path_factory, "mixtral")
    with pytest.raises(UsageError, match="unknown --dtype 'int4'"):
        expq.convert(src, tmp_path / "out", dtype="int4")
    with pytest.raises(UsageError, match="--max-shard-size: not a size"):
        expq.inspect(src, max_shard_size="lots")
    with pytest.raises(UsageError, match="not a model repo id"):
        expq.push(src, "me")


def test_names_agree_with_what_they_stand_for():
    import torch

    from expq.io.safetensors import dtype_name
    from expq.scheme import COMPUTE_DTYPES

    assert COMPUTE_DTYPES == {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    assert [dtype_name(d) for d in COMPUTE_DTYPES.values()] == ["BF16", "F16", "F32"]
    assert set(DTYPE_ALIASES.values()) <= set(DTYPE_NAMES)


@pytest.mark.parametrize("text,value", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 << 30), ("40 kb", 40000),
                                        ("1.5GB", 15 * 10**8), ("123", 123), (7, 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "0", "-1GB", "0MB", "nanGB", "infGB", 0, -5])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)

#!/usr/bin/env bash
# Creates bench/.venv-llmc: llm-compressor from the package registry, in a virtualenv of its own (its pins on
# transformers/compressed-tensors need not match expq's), for bench/convert.py's `llmc` variant.
#
#   bash bench/setup_llmc.sh              # or: make bench-llmc
#   LLMC_VERSION=0.14.0.1 bash bench/setup_llmc.sh
#
# torch is installed first, pinned to the version expq's lock uses (on our machines pip takes it from the local CPU
# wheel; elsewhere it is the registry's build), so that llm-compressor's own torch range does not pull a multi-GB
# CUDA build. On a GPU machine set LLMC_TORCH to the torch already there (e.g. LLMC_TORCH=2.11.0) or leave it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${LLMC_VENV:-$here/.venv-llmc}"
python="${PYTHON:-python3}"
torch_pin="${LLMC_TORCH:-2.13.0}"
spec="llmcompressor${LLMC_VERSION:+==$LLMC_VERSION}"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==$torch_pin"
"$venv/bin/python" -m pip install -q "$spec"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch
from llmcompressor import model_free_ptq  # noqa: F401 - the entry point bench/convert.py calls
print("llmcompressor", md.version("llmcompressor"), "| compressed-tensors", md.version("compressed-tensors"),
      "| transformers", md.version("transformers"), "| torch", torch.__version__)
PY

#!/bin/bash
# A/B on the device: this checkout (early identity hash while torch imports) against build/ab/pre (5400a28, before it)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/conv-site .whl-conv/*.whl
export PYTHONPATH=$PWD:/tmp/conv-site
mkdir -p "$OUT/ab"
nproc; python3 -c "import torch; print(torch.__version__)"
timeout "${BUDGET_S:-540}" python3 bench/convert.py --model qwen3-30b-a3b:12 --variants floor,expq-cuda --formats experts-int8 \
  --runs 3 --work /tmp/b28 --baseline build/ab/pre --json "$OUT/ab/qwen3-pre.json" \
  > "$OUT/ab/qwen3-pre.md" 2> "$OUT/ab/qwen3-pre.log" || echo "stopped ($?)"
grep -E "^\| " "$OUT/ab/qwen3-pre.md" | tail -8; tail -5 "$OUT/ab/qwen3-pre.log"

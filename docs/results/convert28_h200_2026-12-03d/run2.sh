#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/conv-site .whl-conv/*.whl
export PYTHONPATH=$PWD:/tmp/conv-site
mkdir -p "$OUT/ab"
timeout "${BUDGET_S:-230}" python3 bench/convert.py --model mixtral-8x7b:4 --variants floor,expq-cuda --formats experts-int8 \
  --runs 2 --work /tmp/b28 --baseline build/ab/main --json "$OUT/ab/mixtral-main.json" \
  > "$OUT/ab/mixtral-main.md" 2> "$OUT/ab/mixtral-main.log" || echo "stopped ($?)"
grep -E "^\| " "$OUT/ab/mixtral-main.md" | tail -3; tail -3 "$OUT/ab/mixtral-main.log"

#!/bin/bash
# A/B on the device: this checkout (front pool of 4 + reads) against build/ab/main (HEAD) and build/ab/cap2 (pool of 2)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/conv-site .whl-conv/*.whl
export PYTHONPATH=$PWD:/tmp/conv-site
mkdir -p "$OUT/ab"
deadline=$((SECONDS + ${BUDGET_S:-560}))
timeout 120 python3 -m pytest -q -m gpu tests/test_scheme_gpu.py -k "front_pass" -p no:cacheprovider 2>&1 | tail -3
run() {  # model base variants runs
  left=$((deadline - SECONDS)); [ "$left" -gt 60 ] || { echo "no time for $1 $2"; return; }
  timeout "$left" python3 bench/convert.py --model "$1" --variants "$3" --formats experts-int8 --runs "$4" \
    --work /tmp/b28 --baseline "build/ab/$2" --json "$OUT/ab/${1%%:*}-$2.json" \
    > "$OUT/ab/${1%%:*}-$2.md" 2> "$OUT/ab/${1%%:*}-$2.log" || echo "ab $1 $2 stopped ($?)"
  grep -E "^\| " "$OUT/ab/${1%%:*}-$2.md" | tail -3
}
run qwen3-30b-a3b:12 main floor,expq-cuda 3
run qwen3-30b-a3b:12 cap2 expq-cuda 3
rm -rf /tmp/b28/qwen3*
run mixtral-8x7b:4 main floor,expq-cuda 2

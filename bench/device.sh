#!/usr/bin/env bash
# The H200 session's device calls as named steps (issues 12, 13, 26), so that each `run` is one short command issued
# within the machine's 30 s idle window. Run from the repo root on the device machine; results go to $OUT.
#
#   bash bench/device.sh stage 00      # carry [".vllm/bundle.part-00", ".vllm/bundle.sha256"]
#   bash bench/device.sh stage 01      # carry [".vllm/bundle.part-01"]
#   bash bench/device.sh install       # carry [".vllm/bundle.part-02", ".whl-min"]: vLLM 0.24 + expq's wheel
#   bash bench/device.sh gpu-tests     # the GPU kernel and end-to-end tests (~150 s; carry .whl-conv)
#   bash bench/device.sh kernel-tune   # bench/tune_kernel.py (BUDGET_S, TUNE_ARGS: e.g. "--tokens 1024 --base ...")
#   bash bench/device.sh kernel-compare  # needs install: compare with vLLM (3 interleaved rounds, ~5 min)
#   bash bench/device.sh kernel-profile  # needs install: the kernel-by-kernel profile, end to end
#   bash bench/device.sh issue12       # needs install: the card's vllm serve test, the full-size load comparison
#   bash bench/device.sh serve-bench   # needs install: bench/serve.py (SERVE_ARGS, default: Qwen3 shape, 2 runs,
#                                      #   --profile, 540 s); a second call with --resume carries on (same machine)
#   bash bench/device.sh kernel-choice # needs install: the custom op's GPU tests, then vllm_compare.py with
#                                      #   expq's kernel and Marlin against online experts_int8 (VC_FAMILIES,
#                                      #   VC_PARALLEL; llama4_text and deepseek_v3 serve one at a time:
#                                      #   VC_PARALLEL=1 EXPQ_VC_GPU_UTIL=0.5)
#   bash bench/device.sh serve-check   # needs install: the card's vllm serve test, two small families via LLM()
#   bash bench/device.sh e2e-profile   # needs install: host-time profile of the e2e forwards; sort-free decode
#   bash bench/device.sh kernel-ir     # bench/kernel_ir.py with this machine's Triton: the table's configs, GEMM1 and 2
#   bash bench/device.sh plugin-check  # needs install: both formats of one fixture served by vLLM 0.24 vs online
#                                      # experts_int8 (serve_check.py from ../shared/tools/offline-vllm, or SERVE_CHECK)
#   bash bench/device.sh convert28     # bench/convert.py on the GPU against the I/O floor, both output formats: bf16
#                                      # Qwen3-30B-A3B (12 layers) and Mixtral-8x7B (4 layers), DeepSeek-V3 FP8 (2
#                                      # layers), GPT-OSS-120B MXFP4 (4 layers); one run each (RUNS), 520 s in all,
#                                      # at most ~35 GB of disk at a time (each model's files deleted after it);
#                                      # MODELS overrides the list (e.g. "deepseek-v3:2 gpt-oss-120b:4"); STAGES=1
#                                      # adds bench/stage_times.py's experts-int8 profile of each source
#
# .vllm/ comes from ../shared/tools/offline-vllm/prepare.sh .vllm; .whl-min/ holds typer, rich, click, shellingham,
# markdown_it, mdurl, pygments and the expq wheel (`pip wheel --no-deps -w .whl-min .`: the wheel carries the
# vllm.general_plugins entry point). `vllm serve` from that bundle imports model_hosting_container_standards, which
# the bundle lacks: `install` puts an empty stand-in for it under /tmp/stub (SageMaker hooks only).
set -euo pipefail
OUT=${OUT:-/tmp/out}
STAGE=/tmp/stage
export VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_CACHE_DIR=$PWD/build/triton-cache
# $PWD before /tmp/site: expq's code comes from this checkout (the wheel in /tmp/site brings the entry point)
vllm_env() { export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/stub:$PWD:/tmp/site; }

case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    cp ".vllm/bundle.part-$2" "$STAGE/"
    [ -f .vllm/bundle.sha256 ] && cp .vllm/bundle.sha256 "$STAGE/"
    ls "$STAGE" ;;
  install)
    cp .vllm/bundle.part-02 "$STAGE/"
    (cd "$STAGE" && sha256sum -c --quiet bundle.sha256 && mkdir -p x /tmp/site /tmp/site.whl \
      && cat bundle.part-* | tar -xf - -C x \
      && python3 -c "import tarfile; tarfile.open('x/vllm.tar.xz', 'r:xz').extractall('/tmp/site')" \
      && tar -xf x/deps.tar -C /tmp/site.whl \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
           /tmp/site.whl/*.whl)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl-min/*.whl
    mkdir -p /tmp/bin /tmp/stub/model_hosting_container_standards/sagemaker
    printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/bin/vllm
    chmod +x /tmp/bin/vllm
    touch /tmp/stub/model_hosting_container_standards/__init__.py
    printf 'def __getattr__(name):\n    def f(*a, **k):\n        if len(a) == 1 and callable(a[0]) and not k:\n            return a[0]\n        return lambda g=None, *x, **y: g\n    return f\n' \
      > /tmp/stub/model_hosting_container_standards/sagemaker/__init__.py
    vllm_env
    python3 -c "import vllm, expq.engines.vllm as p; print('vllm', vllm.__version__)" ;;
  gpu-tests)
    mkdir -p "$OUT"
    # the end-to-end file needs expq's dependencies (.whl-conv, installed by convert28 into /tmp/conv-site)
    if [ -d .whl-conv ] && [ ! -d /tmp/conv-site ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/conv-site .whl-conv/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/conv-site
    timeout 300 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_gpu_end_to_end.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -15 || true ;;
  kernel-tune)
    export PYTHONPATH=$PWD
    mkdir -p "$OUT/tune"
    # shellcheck disable=SC2086 # TUNE_ARGS is a list of arguments
    python3 bench/tune_kernel.py --out build/tune --budget-s "${BUDGET_S:-380}" ${TUNE_ARGS:-} \
      2> "$OUT/tune/log.txt" | tail -3
    cp build/tune/*.json "$OUT/tune/" ;;
  kernel-ir)
    export PYTHONPATH=$PWD
    mkdir -p "$OUT"
    for key in "E=8,H=4096,I=14336,top_k=2,dtype=bfloat16 4096 14336" "E=128,H=2048,I=768,top_k=8,dtype=bfloat16 2048 768" \
               "E=256,H=7168,I=2048,top_k=8,dtype=bfloat16 7168 2048"; do
      set -- $key
      e=${1%%,*}
      timeout 120 python3 bench/kernel_ir.py --shape "$1" --gemm 1 --k "$2" --json "$OUT/ir_E${e#E=}_gemm1.json" \
        2>&1 | tail -8 || true
      timeout 120 python3 bench/kernel_ir.py --shape "$1" --gemm 2 --k "$3" --json "$OUT/ir_E${e#E=}_gemm2.json" \
        2>&1 | tail -8 || true
    done ;;
  kernel-compare)
    vllm_env
    if [ -f build/tune/NVIDIA_H200.json ]; then export EXPQ_KERNEL_CONFIGS=$PWD/build/tune; fi
    timeout 500 python3 bench/bench_kernel.py --compare --md "$OUT/compare.md" --json "$OUT/compare.json" \
      2> "$OUT/compare.err" | tail -30 || true ;;
  kernel-profile)
    vllm_env
    if [ -f build/tune/NVIDIA_H200.json ]; then export EXPQ_KERNEL_CONFIGS=$PWD/build/tune; fi
    timeout 300 python3 bench/profile_kernel.py --iters 10 --json "$OUT/prof.json" --md "$OUT/prof.md" 2>&1 \
      | grep -v '^{' | tail -30 || true
    timeout 150 python3 bench/bench_kernel.py --e2e --json "$OUT/e2e.json" 2>&1 | tail -8 || true ;;
  serve-check)
    # needs install: the card's vllm serve test, then LLM() of two families against online experts_int8
    vllm_env
    timeout 240 python3 -m pytest -q -m gpu tests/test_card_commands.py -k vllm -p no:cacheprovider \
      --basetemp=/tmp/pt 2>&1 | grep -E "passed|failed|^E " | tail -30 || true
    mkdir -p "$OUT/serve"
    for f in /tmp/pt/*/serve.log; do [ -f "$f" ] && cp "$f" "$OUT/serve/$(basename "$(dirname "$f")").log"; done
    timeout 200 python3 bench/vllm_compare.py /tmp/small --families mixtral,qwen3_moe --runs online,converted \
      --parallel 2 --prepare-timeout 100 --budget 190 2>&1 | tail -12 || true
    cp /tmp/small/vllm_compare.* "$OUT/" 2>/dev/null || true ;;
  e2e-profile)
    # needs install (the e2e model loads through expq.runtime, which needs pydantic: the vLLM bundle has it): the
    # e2e forwards with torch.profiler's host-time table of one eager forward each; the sort-free decode
    vllm_env
    timeout 200 python3 bench/bench_kernel.py --e2e --e2e-profile-host --json "$OUT/e2e_prof.json" 2>&1 | tail -120 || true
    timeout 100 python3 bench/bench_sort_free.py --json "$OUT/sort_free.json" 2>&1 | grep -v '^{' | tail -8 || true ;;
  serve-bench)
    # results and checkpoints under build/serve (kept on a warm machine: --resume in the next call), copied to $OUT
    vllm_env
    mkdir -p "$OUT/serve"
    # shellcheck disable=SC2086 # SERVE_ARGS is a list of arguments
    timeout 590 python3 bench/serve.py build/serve ${SERVE_ARGS:---shapes qwen3 --runs 2 --profile --budget 540} \
      2>&1 | grep '^\[serve\]' | tail -40 || true
    cp -r build/serve/serve.json build/serve/serve.md build/serve/logs build/serve/runs "$OUT/serve/" 2>/dev/null || true
    head -80 build/serve/serve.md 2>/dev/null || true ;;
  kernel-choice)
    export PYTHONPATH=$PWD
    mkdir -p "$OUT"
    timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_custom_op.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests_custom_op.log" | tail -5 || true
    vllm_env
    timeout 400 python3 bench/vllm_compare.py /tmp/vck --families "${VC_FAMILIES:-mixtral,qwen3_moe}" \
      --runs "${VC_RUNS:-online,converted,expq,marlin}" --parallel "${VC_PARALLEL:-3}" --budget "${VC_BUDGET:-390}" 2>&1 | tail -20 || true
    cp /tmp/vck/vllm_compare.* "$OUT/" 2>/dev/null || true ;;
  issue12)
    vllm_env
    timeout 240 python3 -m pytest -q -m gpu tests/test_card_commands.py -k vllm -p no:cacheprovider \
      --basetemp=/tmp/pt 2>&1 | grep -E "passed|failed|^E " | tail -30 || true
    mkdir -p "$OUT/serve"
    for f in /tmp/pt/*/serve.log; do [ -f "$f" ] && cp "$f" "$OUT/serve/$(basename "$(dirname "$f")").log"; done
    EXPQ_VC_GPU_UTIL=0.5 timeout 330 python3 bench/vllm_compare.py /tmp/big --families mixtral \
      --set mixtral.hidden_size=4096 --set mixtral.intermediate_size=14336 --set mixtral.num_hidden_layers=2 \
      --set mixtral.num_attention_heads=32 --set mixtral.num_key_value_heads=8 --runs online,converted \
      --parallel 1 --prepare-timeout 200 --budget 320 2>&1 | tail -30 || true
    cp /tmp/big/vllm_compare.* "$OUT/" 2>/dev/null || true ;;
  plugin-check)
    # A Mixtral fixture (hidden 256: Marlin; 1024 positions: serve_check's max_model_len 512) converted to both
    # formats; the three served at once (gpu_memory_utilization 0.3 each): online --quantization experts_int8 on the
    # bf16 source, compressed-tensors (stock vLLM, Marlin), experts-int8 (expq's plugin); prompt log-probabilities
    # and greedy tokens compared with the online run.
    vllm_env
    sc=${SERVE_CHECK:-}
    for c in ../shared/tools/offline-vllm/serve_check.py shared/tools/offline-vllm/serve_check.py; do
      [ -z "$sc" ] && [ -f "$c" ] && sc=$c
    done
    [ -n "$sc" ] || { echo "serve_check.py not found: set SERVE_CHECK"; exit 2; }
    d=/tmp/plugin-check r=$OUT/plugin-check
    rm -rf "$d" && mkdir -p "$d" "$r"
    python3 -c "import sys; from expq.demo import DEMO_CONFIG; from expq.examples import build_example; \
build_example('mixtral', sys.argv[1], max_position_embeddings=1024, init_std=0.02, **DEMO_CONFIG)" "$d/src"
    python3 -c "import expq.cli; expq.cli.main()" convert "$d/src" "$d/ct" --format compressed-tensors --device cpu \
      > "$r/convert.log" 2>&1
    python3 -c "import expq.cli; expq.cli.main()" convert "$d/src" "$d/ei8" --format experts-int8 --device cpu \
      >> "$r/convert.log" 2>&1
    (timeout 240 python3 "$sc" run "$d/src" "$r/online.json" --quantization experts_int8 > "$r/online.log" 2>&1 &
     timeout 240 python3 "$sc" run "$d/ct" "$r/ct.json" > "$r/ct.log" 2>&1 &
     timeout 240 python3 "$sc" run "$d/ei8" "$r/ei8.json" > "$r/ei8.log" 2>&1 &
     wait)
    grep -h "^ran\|Error" "$r"/*.log | tail -6 || true
    python3 "$sc" compare "$r/online.json" "$r/ct.json" "$r/ei8.json" 2>&1 | tee "$r/compare.txt" ;;
  convert28)
    # one bench/convert.py per model (a JSON each, even if a later one runs out of time), within one deadline;
    # expq's dependencies the machine lacks (pydantic, typer, rich, compressed-tensors...): wheels in .whl-conv
    if [ -d .whl-conv ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/conv-site .whl-conv/*.whl
    fi
    export PYTHONPATH=$PWD:/tmp/conv-site
    mkdir -p "$OUT/convert28"
    python3 -c "import expq.cpu_kernels as k; print('cpu kernel:', k.active(), k._import_error())" 2>&1 | tail -1
    deadline=$((SECONDS + ${BUDGET_S:-520}))
    for m in ${MODELS:-qwen3-30b-a3b:12 mixtral-8x7b:4 deepseek-v3:2 gpt-oss-120b:4}; do
      left=$((deadline - SECONDS))
      [ "$left" -gt 40 ] || { echo "convert28: no time left for $m"; break; }
      timeout "$left" python3 bench/convert.py --model "$m" --variants floor,expq-cuda,decode --runs "${RUNS:-1}" \
        --work /tmp/bench28 --json "$OUT/convert28/${m%%:*}.json" \
        > "$OUT/convert28/${m%%:*}.md" 2> "$OUT/convert28/${m%%:*}.log" || echo "convert28: $m stopped ($?)"
      grep -E "^\| |PASS|FAIL" "$OUT/convert28/${m%%:*}.md" || tail -3 "$OUT/convert28/${m%%:*}.log"
      # STAGES=1: where experts-int8's time goes on the GPU (bench/stage_times.py on the same source)
      src=$(ls -d /tmp/bench28/"${m%%:*}"*/src-* 2>/dev/null | head -1)
      left=$((deadline - SECONDS))
      if [ -n "${STAGES:-}" ] && [ -n "$src" ] && [ "$left" -gt 40 ]; then
        # twice in one process: the first with an empty marker cache (a config's first conversion), then warm
        EXPQ_CACHE_DIR=$(mktemp -d) timeout "$left" python3 bench/stage_times.py "$src" /tmp/bench28/stage-out \
          --device cuda --format experts-int8 --repeat 2 --timeline > "$OUT/convert28/${m%%:*}-stages.txt" 2>&1 || echo "stages: $m stopped ($?)"
        grep -v "unit" "$OUT/convert28/${m%%:*}-stages.txt" | tail -60
      fi
      rm -rf /tmp/bench28/"${m%%:*}"* /tmp/bench28/stage-out
    done
    rm -rf /tmp/bench28 ;;
  *)
    sed -n '2,27p' "$0"; exit 2 ;;
esac

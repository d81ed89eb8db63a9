# The two commands: `make run` (the main Hydra job) and `make test` (the test suite).
# Both create .venv if missing and install the project into it; torch is pinned to the
# CPU build 2.13.0 so no multi-GB CUDA wheel is pulled.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run lint test test-all bench bench-save gpu-bundle gpu-check test-gpu-stack clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.run $(ARGS)

# The layer contracts (pyproject.toml [tool.importlinter]) and ruff; make test runs them first.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers (CI has 2 cores), each computing with one thread (tests/conftest.py);
# --dist loadscope runs a module's tests on one worker, so its module fixtures are built once
# (xdist_group marks are not honoured with pytest 9).  TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope --durations=15 $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "not bench" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m experiments.bench $(ARGS)

bench-save: $(STAMP)
	$(BIN)/python -m experiments.bench --save $(ARGS)

# The lent GPU machine (Python 3.12, torch 2.11, no network, no Hydra): `make gpu-bundle`
# here, with the network, unpacks what that image lacks into .gpu_bundle/; `make gpu-check`
# there runs the check with the image's python3 (scripts/README.md).
gpu-bundle:
	PY=$(PY) bash scripts/gpu_bundle.sh

gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

# The GPU image's stack on CPU (CI runs it after `make test`; needs a Python 3.12).
test-gpu-stack:
	bash scripts/ci_gpu_stack.sh

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

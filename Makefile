# The two commands: `make run` (the main Hydra job) and `make test` (the test suite).
# Both create .venv if missing and install the project into it; torch is pinned to the
# CPU build 2.13.0 so no multi-GB CUDA wheel is pulled.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: install run lint test test-all bench bench-save gpu-check clean

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

test: lint
	$(BIN)/python -m pytest -q -m "not slow" --durations=15 $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "not bench" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m experiments.bench $(ARGS)

bench-save: $(STAMP)
	$(BIN)/python -m experiments.bench --save $(ARGS)

gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

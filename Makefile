# KVGuard: `make demo` and `make test` are all a fresh machine with Python 3.11 needs.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# This machine's CPU build of torch; the `engine` extra's range then installs nothing more.
TORCH ?= torch==2.13.0

.PHONY: venv demo test lint typecheck bench test-vllm clean

$(BIN)/kvguard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[engine,test,dev]'
	touch $@

venv: $(BIN)/kvguard

demo: venv
	$(BIN)/kvguard demo

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy engine_patch proxy fake_engine kvguard

test: lint
	$(BIN)/pytest -q

bench: venv
	$(BIN)/python benchmarks/bench_checksum.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis

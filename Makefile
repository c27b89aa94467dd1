# KVGuard: `make demo` and `make test` are all a fresh machine with Python 3.11 needs.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# This machine's CPU build of torch; the `engine` extra's range then installs nothing more.
TORCH ?= torch==2.13.0
# vllm-router for the proxy benchmark, in its own environment.
BENCH_VENV ?= .venv-bench

.PHONY: venv demo test lint typecheck test-vllm bench bench-checksum bench-proxy \
	bench-vllm bench-fake bench-ejection clean

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

test: lint typecheck
	$(BIN)/pytest -q

# Real vLLM 0.32 on CPU (its own venv, a tiny local model, two instances + the proxy).
test-vllm:
	PYTHON=$(PYTHON) scripts/test_vllm.sh

bench: bench-checksum bench-proxy

bench-checksum: venv
	$(BIN)/python benchmarks/bench_checksum.py

bench-fake: venv
	$(BIN)/python benchmarks/bench_fake_engine.py --breakdown

bench-ejection: venv
	$(BIN)/python benchmarks/bench_ejection.py

$(BENCH_VENV)/bin/vllm-router:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q vllm-router==0.1.17

bench-proxy: venv $(BENCH_VENV)/bin/vllm-router
	$(BIN)/python benchmarks/bench_proxy.py --router-bin $(BENCH_VENV)/bin/vllm-router

# Needs the venv `make test-vllm` creates.
bench-vllm:
	.venv-vllm/bin/python benchmarks/bench_vllm_pd.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis build

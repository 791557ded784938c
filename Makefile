# Tandem: `make serve` (install, fetch the default model, start the OpenAI-compatible server),
# `make run` (the same, but generate once from a sample prompt) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROMPT ?= Explain in two sentences why the sky is blue.
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve run fetch lint test test-fast bench clean vllm-env

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,cluster]'
	touch $(STAMP)

install: $(STAMP)

fetch: install
	$(BIN)/tandem model fetch

serve: fetch
	$(BIN)/tandem serve --host $(HOST) --port $(PORT)

run: fetch
	$(BIN)/tandem generate --chat "$(PROMPT)" --max-tokens 96

lint: install
	$(BIN)/ruff check src tests scripts

# vLLM's CPU build in its own environment, for tests/test_vllm_plugin.py (once: 3-5 minutes)
vllm-env:
	bash scripts/setup_vllm_env.sh

test: lint vllm-env
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: fetch
	$(BIN)/tandem bench offline --concurrency 1,32 --repeats 3 --json bench-results/offline.json

clean:
	rm -rf $(VENV) build *.egg-info

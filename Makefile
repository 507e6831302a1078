# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hermes-gateway run

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

bench: $(STAMP)
	$(BIN)/python scripts/bench_store.py

clean:
	rm -rf $(VENV) build *.egg-info

# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make test`'s pytest-xdist workers. More than the cores: most of the suite's wall time
# is waiting (daemons starting, turns, long polls), not CPU. `make test TEST_WORKERS=0`
# runs it in one process.
TEST_WORKERS ?= 4

.PHONY: run test lint bench soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hermes-gateway run

# lint-imports: the import contracts in pyproject.toml (imports flow one way).
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/lint-imports

# Benchmarks (minutes, not part of `make test`); figures go to BENCHMARKS.md.
bench: $(STAMP)
	$(BIN)/python scripts/bench_store.py --concurrency 32
	$(BIN)/python scripts/bench_gateway.py
	$(BIN)/python scripts/load_http.py --saturate
	$(BIN)/python scripts/crashloop.py --iterations 50

soak: $(STAMP)
	$(BIN)/python scripts/soak.py --minutes 30 --rate 50

clean:
	rm -rf $(VENV) build *.egg-info

# Two commands on a fresh machine: `make run` (the default experiment) and `make test`.
# Each creates and fills .venv on first use (pinned by constraints.txt).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORKDIR ?= runs/dates

.PHONY: run test test-slow bench venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.train --config configs/dates.py --workdir $(WORKDIR)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m experiments.benchmark_attention

clean:
	rm -rf $(VENV) runs

# Two commands on a fresh machine: `make run` (the default experiment) and `make test`.
# Each creates and fills .venv on first use (pinned by constraints.txt).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WORKDIR ?= runs/dates

.PHONY: run test test-integration test-slow test-min bench docs docs-serve venv clean

# What training needs (the experiments extra) for `make run`; everything (the test extra:
# peers, docs, hf) for the rest.
RUN_STAMP := $(VENV)/.installed-experiments

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP) $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[experiments]'
	touch $(RUN_STAMP)

venv: $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m experiments.train --config configs/dates.py --workdir $(WORKDIR)

# The unit suite (pyproject's default markers: not slow, not integration): in-process, minutes.
# PYTEST_ARGS adds options to either part (CI passes --durations=25).
PYTEST_ARGS ?=
# XLA's backend (LLVM) at optimization level 0: the tests' tiny programs spend their time
# compiling, not running, and codegen settings change no semantics (XLA's own passes, fusion
# included, still run). Unit suite: about 23% less time; integration part: 17% less (its
# hf, generation, serving and train files, slower type: 279 s against 338 s). The CPU
# self-test (tests/selftest) runs at the default level, so optimised code is tested in CI too.
O0 := $(XLA_FLAGS) --xla_backend_optimization_level=0
test: $(STAMP)
	XLA_FLAGS="$(O0)" $(BIN)/python -m pytest -q -n 2 --dist worksteal $(PYTEST_ARGS)

# The integration part: subprocesses (multi-device checks, the wheel, the command lines),
# benchmark smoke runs, the site build with every page's examples, end-to-end trainings. Each
# test file stays on one worker, so a module's training fixture trains once. A worker that dies
# ends the run (xdist's loadfile scheduler can wait forever for a replacement's work).
test-integration: $(STAMP)
	XLA_FLAGS="$(O0)" $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 \
	  -m 'integration and not slow' $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The suite at the oldest supported releases (constraints-min.txt), in its own .venv-min.
MIN_VENV  := .venv-min
MIN_STAMP := $(MIN_VENV)/.installed

$(MIN_STAMP): pyproject.toml constraints-min.txt
	$(PY) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install -q --upgrade pip
	$(MIN_VENV)/bin/pip install -q -c constraints-min.txt -e '.[test]'
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/python -m pytest -q -n 2

bench: $(STAMP)
	$(BIN)/python -m experiments.bench.attention

# The documentation site (mkdocs.yml): built into site/, every page's examples run on the way
# (docs/hooks/examples.py); --strict makes a warning (a broken link, a missing reference) fatal.
export NO_MKDOCS_2_WARNING := 1
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve --strict

clean:
	rm -rf $(VENV) runs site

# `make quickstart` and `make test` work on a fresh machine: each installs into .venv first if needed.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install quickstart test test-fast lint benchmark benchmark-cpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/fl-lightning fit --config configs/quickstart.yaml

# Two workers, each taking whole files (a module's fixtures are computed once).
PYTEST_PARALLEL := -n 2 --dist loadfile

test: $(STAMP)
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check fl_lightning tests benchmarks

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) -m "not multiprocess and not slow"

benchmark: $(STAMP)
	$(PYTHON) benchmarks/throughput.py

benchmark-cpu: $(STAMP)
	$(PYTHON) benchmarks/cpu_rounds.py

clean:
	rm -rf $(VENV) runs

# edgefl: the two set-up commands of the README.
#   make demo   creates .venv, installs edgefl, runs a federated job on real data, prints the result
#   make test   installs the test extras, runs ruff, mypy (strict) and pytest
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
DEMO_ARGS ?= --json out/demo.json

.PHONY: demo test lint typecheck pytest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip

# Agents run with python -OO (no docstrings: ~2.6 MiB less RSS each); compile that bytecode once here.
$(VENV)/.demo-installed: $(BIN)/python setup.cfg pyproject.toml
	$(PIP) install -e '.[demo]'
	$(BIN)/python -m compileall -q -o 2 -j 0 $(VENV)/lib edgefl agent coordinator dashboard >/dev/null || true
	touch $@

$(VENV)/.test-installed: $(BIN)/python setup.cfg pyproject.toml
	$(PIP) install -e '.[demo,test]'
	$(BIN)/python -m compileall -q -o 2 -j 0 $(VENV)/lib edgefl agent coordinator dashboard >/dev/null || true
	touch $@ $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	@mkdir -p out
	$(BIN)/edgefl demo $(DEMO_ARGS)

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .

typecheck: $(VENV)/.test-installed
	$(BIN)/python -m tools.typecheck

pytest: $(VENV)/.test-installed
	$(BIN)/pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) out build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# edgefl: the set-up commands of the README.
#   make demo   creates .venv, installs edgefl, runs a federated job on real data, prints the result
#   make check  the fast tier, every minute: the tests that start no broker and no process (< 1 min)
#   make test   what CI runs: ruff, mypy (strict) and every test, on $(TEST_WORKERS) parallel workers
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
DEMO_ARGS ?= --json out/demo.json
WORKERS ?= 2
# the full suite mostly waits on brokers and child processes (2 workers kept 2 cores ~60 % busy): more
# workers fill that idle time (1,159 tests: 364 s with 2, 285 s with 3; 1,255 tests in a fresh clone:
# 395 s with 3, 389 s with 4: now the 2 cores are the limit)
TEST_WORKERS ?= 4

.PHONY: demo check test tools lint typecheck pytest clean

# Python 3.11's own pip (23.2) installs an editable pyproject project: no upgrade (a download) first
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Agents run with python -OO (no docstrings: ~2.6 MiB less RSS each); compile that bytecode once here.
# The build and test tools never run under -OO: their -OO bytecode would be 40 % of the files for nothing.
NEVER_OPTIMIZED := /site-packages/(pip|setuptools|pkg_resources|mypy|mypyc|pygments|hypothesis|_pytest|xdist|playwright|rich|markdown_it)/
# The tests' workers, the CLI they start and the tools run without -OO: their plain bytecode too (pip
# compiles the dependencies'; without it every such process compiles the product again, ~0.2 s of CPU).
HARNESS_BYTECODE := edgefl agent coordinator dashboard cross_build bench tools tests/support
$(VENV)/.demo-installed: $(BIN)/python setup.cfg pyproject.toml
	$(PIP) install -e '.[demo]'
	$(BIN)/python -m compileall -q -o 2 -j 0 -x '$(NEVER_OPTIMIZED)' $(VENV)/lib edgefl agent coordinator dashboard >/dev/null || true
	touch $@

$(VENV)/.test-installed: $(BIN)/python setup.cfg pyproject.toml
	$(PIP) install -e '.[demo,test]'
	$(BIN)/python -m compileall -q -o 2 -j 0 -x '$(NEVER_OPTIMIZED)' $(VENV)/lib edgefl agent coordinator dashboard >/dev/null || true
	$(BIN)/python -m compileall -q -o 0 -j 0 $(HARNESS_BYTECODE) >/dev/null || true
	touch $@ $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	@mkdir -p out
	$(BIN)/edgefl demo $(DEMO_ARGS)

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .

typecheck: $(VENV)/.test-installed
	$(BIN)/python -m tools.typecheck

# the tests start a real mosquitto and drive a real chromium: say so at once, not after 900 errors
tools:
	@command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || \
	  { echo "make test: mosquitto is missing: sudo apt-get install mosquitto (or run .ci/run)" >&2; exit 1; }
	@[ -x /usr/bin/chromium ] || \
	  { echo "make test: chromium is missing: sudo apt-get install chromium (or run .ci/run)" >&2; exit 1; }
	@command -v openssl >/dev/null 2>&1 || \
	  { echo "make test: openssl is missing: sudo apt-get install openssl (or run .ci/run)" >&2; exit 1; }

# pytest rewrites every test module's asserts on import (~6 s of CPU for the 126 files) and caches the
# result beside them, unless PYTHONDONTWRITEBYTECODE is set; every worker reads that cache when it is
# there. One collection first writes it (a no-op when it is current), so the workers do not each rewrite
# all the files again (4 workers: ~24 s of CPU less; a failed collection is reported by the run itself).
WARM_ASSERTS = env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -q --collect-only -p no:cacheprovider >/dev/null 2>&1 || true

pytest: $(VENV)/.test-installed tools
	@$(WARM_ASSERTS)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

check: $(VENV)/.test-installed
	@$(WARM_ASSERTS)
	EDGEFL_FAST_TIER=1 $(BIN)/pytest -q -n $(WORKERS) -m "not broker and not subprocess and not bench"

# ruff and mypy (one core each, ~1 min) run beside the tests rather than before them: the tests wait on
# brokers and child processes much of their time, so the checks fill that idle core; each line of output
# is printed whole, and make test fails if any of the three does
test: tools $(VENV)/.test-installed
	$(MAKE) --no-print-directory -j 3 --output-sync=line lint typecheck pytest

clean:
	rm -rf $(VENV) out build *.egg-info .mypy_cache .ruff_cache .pytest_cache

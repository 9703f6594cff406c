# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv once and install torch==2.13.0 (CPU wheel) first, then gradstats with its
# runtime dependencies (all `make demo` needs; stamp $(RUNTIME)); `make test` and the other targets
# add the dev extra into the same .venv (stamp $(STAMP)). Every other package comes at the exact
# version pinned in constraints.txt (so a fresh clone tests what was tested). `make test-latest`
# runs the same tests in .venv-latest with whatever the registry serves today; `make constraints`
# rewrites constraints.txt from such an install.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUNTIME := $(VENV)/.gradstats-runtime
STAMP  := $(VENV)/.gradstats-installed
TORCH  := torch==2.13.0
LATEST := .venv-latest
PYTEST_DEFAULT := -m pytest -q -m "not slow and not gpu" -n 2

.PHONY: venv demo test lint typecheck test-latest constraints test-slow test-all bench sample-run figures experiments clean

TORCH_CHECK := import torch, sys; sys.exit(None if torch.__version__.split("+")[0] == "2.13.0" else "torch " + torch.__version__ + " replaced torch==2.13.0: a dependency asked for another torch")

venv: $(STAMP)

# torch, then gradstats with its runtime dependencies only: what `make demo` needs
$(RUNTIME): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "constraints.txt pins versions that need Python >= 3.11 (numpy, scipy, pandas, ...): use PYTHON=python3.11 (remove .venv first), or make test-latest")'
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt $(TORCH)
	$(PY) -m pip install --quiet -c constraints.txt -e .
	$(PY) -c '$(TORCH_CHECK)'
	touch $(RUNTIME)

# the dev extra on top (tests, lint, type check, the integrations' libraries)
$(STAMP): $(RUNTIME) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -c '$(TORCH_CHECK)'
	touch $(STAMP)

demo: $(RUNTIME)
	$(VENV)/bin/gradstats demo

# The default test run (CI): the lint, the type check of the public API, then every test except
# those marked slow, on the pinned versions; it prints its 15 slowest tests.
test: venv lint typecheck
	$(PY) $(PYTEST_DEFAULT) --durations=15

# ruff: unused and undefined names, pycodestyle, import order ([tool.ruff] in pyproject.toml)
lint: venv
	$(VENV)/bin/ruff check gradstats tests bench experiments tools

# mypy on the public API as typed user code calls it ([tool.mypy] in pyproject.toml)
typecheck: venv
	$(VENV)/bin/mypy

# The same tests on the newest versions the registry serves (no constraints; torch stays 2.13.0):
# tells whether the next `make constraints` is safe.
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager $(TORCH) -e '.[dev]'
	$(LATEST)/bin/python -c 'import torch, sys; sys.exit(None if torch.__version__.split("+")[0] == "2.13.0" else "torch " + torch.__version__ + " replaced torch==2.13.0")'
	$(LATEST)/bin/ruff check gradstats tests bench experiments tools
	$(LATEST)/bin/mypy
	$(LATEST)/bin/python $(PYTEST_DEFAULT)

# Rewrite constraints.txt (its comment header kept) from a fresh venv holding the newest versions.
constraints:
	rm -rf $(VENV)-constraints
	$(PYTHON) -m venv $(VENV)-constraints
	$(VENV)-constraints/bin/python -m pip install --quiet --upgrade pip
	$(VENV)-constraints/bin/python -m pip install --quiet $(TORCH)
	$(VENV)-constraints/bin/python -m pip install --quiet -e '.[dev]'
	grep '^#' constraints.txt > constraints.txt.new || true
	$(VENV)-constraints/bin/python -m pip freeze --all --exclude-editable \
		| grep -v -i -E '^(pip|torch|gradstats)==' >> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(VENV)-constraints

test-slow: venv
	$(PY) -m pytest -q -m "slow"

test-all: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	for b in bench/[a-z]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# the study's experiments (hours on a CPU; not part of `make test`): raw results in
# experiments/results/, tables in docs/RESULTS.md
experiments: venv
	$(PY) experiments/scale_study.py --remaining
	for e in scale_study flush_drift near_lognormal distributions pruning_accuracy lowprec_accuracy push allocation_accuracy recommend_accuracy \
	         criteria_correlation threshold_training pruning_real fpanalysis_real; do \
		echo "== experiments/$$e.py"; $(PY) experiments/$$e.py || exit 1; done
	$(PY) experiments/report.py

# the committed sample run (data/sample-run) and the figure gallery (figures/) made from it
sample-run: venv
	$(PY) tools/make_sample_run.py --out data/sample-run

figures: venv
	$(VENV)/bin/gradstats figures data/sample-run -o figures

clean:
	rm -rf $(VENV) $(LATEST) build dist *.egg-info .pytest_cache

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv once, install torch==2.13.0 (CPU wheel) first, then gradstats with its dev extra.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gradstats-installed
TORCH  := torch==2.13.0

.PHONY: venv demo test test-slow test-all bench sample-run figures experiments clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/gradstats demo

# The default test run (CI): everything except checks marked slow.
test: venv
	$(PY) -m pytest -q -m "not slow and not gpu" -n 2

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
	for e in distributions pruning_accuracy lowprec_accuracy push pruning_real fpanalysis_real; do \
		echo "== experiments/$$e.py"; $(PY) experiments/$$e.py || exit 1; done
	$(PY) experiments/report.py

# the committed sample run (data/sample-run) and the figure gallery (figures/) made from it
sample-run: venv
	$(PY) tools/make_sample_run.py --out data/sample-run

figures: venv
	$(VENV)/bin/gradstats figures data/sample-run -o figures

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache

# Every target builds its own environment in .venv on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-busy test-slow lint demo bench docs proto proto-check dist deb clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . || $(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/genproto.py --check

# The suite runs once, in parallel: twice as many pytest-xdist workers as cores, so the tests contend for the CPU
# as on a busy shared machine (tests wait for events, never for time); the 15 slowest items are printed.
WORKERS ?= $(shell echo $$(( $$(nproc) * 2 )))
PYTEST  := $(PY) -m pytest -q -n $(WORKERS) --dist load --durations=15

test: lint
	$(PYTEST)

# The suite in one process while another keeps one core busy (the serial form of what `make test` proves).
test-busy: lint
	$(PY) tools/busy.py -- $(PY) -m pytest -q -p no:xdist

# The docs site (docs/, mkdocs.yml) into site/: strict, so a broken link or a page left out of the nav fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The loops marked `slow` (deselected by `make test`; tests/conftest.py).
test-slow: $(STAMP)
	$(PYTEST) -m slow

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) bench/run.py

# The wheel and sdist (dist/), and from the wheel a Debian package with its own environment in /opt/phalanx.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .

deb: dist
	tools/build-deb dist/phalanx-*-py3-none-any.whl dist

proto: $(STAMP)
	$(PY) tools/genproto.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache

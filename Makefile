# Every target builds its own environment in .venv on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-busy test-slow lint demo bench proto proto-check dist deb clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . || $(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/genproto.py --check

test: lint
	$(PY) -m pytest -q

# The same suite while another process keeps one core busy: tests wait for events, never for time.
test-busy: lint
	$(PY) tools/busy.py -- $(PY) -m pytest -q

# The loops marked `slow` (deselected by `make test`; tests/conftest.py).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

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

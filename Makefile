# varbatch_kit: every target creates/refreshes .venv itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.varbatch_kit-installed

.PHONY: venv demo test lab bench lint clean

venv: $(STAMP)

# torch is pinned to the local CPU build *before* the package, so the
# package's torch range is already met and no CUDA build is pulled.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m varbatch_kit.demo

# scripts/ensure_chromium.sh installs Debian's Chromium for tests/browser when it is
# missing and we are root; it never fails the run (without Chromium those tests skip).
test: $(STAMP)
	-@sh scripts/ensure_chromium.sh
	$(PY) -m pytest -q

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

bench: $(STAMP)
	$(PY) -m benchmarks.run

lint: $(STAMP)
	$(VENV)/bin/ruff check varbatch_kit tests benchmarks scripts data

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis

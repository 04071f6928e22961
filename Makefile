# The README's two commands: `make demo` (the built-in 2-process CPU training) and
# `make test` (every suite). Both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint unit multiprocess notebook browser bench clean

$(STAMP): pyproject.toml requirements/ci.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/ci.txt
	$(PY) -m pip install --quiet -e '.[dev]' -r requirements/ci.txt
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nbaccel demo

test: lint unit multiprocess notebook browser

lint: $(STAMP)
	$(PY) -m ruff check nbaccel tests benchmarks
	$(PY) -m ruff format --check nbaccel tests benchmarks
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit

multiprocess: $(STAMP)
	$(PY) -m pytest tests/multiprocess

notebook: $(STAMP)
	$(PY) -m pytest tests/notebook

# JupyterLab in Debian's headless chromium (installed by .ci/install-browser, a no-op once there).
browser: $(STAMP)
	.ci/install-browser
	$(PY) -m pytest tests/browser

bench: $(STAMP)
	$(PY) benchmarks/launch_latency.py
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/sharding_memory.py

clean:
	rm -rf $(VENV) nbaccel_runs .pytest_cache .mypy_cache .ruff_cache

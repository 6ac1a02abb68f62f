# Two commands on a fresh machine: `make demo` trains on the embedded default, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for the test setup; the library itself only asks for torch>=2.6.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint check bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/padless sft examples/sft_tiny.yaml

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

check: $(VENV)/.installed
	$(VENV)/bin/padless check

bench: $(VENV)/.installed
	$(PY) benchmarks/sft_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

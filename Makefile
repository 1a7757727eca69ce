# `make test` and `make demo` work from a fresh clone: they create/refresh .venv,
# install the pinned CPU wheel torch==2.13.0 first (an unpinned torch would pull a
# multi-GB CUDA build), then the package with its extras, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sac-compile-installed
TORCH  := torch==2.13.0
# pytest-xdist workers; Inductor's own compile pool is kept to one thread per worker.
JOBS   ?= 2

export TORCHINDUCTOR_COMPILE_THREADS ?= 1
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: install test lint demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test,demo]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(PY) -m ruff check sac_compile tests examples benchmarks
	$(PY) -m ruff format --check sac_compile tests examples benchmarks

test: install lint
	$(PY) -m pytest -n $(JOBS) --dist worksteal -q tests

demo: install
	$(PY) examples/demo.py

bench: install
	-$(PY) benchmarks/frontier.py  # exits 1 when a keep set is dominated: report, keep going
	$(PY) benchmarks/saved_memory.py
	$(PY) benchmarks/eager_vs_compiled.py
	$(PY) benchmarks/hf_moe_keep_sets.py
	$(PY) benchmarks/ep_moe.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

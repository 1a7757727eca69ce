# `make test` and `make demo` work from a fresh clone: they create/refresh .venv,
# install the pinned CPU wheel torch==2.13.0 first (an unpinned torch would pull a
# multi-GB CUDA build), then the package with its extras, then run.
#
# `make test TORCH=2.15.0` (or 2.14.1, any supported release) does the same in a
# venv of its own, .venv-torch2.15.0. Releases after 2.13.0 exist only as the full
# CUDA build (it runs on the CPU; 2.15.0 is ~3 GB of wheels), and this machine's pip
# constraint file caps torch at 2.14.1: that venv's installs read an empty
# constraint file instead (PIP_CONSTRAINT, set for those pip commands only; no
# system file is touched).
PYTHON ?= python3
TORCH  ?= 2.13.0
DEFAULT_TORCH := 2.13.0
# sac_compile.hf supports transformers >=5.24.0,<5.26: the default venv tests the lowest
# release, every other venv the newest (5.25.0, whose huggingface-hub 2.x needs datasets 5.x;
# torchtitan, installed without its metadata, runs with it).
ifeq ($(TORCH),$(DEFAULT_TORCH))
VENV   ?= .venv
PIP_ENV :=
HF_PINS := transformers==5.24.0 datasets==4.7.0
else
VENV   ?= .venv-torch$(TORCH)
PIP_ENV := PIP_CONSTRAINT=$(abspath $(VENV))/no-constraints.txt
HF_PINS := transformers==5.25.0 datasets==5.2.0
endif
# What `make test` runs (tests/releases.py, docs/testing.md): on the default release every test
# but the `extended` breadth (CI); on a newer torch the release tier, the unit tier and the
# `every_release` tests. `make test TIER=` runs every test on any release.
ifeq ($(TORCH),$(DEFAULT_TORCH))
TIER   ?= not extended
else
TIER   ?= (every_release or not (slow or distributed or subprocess)) and not extended
endif
# torchtitan and the two packages of its own that require torch: --no-deps, so that no
# other torch is pulled (examples/torchtitan, tests/test_torchtitan.py)
TORCHTITAN := torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sac-compile-installed
DEMO_STAMP := $(VENV)/.sac-compile-demo-installed
# pytest-xdist workers; Inductor's own compile pool is kept to one thread per worker.
JOBS   ?= 2

export TORCHINDUCTOR_COMPILE_THREADS ?= 1
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: install test test-fast lint demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip itself and the pinned torch, first in every install
define install_torch
	: > $(VENV)/no-constraints.txt
	$(PIP_ENV) $(PY) -m pip install --quiet --upgrade pip
	$(PIP_ENV) $(PY) -m pip install --quiet torch==$(TORCH)
endef

$(STAMP): pyproject.toml Makefile | $(PY)
	$(install_torch)
	$(PIP_ENV) $(PY) -m pip install --quiet -e '.[test,demo,torchtitan,bench]' $(HF_PINS)
	$(PIP_ENV) $(PY) -m pip install --quiet --no-deps $(TORCHTITAN)
	$(PY) -c "import torch; v = torch.__version__.split('+')[0]; assert v == '$(TORCH)', v"
	touch $(STAMP)

# The demo needs torch and the package (matplotlib for its plot): nothing of the test,
# torchtitan or bench extras. A venv that `make install` made has it all already.
$(DEMO_STAMP): pyproject.toml Makefile | $(PY)
	$(install_torch)
	$(PIP_ENV) $(PY) -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

# mypy reads torch's annotations: it runs on the default release only (what the
# package's `# type: ignore[...]` comments are checked against).
lint: install
	$(PY) -m ruff check sac_compile tests examples benchmarks
	$(PY) -m ruff format --check sac_compile tests examples benchmarks
ifeq ($(TORCH),$(DEFAULT_TORCH))
	$(PY) -m mypy
endif

test: install lint
	$(PY) -m pytest -n $(JOBS) --dist worksteal -q --durations=25 $(if $(TIER),-m "$(TIER)") tests

# The unit tier (docs/testing.md): no end-to-end Inductor compile, no rank process, no fresh
# interpreter. Minutes, for the inner loop; `make test` runs every tier (on 2.13.0).
test-fast: install
	$(PY) -m pytest -n $(JOBS) --dist worksteal -q --durations=10 -m "not slow and not distributed and not subprocess" tests

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

bench: install
	-$(PY) benchmarks/frontier.py  # exits 1 when a keep set is dominated: report, keep going
	-$(PY) benchmarks/peers.py  # beside torch_remat; exits 1 when a verdict is not met
	$(PY) benchmarks/saved_memory.py
	$(PY) benchmarks/offload_bytes.py
	$(PY) benchmarks/offload_plan.py
	-$(PY) benchmarks/compile_time.py  # exits 1 when ours is over 3% above PyTorch SAC compiling the same kernels
	$(PY) benchmarks/eager_vs_compiled.py
	$(PY) benchmarks/hf_moe_keep_sets.py
	$(PY) benchmarks/ep_moe.py
	-$(PY) benchmarks/compiled_methods.py  # exits 1 when keeping attention is slower than full recompute
	$(PY) benchmarks/trainer_layouts.py  # every layout xtuner compiles a checkpointed layer in
	-$(PY) benchmarks/hf_families.py --compiled  # exits 1: JetMoE's compiled router (graph-reused)
	-$(PY) benchmarks/depth.py  # every family at 32 layers compiled per layer; exits 1 on a flagged row
	-$(PY) benchmarks/hf_vision_families.py --compiled  # every stack of vision-language, audio, seq2seq families
	-for task in image-text-to-text causal-lm seq2seq speech-seq2seq; do $(PY) benchmarks/hf_scan.py --task $$task; done  # exits 1: refused families
	$(PY) benchmarks/integrations.py
	$(PY) benchmarks/published.py  # the device planner beside 20 published runs (about 9 min)
	$(PY) examples/torchtitan/compare.py  # torchtitan's trainer, 1 process eager
	$(PY) examples/torchtitan/compare.py --compile
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/torchtitan/compare.py --tp 2
	$(PY) examples/torchtitan/moe_mtp.py  # DeepSeek-V3 + MTP, built directly: gradients bit for bit
	$(PY) examples/torchtitan/compare.py --model deepseek_v3_mtp --layers 3 --steps 2 --iters 1
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/torchtitan/compare.py --model deepseek_v3_mtp --tp 2 --ep 2 --layers 2 --seq-len 64 --steps 2 --iters 1

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache

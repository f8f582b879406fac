# Two entry points on a fresh machine (Python 3.10 to 3.13):
#   make example   -- plans the bundled GRPO step (installs waveplan alone: numpy + numba)
#   make test      -- runs the whole test suite (installs every extra the suite needs)
# numba caches compiled kernels where waveplan.pricing.jit_cache says (WAVEPLAN_CACHE_DIR).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export TORCHDYNAMO_DISABLE := 1

# The planner and the CLI: numpy and numba, no torch.
$(BIN)/.installed-core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $@

# Everything the test suite imports: OR-Tools, torch, megatron-core, transformers + PEFT, veRL, pytest.
$(BIN)/.installed: $(BIN)/.installed-core
	# torch is pinned to the CPU wheel that lies on disk; any other spec pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[solver,megatron,fsdp,dev]'
	touch $@

install-core: $(BIN)/.installed-core

install: $(BIN)/.installed

example: install-core
	$(BIN)/waveplan plan grpo-8x8 --model qwen3.8-27b --tp 4 --sp --recompute full --lora-rank 16 --free-gib 40

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m pytest bench --benchmark-only

.PHONY: install-core install example test bench

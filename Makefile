# Two entry points on a fresh machine (Python 3.10 to 3.13):
#   make example   -- plans the bundled GRPO step
#   make test      -- runs the whole test suite
# numba caches compiled kernels where waveplan.pricing.jit_cache says (WAVEPLAN_CACHE_DIR).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export TORCHDYNAMO_DISABLE := 1

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to the CPU wheel that lies on disk; any other spec pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[solver,megatron,dev]'
	touch $@

install: $(BIN)/.installed

example: install
	$(BIN)/waveplan plan grpo-8x8 --model qwen3.8-27b --tp 4 --sp --recompute full --lora-rank 16 --free-gib 40

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m pytest bench --benchmark-only

.PHONY: install example test bench

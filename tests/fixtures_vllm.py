"""Session fixtures: the tiny model and one vLLM (with the kvedit connector) per test session."""
from __future__ import annotations

import pytest

CHUNK = 256  # the kv_server fixture's chunk size; the connector uses the server's


@pytest.fixture(scope="session")
def tiny_model():
    from kvedit.harness.tiny_model import default_tiny_model

    return default_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model, kv_server):
    """vLLM on the tiny model, float32, connector pointed at `kv_server`, served name
    "tiny-qwen3", token ids in logprobs, prefix caching on (dev mode exposes
    POST /reset_prefix_cache so a test can force the connector path)."""
    from kvedit.harness.vllm_launch import start_vllm

    with start_vllm(tiny_model, server=kv_server, served_model_name="tiny-qwen3",
                    dtype="float32", kv_cache_gib=1, max_model_len=4096, chunk_size=CHUNK,
                    dev_mode=True) as vp:
        yield vp

"""Fixtures of the engine tier on the session's tiny-model vLLM (tests/fixtures_vllm.py), one
copy for every file that edits through it: `ctx` (an SDK context on that vLLM's model, one
per module), `post` (the OpenAI-completions engine call on it) and `hf_queries`
(transformers' post-RoPE queries of the tiny model, the reference for query capture).
A file that needs another engine or model defines its own fixture of the same name."""
from __future__ import annotations

import pytest

from kvedit.sdk.context import connect
from kvedit.sdk.openai import openai_completion
from tests.hf_reference import qwen3_queries


@pytest.fixture(scope="module")
def ctx(vllm_server, kv_server):
    with connect(kv_server.url, kv_server.http_url, vllm_server.model, timeout=60) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def post(vllm_server):
    return openai_completion(vllm_server.base_url, vllm_server.model)


@pytest.fixture(scope="module")
def hf_queries(tiny_model):
    """queries(tokens) -> [L, T, Hq*D] from transformers, float32 (tests/hf_reference.py)."""
    return qwen3_queries(tiny_model)

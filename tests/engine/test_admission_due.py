"""Store mode "evict" per step (`Admission.due`) against vLLM's real BlockPool (no vLLM
process): a remembered chunk is stored when the step's schedule takes one of its blocks
after it was watched, dropped when vLLM writes that block before the forward, and watched
exactly when it is still whole and has a block among the first `reach` free blocks. The
watch set is checked against a plain reference (every deferred chunk, every block), so the
scheduler's shortcuts (one hash check per chunk, not per block) cannot change what it
watches."""
from __future__ import annotations

from types import SimpleNamespace

from kvedit.vllm.admission import Admission

BS, CHUNK, BLOCKS = 16, 64, 64        # 4 blocks a chunk
PER = CHUNK // BS


def _pool_with_a_finished_request(n_chunks: int):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=BS)
    blocks = pool.get_new_blocks(n_chunks * PER)
    req = SimpleNamespace(block_hashes=[BlockHash(bytes([i + 1]) * 32)
                                        for i in range(len(blocks))])
    pool.cache_full_blocks(req, blocks, 0, len(blocks), BS, 0)
    pool.free_blocks(blocks)           # free and cached: at the free queue's tail, in order
    return pool, [b.block_id for b in blocks]


def _reference_watch(a: Admission) -> set[bytes]:
    head, block, tail = set(), a.pool.free_block_queue.fake_free_list_head.next_free_block, \
        a.pool.free_block_queue.fake_free_list_tail
    while block is not tail and len(head) < a.reach:
        head.add(block.block_id)
        block = block.next_free_block
    return {k for k, d in a.deferred.items()
            if head & set(d.blocks)
            and all(a.pool.blocks[b].block_hash == h for b, h in zip(d.blocks, d.hashes))}


def test_due_stores_what_the_schedule_took_after_watching_it():
    pool, ids = _pool_with_a_finished_request(6)
    free_before = pool.get_num_free_blocks()          # 63: all but vLLM's null block
    a = Admission("evict", BS, CHUNK, reach_blocks=free_before - len(ids) + 2 * PER + 1)
    a.bind_pool(pool)
    keys = [[bytes([0xA0 + i]) * 8 for i in range(6)]]
    assert a.finished("r", keys, 0, 6, ids) == []
    assert len(a.deferred) == 6

    assert a.due(set()) == []                          # nothing was watched yet
    assert a.watch == _reference_watch(a) == {keys[0][0], keys[0][1], keys[0][2]}

    # this step's schedule takes the uncached blocks and chunk 0's and half of chunk 1's
    pool.get_new_blocks(free_before - len(ids) + PER + PER // 2)
    stored = a.due(set())
    assert sorted(d.index for d in stored) == [0, 1]   # watched, then taken: stored now
    assert a.stored_at_evict == 2 and a.dropped == 0
    assert a.watch == _reference_watch(a) == set(keys[0][2:])   # all near the head now
    assert len(a.deferred) == 4


def test_due_drops_a_chunk_whose_block_vllm_writes_before_the_forward():
    pool, ids = _pool_with_a_finished_request(3)
    free_before = pool.get_num_free_blocks()
    a = Admission("evict", BS, CHUNK, reach_blocks=BLOCKS)
    a.bind_pool(pool)
    a.finished("r", [[bytes([0xB0 + i]) * 8 for i in range(3)]], 0, 3, ids)
    a.due(set())
    assert a.watch == _reference_watch(a) and len(a.watch) == 3
    taken = pool.get_new_blocks(free_before - len(ids) + 2 * PER)   # chunks 0 and 1
    unsafe = {taken[-1].block_id}                      # vLLM zeroes chunk 1's last block
    assert [d.index for d in a.due(unsafe)] == [0]
    assert a.dropped == 1
    assert a.watch == _reference_watch(a) and len(a.watch) == 1


def test_due_watches_what_the_reference_watches_over_many_steps():
    """Random frees and allocations for 200 steps: after each, the watch set is the
    reference's and every chunk the schedule took while watched was stored or dropped."""
    import random

    rng = random.Random(7)
    pool, ids = _pool_with_a_finished_request(8)
    a = Admission("evict", BS, CHUNK, reach_blocks=10)
    a.bind_pool(pool)
    a.finished("r", [[bytes([0xC0 + i]) * 8 for i in range(8)]], 0, 8, ids)
    held, taken_while_watched, stored, unwatched_taken = [], set(), set(), set()
    for _ in range(200):
        watched = {a.deferred[k].index for k in a.watch}
        n = rng.randint(0, min(16, pool.get_num_free_blocks()))
        new = pool.get_new_blocks(n)
        got = {b.block_id for b in new}
        hit = {i for i in range(8) if got & set(ids[i * PER:(i + 1) * PER])}
        taken_while_watched |= hit & watched
        unwatched_taken |= hit - watched - stored
        held += new
        stored |= {d.index for d in a.due(set())}
        assert a.watch == _reference_watch(a)
        rng.shuffle(held)
        k = rng.randint(0, len(held))
        pool.free_blocks(held[:k])     # back at the tail, without their hashes
        held = held[k:]
    assert stored == taken_while_watched
    assert stored and unwatched_taken    # both cases happened

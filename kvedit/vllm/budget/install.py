"""The in-engine budgets' layers over vLLM's KV cache manager, block pool and scheduler, each
installed through kvedit.vllm.hooks (which lists them) and calling back into the
BudgetScheduler that owns the decisions (scheduler.py). A module of its own so the hooks'
plumbing is apart from what they decide."""
from __future__ import annotations

from kvedit.vllm import hooks


def install(budgets, manager, scheduler, pool, sig) -> None:
    """Shadow `manager`'s allocate_slots, free, pop_blocks_for_free and cache_blocks, the
    pool's get_new_blocks and the scheduler's schedule for `budgets` (`sig`: vLLM's
    allocate_slots signature, read before any hook)."""
    def allocate_slots(orig):
        def hook(request, num_new_tokens, *args, **kwargs):
            st = budgets.reqs.get(request.request_id)
            if st is None:
                return orig(request, num_new_tokens, *args, **kwargs)
            return budgets.allocate(st, sig.bind(request, num_new_tokens, *args, **kwargs),
                                    orig)
        return hook

    def free(orig):
        def hook(request):
            st = budgets.reqs.get(request.request_id)
            if st is not None and not request.is_finished():
                budgets.preempted(st, request)   # preemption: free before the status changes
            return orig(request)
        return hook

    def pop_blocks_for_free(orig):
        def hook(request):
            # deferred free (async scheduling with a consumer connector): vLLM returns
            # the blocks to the pool once the step in flight has run; a preemption
            # through here is still a preemption
            st = budgets.reqs.get(request.request_id)
            if st is not None and not request.is_finished():
                budgets.preempted(st, request)
            return orig(request)
        return hook

    def cache_blocks(orig):
        def hook(request, *args, **kwargs):
            st = budgets.reqs.get(request.request_id)
            if st is not None and st.compacted:
                return None  # its blocks hold compacted KV: never in the prefix cache
            return orig(request, *args, **kwargs)
        return hook

    def get_new_blocks(orig):
        def hook(num_blocks):
            blocks = orig(num_blocks)
            if budgets.freed:
                for b in blocks:
                    if b.block_id in budgets.freed:
                        budgets.freed.discard(b.block_id)
                        budgets.stats.blocks_reused += 1
            return blocks
        return hook

    def schedule(orig):
        def hook(*args, **kwargs):
            if budgets.reqs:
                budgets.rotate()
            return orig(*args, **kwargs)
        return hook

    hooks.shadow(manager, "allocate_slots", "KVCacheManager.allocate_slots", allocate_slots)
    hooks.shadow(manager, "free", "KVCacheManager.free", free)
    if hasattr(manager, "pop_blocks_for_free"):
        hooks.shadow(manager, "pop_blocks_for_free", "KVCacheManager.pop_blocks_for_free",
                     pop_blocks_for_free)
    if hasattr(manager, "cache_blocks"):
        hooks.shadow(manager, "cache_blocks", "KVCacheManager.cache_blocks", cache_blocks)
    hooks.shadow(pool, "get_new_blocks", "BlockPool.get_new_blocks", get_new_blocks)
    if hooks.can_preempt(scheduler):
        hooks.shadow(scheduler, "schedule", "Scheduler.schedule", schedule)

"""Scheduler side of in-engine budgets: when a request is compacted, which of its blocks it
keeps, and handing the rest back to vLLM's pool.

Runs in vLLM's engine-core process, through runtime hooks on the one KVCacheManager
(`bind`, through hooks.py): layers over its `allocate_slots`, `free` and `cache_blocks`, the
scheduler's `schedule`, and a watch on its block pool's `get_new_blocks`; no vLLM file is
changed.

A budgeted request keeps its logical progress: `num_computed_tokens`, its token lists and
block hashes count every token it ever computed. What changes is where its KV lives: after
compactions that dropped `offset` tokens, logical position p sits in slot p - offset of its
block list, and the list holds only cdiv(resident, block_size) blocks. So:
- `allocate_slots` sees the request with `num_computed_tokens - offset` for the length of one
  call, and allocates by resident length; compacted requests are never cached (their blocks
  hold KV that the logical block hashes do not describe).
- When the next tokens would take a decoding request past its budget, the compaction is
  decided here, right before its allocation (so the step never needs blocks it frees): the
  list is cut to cdiv(keep, block_size) blocks and the tail freed. A kept block another
  request holds too (shared through the prefix cache) is never written: a fresh block takes
  its place (copy on write) and the old one keeps its contents for whoever else reads it. A
  kept block only this request holds but that sits in vLLM's prefix cache (hashed, so a
  later request could hit it) is taken out of the prefix cache by vLLM's own eviction and
  written in place (`cached_kept_blocks` "uncache", the default), or copied like a shared
  one ("copy": later requests keep hitting it, at one more block per kept block). The
  workers move the data before the step's forward (`worker.py`); every read of the
  step precedes every write, so blocks freed here may be handed to another request in the
  same step.
- Under block pressure a budgeted request compacts up to one round early rather than vLLM
  preempting a stream: when a decoding request (its prompt computed, the step past any
  catch-up chunk) holds more than its budget's `keep` tokens and this step needs more new
  blocks than vLLM's pool has free (`get_num_free_blocks`, the count vLLM's own
  `allocate_slots` checks: free blocks and cached-but-unreferenced ones, not blocks waiting
  in `deferred_frees`), it is compacted to `keep` now, within its budget, if that makes its
  allocation fit (`early_compactions`). Without the shortage nothing changes; never below
  `keep`, never in a prefill or chunked-prefill step.
- Preemption frees the request's blocks (vLLM), and the request asks to be stashed: the
  workers copy its resident KV to host memory before the step reuses the blocks, and when
  vLLM resumes it the connector reports its computed tokens as loaded and the stash is
  written back into its new blocks (`Restore`), so it continues exactly where it stopped.
  Past the stash bound (`stash_bytes`) it is recomputed from its full token list instead.
- Requests that ask for what cannot apply are finished with an error when they arrive (the
  reason in the log), never scheduled; other requests are not affected.
"""
from __future__ import annotations

import inspect
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from kvedit.engine_budget import EngineBudget
from kvedit.request_params import RequestAsks
from kvedit.vllm import hooks
from kvedit.vllm.budget.install import install
from kvedit.vllm.budget.stats import BudgetStats
from kvedit.vllm.budget.plan import BudgetStep, Compaction, RankPrompt, Restore, Stash

logger = logging.getLogger("vllm.kvedit")

NOT_MINE = -1  # matched_tokens: the request's prefix is the connector's usual business


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Req:
    request: object
    budget: EngineBudget
    offset: int = 0           # logical computed tokens - resident tokens
    compacted: bool = False   # since its last (re)start: its blocks are never cached again
    stash: int = 0            # resident tokens held in the workers' stash (0: none)
    stash_logical: int = 0    # computed tokens the stash stands for
    restore: int = 0          # resuming from the stash in this schedule: its resident tokens
    started: int = 0          # computed tokens when it last started running (its turn's start)
    ranked: bool = True       # False: its policy ranks the prompt once it is computed (not yet)


@dataclass
class BudgetScheduler:
    """In-engine budgets on the scheduler side. `unavailable`: why budgets cannot apply in
    this engine (every budgeted request is refused with it), or None."""
    block_size: int
    token_bytes: int               # KV bytes of one token on one worker (stash accounting)
    stash_bytes: int
    unavailable: str | None = None
    no_queries: str | None = None  # why query-aware policies cannot run here, or None
    reqs: dict[str, _Req] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    stats: BudgetStats = field(default_factory=BudgetStats)
    step: BudgetStep = field(default_factory=BudgetStep)
    freed: set[int] = field(default_factory=set)  # block ids freed by compactions
    stash_left: int = 0
    turn_tokens: int = 128
    cached_kept_blocks: str = "uncache"   # or "copy" (ConnectorSettings.cached_kept_blocks)
    stats_every: float = 30.0
    _last_warn: float = -1e9
    _logged: float = -1e9
    _idle_log: bool = False

    def __post_init__(self):
        self.stash_left = self.stash_bytes
        self.manager = self.scheduler = self.stm = self.pool = None
        self._uncache: Callable | None = None  # vLLM's eviction of one block from its prefix cache

    # ---- binding to vLLM ----------------------------------------------------------------
    def bind(self, manager, scheduler) -> None:
        """Shadow the manager's methods this needs (once)."""
        if self.manager is not None:
            return
        try:
            managers = manager.coordinator.single_type_managers
            pool = manager.block_pool
            sig = inspect.signature(manager.allocate_slots)   # vLLM's, before the hooks
            _ = manager.free
        except AttributeError as e:
            raise RuntimeError(f"kvedit in-engine budgets: vLLM's KVCacheManager lacks {e}; "
                               "this vLLM's internals are not the ones the hooks know") from e
        if len(managers) != 1:
            raise RuntimeError("kvedit in-engine budgets: expected one KV cache group, got "
                               f"{len(managers)} (hybrid or sliding-window models)")
        self.manager, self.scheduler, self.stm, self.pool = manager, scheduler, managers[0], pool
        self.stats.pool_total = pool.num_gpu_blocks
        if self.cached_kept_blocks == "uncache":
            self._uncache = hooks.block_uncacher(pool)
            if self._uncache is None:
                logger.warning("kvedit: vLLM's block pool has no eviction of a cached block "
                               "(evict_blocks, _maybe_evict_cached_block); cached kept blocks "
                               "are copied on write")

        install(self, manager, scheduler, pool, sig)

    # ---- requests -------------------------------------------------------------------------
    def add(self, request, asks: RequestAsks) -> None:
        """A new request: remember its budget, or refuse it (finished with an error)."""
        if asks.budget_error:
            return self._refuse(request, asks.budget_error)
        budget = asks.budget
        if budget is None:
            return
        if self.unavailable:
            return self._refuse(request, self.unavailable)
        if getattr(request, "sampling_params", None) is None:
            return self._refuse(request, "it is not a generation request")
        if budget.queries:
            if self.no_queries:
                return self._refuse(request, f"its policy scores with queries and "
                                             f"{self.no_queries}")
            # every token of the window must be computed for its query to exist
            hooks.skip_prefix_cache(request, True)
            self.step.capture.append((request.request_id, budget.queries))
        self.reqs[request.request_id] = _Req(request, budget,
                                             ranked=not budget.ranks_prompt)
        self.stats.requests += 1

    def is_budgeted(self, req_id: str) -> bool:
        return req_id in self.reqs

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """The connector's answer for a request about to be scheduled: None (never schedule:
        refused), NOT_MINE, or the tokens a stash restores (a preempted request resuming)."""
        req_id = request.request_id
        if req_id in self.refused:
            return None
        st = self.reqs.get(req_id)
        if st is None or not st.stash:
            return NOT_MINE
        # At least one token is left to compute (vLLM needs logits), and a deeper local
        # prefix hit than the stash is better recomputed from the cache.
        if st.stash_logical > request.num_tokens - 1 or num_computed_tokens > st.stash_logical:
            self._drop_stash(st, recompute=True)
            return NOT_MINE
        st.restore = st.stash
        return st.stash_logical - num_computed_tokens

    def after_alloc(self, request, blocks) -> bool:
        """The request's blocks are allocated; True when it resumes from the stash."""
        st = self.reqs.get(request.request_id)
        if st is None or not st.restore:
            return False
        ids = list(blocks.get_block_ids()[0])
        st.offset = st.stash_logical - st.restore
        st.started = st.stash_logical
        self.step.restores.append(Restore(request.request_id, ids, st.offset))
        self.stash_left += st.stash * self.token_bytes
        st.compacted, st.stash, st.restore = True, 0, 0
        self.stats.restores += 1
        return True

    def finished(self, req_id: str) -> None:
        self.refused.discard(req_id)
        st = self.reqs.pop(req_id, None)
        if st is None:
            return
        if st.stash:
            self.stash_left += st.stash * self.token_bytes
        if st.compacted or st.stash or st.budget.queries:
            self.step.forget.append(req_id)
        self._idle_log = not self.reqs

    def build(self) -> BudgetStep | None:
        """This step's plan for the workers (None when there is nothing to do). Logs the
        stats once the last budgeted request has gone (its blocks freed by then), and every
        `stats_every` seconds while compactions happen."""
        step, self.step = self.step, BudgetStep()
        now = time.monotonic()
        if (self._idle_log and not self.reqs) or \
                (step.compactions and now - self._logged >= self.stats_every):
            self._idle_log, self._logged = False, now
            self.log_stats()
        return step or None

    def log_stats(self) -> None:
        if self.pool is not None:
            self.stats.pool_free = self.pool.get_num_free_blocks()
        logger.info("kvedit: in-engine stats %s", json.dumps(asdict(self.stats)))

    # ---- internals ------------------------------------------------------------------------
    def allocate(self, st: _Req, bound, orig):
        args = bound.arguments
        request = args["request"]
        if st.restore:
            # Resume from the stash: the stash's tokens count as loaded from outside (none
            # from the prefix cache, whose blocks the request must not write), and the list
            # is sized by resident length.
            args["num_new_computed_tokens"] = 0
            args["new_computed_blocks"] = None
            args["num_external_computed_tokens"] = st.restore
            args["delay_cache_blocks"] = True
            if "full_sequence_must_fit" in args:  # it needs its resident tokens, not them all
                args["full_sequence_must_fit"] = False
            out = bound.call(orig)
            if out is None:
                st.restore = 0  # not this step; the stash waits
            return out
        t0 = time.perf_counter()
        self._maybe_compact(st, request, args["num_new_tokens"],
                            args.get("num_lookahead_tokens", 0),
                            args.get("reserved_blocks", 0))
        self.stats.decide_s += time.perf_counter() - t0
        if not st.compacted:
            return bound.call(orig)
        args["delay_cache_blocks"] = True
        logical = request.num_computed_tokens
        request.num_computed_tokens = logical - st.offset  # allocate by resident length
        try:
            return bound.call(orig)
        finally:
            request.num_computed_tokens = logical

    def _maybe_compact(self, st: _Req, request, num_new: int, lookahead: int = 0,
                       reserved: int = 0) -> None:
        computed = request.num_computed_tokens
        if st.budget.queries and computed >= request.num_prompt_tokens:
            self._prompt_computed(st, request)
        # Only once the prompt is computed, and on a step that reaches the last token
        # (a chunked prefill, or a recompute after preemption, first catches up).
        if computed < request.num_prompt_tokens or computed + num_new < request.num_tokens:
            return
        resident = computed - st.offset
        keep = st.budget.keep
        if keep >= resident:
            return
        if resident + num_new > st.budget.tokens:
            self._compact(st, request.request_id, resident, keep)
        elif computed >= request.num_tokens - 1:  # a decode step, not a recompute's last chunk
            self._compact_early(st, request.request_id, resident, keep, num_new + lookahead,
                                reserved)

    def _prompt_computed(self, st: _Req, request) -> None:
        """A query-aware request's prompt is computed, and with it the window's queries."""
        if not st.ranked:
            # the prompt's KV and its last rows' queries exist (the step that computed them
            # ran before this one on every worker): rank it before anything is dropped
            st.ranked = True
            self.step.rank_prompt.append(RankPrompt(
                request.request_id, request.num_prompt_tokens, request.num_computed_tokens,
                st.budget))
        if request.skip_reading_prefix_cache:
            # It read no cache so that its window was computed; now that it was, a resume
            # after a preemption must load its stash: vLLM >= 0.31 drops the connector's
            # tokens for a request that skips the cache (it would recompute its whole
            # logical length instead, in as many blocks).
            hooks.skip_prefix_cache(request, False)

    def _compact_early(self, st: _Req, req_id: str, resident: int, keep: int, new: int,
                       reserved: int) -> None:
        """Within its budget, but this step's new blocks are not free: compacting now (to
        `keep`, as the budget's next compaction would) instead of vLLM preempting a stream,
        when that makes the allocation fit. vLLM checks its allocation against the same
        count (`get_num_free_blocks`, cached-but-unreferenced blocks included)."""
        blocks = self.stm.req_to_blocks[req_id]
        bs = self.block_size
        if cdiv(resident + new, bs) - len(blocks) <= self.pool.get_num_free_blocks() - reserved:
            return  # it fits as it is: nothing changes
        plan = self._release_plan(blocks, keep)
        need = max(0, cdiv(keep + new, bs) - cdiv(keep, bs)) + len(plan.cow)
        if need > plan.room - reserved:
            return  # compacting would not save a preemption
        if self._compact(st, req_id, resident, keep):
            self.stats.early_compactions += 1

    def _compact(self, st: _Req, req_id: str, resident: int, keep: int) -> bool:
        blocks = self.stm.req_to_blocks[req_id]
        n_keep = cdiv(keep, self.block_size)
        plan = self._release_plan(blocks, keep)
        cow, release = plan.cow, plan.release
        deferred = self._defers_frees()
        if len(cow) > plan.room:
            self.stats.no_room += 1
            return False  # no block to copy into: this step allocates as usual (vLLM may preempt)
        for b in plan.uncache:
            # Only this request holds it, so only a later lookup could read it: with its
            # hashes gone none can. Lookups of this step come after this point: vLLM's
            # schedule() allocates its running requests (this one) before its waiting ones
            # look up the prefix cache, and a request that hit the block in an earlier step
            # holds it (ref_cnt > 1: copied, never written). The block's frees are this
            # request's own, deferred or not, and it is never cached again (compacted).
            self._uncache(b)
        old = [b.block_id for b in blocks[:cdiv(resident, self.block_size)]]
        before = len(blocks)
        if deferred:
            # the step in flight may still write these blocks: they go back to the pool
            # with vLLM's own fence, once that step's output is processed (tail first)
            hooks.defer_free(self.scheduler, release)
            self.freed.update(b.block_id for b in release if b.ref_cnt == 1)
        else:
            self.pool.free_blocks(reversed(release))  # tail first: evicted first
            self.freed.update(b.block_id for b in release if b.ref_cnt == 0)
        kept = blocks[:n_keep]
        for i, b in zip(cow, self.pool.get_new_blocks(len(cow)) if cow else ()):
            kept[i] = b
        blocks[:] = kept
        if req_id in self.stm.num_cached_block:
            self.stm.num_cached_block[req_id] = len(kept)
        st.offset += resident - keep
        st.compacted = True
        self.step.compactions.append(Compaction(req_id, st.budget, resident, keep, old,
                                                [b.block_id for b in kept], st.offset))
        s = self.stats
        s.compactions += 1
        s.tokens_dropped += resident - keep
        s.blocks_released += before - len(kept)
        s.cow_blocks += len(cow)
        s.uncached_blocks += len(plan.uncache)
        return True

    def _release_plan(self, blocks: list, keep: int) -> _ReleasePlan:
        """Compacting `blocks` to `keep` tokens: which kept blocks are copied on write or
        taken out of the prefix cache, which blocks are released, and the room for copies."""
        n_keep = cdiv(keep, self.block_size)
        cow, uncache = [], []
        for i in range(n_keep):
            b = blocks[i]
            if b.is_null or b.ref_cnt != 1 or \
                    (b.block_hash is not None and self._uncache is None):
                cow.append(i)
            elif b.block_hash is not None:
                uncache.append(b)
        release = [blocks[i] for i in cow] + blocks[n_keep:]
        room = self.pool.get_num_free_blocks()
        if not self._defers_frees():  # deferred: the freed blocks reach the pool after it
            room += sum(b.ref_cnt == 1 for b in release)
        return _ReleasePlan(cow, uncache, release, room)

    def _defers_frees(self) -> bool:
        """Whether vLLM returns freed blocks to the pool only once the step in flight has
        run (async scheduling with a consumer connector: `defer_block_free`)."""
        sched = self.scheduler
        return bool(getattr(sched, "defer_block_free", False)) and hooks.can_defer_free(sched)

    def preempted(self, st: _Req, request) -> None:
        """vLLM preempts a budgeted request: stash its resident KV (a prompt still being
        computed is recomputed instead). A request at its budget is compacted into the
        stash, so that it resumes in the blocks of its kept tokens and the next one."""
        req_id, computed = request.request_id, request.num_computed_tokens
        resident = computed - st.offset
        if computed < request.num_prompt_tokens or resident <= 0:
            self._drop_stash(st, recompute=False)
            st.compacted = False
            return
        keep = resident
        if resident + 1 > st.budget.tokens and st.budget.keep < resident:
            keep = st.budget.keep
        if keep * self.token_bytes > self.stash_left:
            self._drop_stash(st, recompute=True)
            st.compacted = False
            return
        if keep < resident:
            old = [b.block_id for b in self.stm.req_to_blocks[req_id]
                   [:cdiv(resident, self.block_size)]]
            st.offset += resident - keep
            self.step.compactions.append(Compaction(req_id, st.budget, resident, keep, old,
                                                    [], st.offset))
            self.stats.compactions += 1
            self.stats.tokens_dropped += resident - keep
        self.stash_left -= keep * self.token_bytes
        st.stash, st.stash_logical = keep, computed
        self.step.stashes.append(Stash(req_id, keep))
        self.stats.stashes += 1
        st.compacted = False  # its blocks are gone; a resume starts a new list

    def rotate(self) -> None:
        """Time slicing between budgeted requests when they do not all fit, by equal service:
        when the next request vLLM would resume is a stashed budgeted one that does not fit in
        the free blocks, the running budgeted request that has generated the most tokens
        yields to it, if it has run `turn_tokens` since it last started and has generated at
        least `turn_tokens` more than the waiting one: it is preempted (and stashed) and
        queued behind it. So streams of equal length advance together and finish within a
        turn of each other (a stream left far behind would end the run decoding alone), and
        a short request is not held behind long ones.
        Without this, FCFS would leave a preempted request waiting until others finish."""
        sched = self.scheduler
        waiting = sched.waiting
        if not waiting:
            return
        head = waiting.peek_request()
        st = self.reqs.get(head.request_id)
        if st is None or not st.stash:
            return
        free = self.pool.get_num_free_blocks() - getattr(self.manager, "watermark_blocks", 0)
        need = cdiv(st.stash + 1, self.block_size)
        if free >= need:
            return
        q, behind = self.turn_tokens, _served(head)
        best, most = None, -1
        for r in sched.running:
            v = self.reqs.get(r.request_id)
            if v is None or r.num_computed_tokens < r.num_prompt_tokens:
                continue
            served = _served(r)
            if r.num_computed_tokens - v.started >= q and served - behind >= q \
                    and served > most:
                best, most = r, served
        if best is None or free + len(self.stm.req_to_blocks[best.request_id]) < need:
            return
        hooks.yield_turn(sched, best, time.monotonic())  # behind the one it yields to
        self.stats.rotations += 1

    def _drop_stash(self, st: _Req, recompute: bool) -> None:
        if st.stash:
            self.stash_left += st.stash * self.token_bytes
        st.stash = st.stash_logical = st.restore = st.started = 0
        st.offset, st.compacted = 0, False
        req_id = st.request.request_id
        self.step.forget.append(req_id)
        if st.budget.queries:
            # recomputed from its tokens: its query ring (and a prompt ranking) start again,
            # from a window computed again
            self.step.capture.append((req_id, st.budget.queries))
            st.ranked = not st.budget.ranks_prompt
            hooks.skip_prefix_cache(st.request, True)
        if recompute:
            self.stats.recomputes += 1

    def _refuse(self, request, why: str) -> None:
        req_id = request.request_id
        self.stats.refused += 1
        # vLLM finishes the requests in this set with an error at its next update (and sends
        # the client the error); meanwhile matched_tokens keeps it from being scheduled.
        errors = getattr(self.scheduler, "grammar_compile_error_reqs", None)
        if isinstance(errors, set):
            errors.add(req_id)
            self.refused.add(req_id)
            outcome = "finished with an error"
        else:
            outcome = "it runs without a budget: this vLLM has no way to fail it"
        now = time.monotonic()
        if now - self._last_warn > 10.0 or self.stats.refused <= 10:
            self._last_warn = now
            logger.warning("kvedit: request %s refused (%s): it asks for an in-engine budget, "
                           "but %s", req_id, outcome, why)


@dataclass(slots=True)
class _ReleasePlan:
    """A compaction's blocks: `cow` indices of kept blocks copied on write (another request
    holds them, or cached with cached_kept_blocks "copy"), `uncache` kept blocks taken out of
    the prefix cache and written in place, `release` the blocks the request lets go, `room`
    vLLM's free blocks once they are (its free count plus the released blocks only this
    request held, unless frees wait past this step)."""
    cow: list[int]
    uncache: list
    release: list
    room: int


def _served(request) -> int:
    """Tokens a request has generated (its service, for time slicing)."""
    return len(request.output_token_ids)

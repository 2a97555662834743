"""Scheduler-side connector logic: what the server holds, what to load, what to store.

Runs in vLLM's engine-core process. It asks the server how many leading chunks of a new
request it holds (beyond vLLM's own prefix-cache hit) and pins what it reports until the load
has run (transfer/pins.py); a copy of the server's keys (kvedit.client.key_watch) answers misses
without asking, and turns a hit's lookup and pin into one round trip. Each step tells the
workers which chunks to load before the forward and which chunks to store after it: which
and when is the store mode's (transfer/admission.py). Query capture and in-engine budgets
have scheduler sides of their own (capture/, budget/), which this one calls; so do the KV
events that tell routers what the server holds (tier_events.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import vllm

from kvedit.client.key_watch import KeyWatch
from kvedit.keys import chunk_keys, namespace
from kvedit.layout import ModelLayout
from kvedit.query_contract import QueryShape
from kvedit.request_params import read_asks
from kvedit.vllm.budget.scheduler import NOT_MINE, BudgetScheduler
from kvedit.vllm.capture.scheduler import WindowPlanner
from kvedit.vllm.capture.support import capture_unavailable
from kvedit.vllm import hooks
from kvedit.vllm.link import ServerLink
from kvedit.vllm.metadata import KVEditMetadata
from kvedit.vllm.scheduler_stats import SchedulerStats
from kvedit.vllm.settings import ConnectorSettings, check_chunk_size, model_layout
from kvedit.vllm.tier_events import PLAIN, for_engine
from kvedit.vllm.transfer.admission import Admission, Deferred
from kvedit.vllm.transfer.inflight import InFlightKeys
from kvedit.vllm.transfer.pins import Pins
from kvedit.vllm.transfer.plan import ChunkRun

logger = logging.getLogger("vllm.kvedit")


@dataclass(slots=True)
class _Req:
    request: object                      # vllm Request (tokens, salt, prompt length)
    block_ids: list[int] = field(default_factory=list)
    keys: list[list[bytes]] = field(default_factory=list)  # per rank, prefix of the chain
    stored: int = 0                      # chunks [0, stored) already handed to a store
    held: int = 0                        # tokens [0, held) computed by vLLM or in the server
    load: tuple[int, int] | None = None  # token range to load on its first scheduled step
    waiting_since: float | None = None   # first lookup answered "not yet" (in-flight store)
    done: int = 0                        # tokens whose KV is computed once planned steps ran
    sighted: int = 0                     # chunks counted as seen (store mode "reuse")
    eager: bool = False                  # it asked for every chunk stored (request_params)
    taint: int = PLAIN                   # first chunk resting on foreign KV (tier_events.py)
    # the last pinned hit: (chunk its local hit ends in, request tokens, end) (_asked_again)
    answer: tuple[int, int, int] | None = None


class SchedulerSide:
    def __init__(self, vllm_config, settings: ConnectorSettings, block_size: int):
        self.settings = settings
        self.vllm_config = vllm_config
        self.block_size = block_size
        name = vllm_config.model_config.served_model_name
        self.model = name[0] if isinstance(name, (list, tuple)) else name
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.layouts: list[ModelLayout] | None = None
        self.admission = Admission(settings.transfer.store, block_size, settings.chunk_size or 0)
        self.pins = Pins(settings.transfer.pin_max_chunks, settings.transfer.pin_ttl_s)
        self.steps = 0                    # metadata built so far (the next one's index)
        self.stats = SchedulerStats(every=settings.stats_interval_s)
        self.to_store: list[Deferred] = []  # remembered chunks to store in the next step
        if settings.chunk_size:
            self._set_chunk_size(settings.chunk_size)
        self.reqs: dict[str, _Req] = {}
        self.queries = self._window_planner(vllm_config, settings, block_size)
        self.budgets = _budget_scheduler(vllm_config, settings, block_size)
        # Workers that commit stores in the background: wait for keys still in flight.
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        self.inflight: InFlightKeys | None = None
        transfer = settings.transfer
        if transfer.background_commit(device == "cuda") and transfer.store_wait_s > 0:
            self.inflight = InFlightKeys(transfer.store_wait_s)
        self.watch: KeyWatch | None = None   # the server's keys, copied (key_watch.py)
        self.server_l2 = False   # the server has an L2 tier (server_info.l2): see _held
        self.watch_answers = False           # ... and lookups may use it (key_watch)
        self.events = for_engine(vllm_config, settings.transfer.kv_events, block_size)
        self.link = ServerLink(settings.kvedit_url, settings.timeout, settings.retry_interval,
                               self._on_connect, "scheduler", secret=settings.secret())

    # ---- server connection ------------------------------------------------------------
    def _set_chunk_size(self, chunk_size: int) -> None:
        check_chunk_size(chunk_size, self.block_size)
        self.layouts = [model_layout(self.vllm_config, chunk_size, r, self.settings.rope_is_neox)
                        for r in range(self.tp_size)]
        self.admission.chunk = chunk_size

    def _on_connect(self, client) -> None:
        info = client.server_info()
        if self.layouts is None:  # chunk size not configured: the server's
            self._set_chunk_size(info.chunk_size)
        # a pin ends before its lease does
        self.pins.ttl_s = min(self.settings.transfer.pin_ttl_s, info.lease_ttl / 4)
        # a fresh copy for every connection (a restarted server): misses answered here
        # (over an L2 tier only for chunks the copy holds: _held), and the KV events' source
        # of truth
        self.server_l2 = info.l2
        answers = self.settings.transfer.key_watch
        watch = (client.watch_keys(self.model, list(range(self.tp_size)), listener=self.events)
                 if answers or self.events is not None else None)
        if self.events is not None:   # before the scheduler thread can sync the new watch
            self.events.attach(watch)
        self.watch, self.watch_answers = watch, answers

    def bind_pool(self, pool) -> None:
        """vLLM's block pool (vLLM >= 0.32 binds it): store mode "evict" watches it, and the
        KV events see vLLM's prefix-cache resets in it."""
        self.admission.bind_pool(pool)
        if self.events is not None:
            self.events.bind_pool(pool)

    def _window_planner(self, vllm_config, settings, block_size: int) -> WindowPlanner:
        import vllm

        # every rank's object has the same shape: one window row on one rank
        row_bytes = QueryShape.of(model_layout(vllm_config, block_size, 0), 1).row_bytes
        return WindowPlanner(self.model, block_size, row_bytes, settings.capture.max_capture_bytes,
                             capture_unavailable(settings.capture.query_capture, vllm.__version__,
                                                 vllm_config))

    @property
    def chunk(self) -> int:
        return self.layouts[0].chunk_size

    def _keys(self, st: _Req, n_chunks: int) -> list[list[bytes]]:
        """Keys of chunks [0, n_chunks) for every rank (extended as tokens arrive)."""
        if not st.keys or len(st.keys[0]) < n_chunks:
            tokens = st.request.all_token_ids   # only the chunks not keyed yet are read
            salt = st.request.cache_salt or ""
            st.keys = [chunk_keys(tokens, self.chunk, namespace(self.model, lay, salt),
                                  max_chunks=n_chunks, known=st.keys[r] if st.keys else ())
                       for r, lay in enumerate(self.layouts)]
        return [k[:n_chunks] for k in st.keys]

    # ---- vLLM hooks ---------------------------------------------------------------------
    def bind(self, manager, scheduler) -> None:
        """vLLM's KVCacheManager and Scheduler (found when vLLM binds its block pool)."""
        self.budgets.scheduler = scheduler
        if self.events is not None:   # vLLM may hash at a finer grain than its blocks
            self.events.hash_scale = self.block_size // (getattr(scheduler, "hash_block_size",
                                                                 None) or self.block_size)
        if getattr(scheduler, "defer_block_free", False) and \
                not self.settings.transfer.defer_frees:
            # Before any step (vLLM binds from its constructor): kvedit's loads scatter on
            # the forward's stream, after the step in flight, so freed blocks need no fence
            # (settings.TransferSettings.defer_frees says what the fence costs).
            hooks.write(scheduler, "Scheduler.defer_block_free", False)
            logger.info("kvedit: vLLM's deferred block frees are off (kvedit's loads are "
                        "ordered on the forward's stream; defer_frees true keeps them)")
        if self.settings.budgets.in_engine:
            self.budgets.bind(manager, scheduler)

    def on_new_request(self, request) -> None:
        self._arrived(request)

    def _arrived(self, request) -> _Req:
        """A new request: what its kv_transfer_params ask, read once (kvedit.request_params)."""
        asks = read_asks(getattr(request, "kv_transfer_params", None))
        st = self.reqs[request.request_id] = _Req(request, eager=asks.store_eager)
        self.budgets.add(request, asks)
        self.queries.add(request, asks)
        return st

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` the server holds, or None ("ask again next
        step") while the server's run of chunks stops at one whose store is in flight."""
        with self.stats.timed("lookup_s"):
            return self._matched_tokens(request, num_computed_tokens)

    def _matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        st = self.reqs.get(request.request_id)
        if st is None:   # a vLLM without on_new_request: read its asks now
            st = self._arrived(request)
        st.held, st.load = num_computed_tokens, None
        restored = self.budgets.matched_tokens(request, num_computed_tokens)
        if restored != NOT_MINE:  # refused (None), or a stash written back on resume
            return restored
        client = self.link.client
        again = self._asked_again(st, request, num_computed_tokens) if client else None
        if again is not None:
            return again
        st.answer = None
        self.pins.release(client, request.request_id)  # asked again: not scheduled last time
        if client is None or self.layouts is None:
            return 0
        n_full = request.num_tokens // self.chunk
        if self.admission.mode == "reuse" and st.sighted < n_full:
            self.admission.sighted(self._keys(st, n_full)[0][st.sighted:])
            st.sighted = n_full
        window = self.queries.window_start(request.request_id)
        if window is not None:  # capturing: its window tokens must be computed (capture/)
            n_full = min(n_full, window // self.chunk)
        first = num_computed_tokens // self.chunk  # vLLM already holds chunks before this
        if n_full <= first or (window is None
                               and getattr(request, "skip_reading_prefix_cache", False)):
            # a request that reads no cache and captures no window (a query-aware budget)
            # computes its whole prompt: vLLM >= 0.31 drops external hits for it, 0.26-0.30
            # would load them; a capturing request loads up to its window (capture/scheduler.py)
            return 0
        keys = self._keys(st, n_full)
        held, pinned = self._held(client, request.request_id, keys, first)
        if held is None:
            return 0
        if self._store_in_flight(st, keys, first, first + held):
            return None
        if held and not pinned:   # pinned: the load finds them (None: a hit reported unpinned)
            with self.stats.timed("server_s"):
                pinned = self.pins.pin(client, self.model, request.request_id,
                                       [k[first:] for k in keys], held)
            held = held if pinned is None else pinned
        # Leave vLLM at least one token to compute (it needs logits for the last one).
        end = min((first + held) * self.chunk, request.num_tokens - 1)
        st.held = max(end, num_computed_tokens)
        answer = max(0, end - num_computed_tokens)
        if end <= num_computed_tokens:
            self.pins.release(client, request.request_id)
        elif window is not None:
            self.queries.lift(request)
        elif request.request_id in self.pins.held:
            st.answer = (first, request.num_tokens, end)
        return answer

    def _asked_again(self, st: _Req, request, num_computed_tokens: int) -> int | None:
        """The last answer again, or None. vLLM asks about every waiting request at every
        step it tries to schedule it: under KV pressure that is every waiting request every
        step, and a hit's release and new pin were two server round trips each time (on an
        H100 host, ~1 ms a step at a pool of 40%). While the pin still holds what that answer
        counted (not loaded, not expired: the server evicts no leased chunk) and the request
        is where it was, the answer stands: the same tokens, and vLLM's own hit ending in the
        same chunk. Not the same token: under pressure vLLM's prefix cache hands a waiting
        request's cached blocks to others one at a time (16 tokens on a GPU), so its local hit
        moves within a chunk at most steps; the pinned chunks cover any point of the chunk
        they start at, and the answer is their end less the new local hit."""
        last = st.answer
        if last is None or last[:2] != (num_computed_tokens // self.chunk, request.num_tokens) \
                or last[2] <= num_computed_tokens:
            return None
        pin = self.pins.held.get(request.request_id)
        if pin is None or pin.load_step is not None:
            st.answer = None
            return None
        st.held = last[2]
        self.stats.asked_again += 1
        return last[2] - num_computed_tokens

    def _held(self, client, req_id: str, keys: list[list[bytes]],
              first: int) -> tuple[int | None, bool]:
        """How many chunks from `first` every rank's server holds (None: the server failed),
        and whether they are pinned already. With a copy of the server's keys (key_watch.py)
        a first chunk it lacks is a miss without a round trip, and one it holds is pinned at
        once: the pin counts what is there, one round trip where a lookup and a pin took two.
        Over a server with an L2 the copy covers its memory only: a chunk it lacks may be in
        L2, where only a lookup finds it, so the copy answers (by a pin) only requests it
        holds whole."""
        watch = self.watch
        if watch is not None and self.watch_answers and watch.client is client:
            watch.sync()
            if not self.server_l2 and watch.lacks(keys, first):
                self.stats.local_misses += 1
                return 0, False
            if watch.trusted and (not self.server_l2 or watch.holds_all(keys, first)):
                with self.stats.timed("server_s"):
                    n = self.pins.pin(client, self.model, req_id, [k[first:] for k in keys],
                                      len(keys[0]) - first, looked_up=False)
                if n is not None:   # else: pins off, at their bound or refused: look up
                    self.stats.lookups += 1
                    return n, True
        return self._lookup(client, keys, first), False

    def _lookup(self, client, keys: list[list[bytes]], first: int) -> int | None:
        """How many chunks from `first` every rank's server holds; None if it failed."""
        self.stats.lookups += 1
        try:
            with self.stats.timed("server_s"):
                return min(client.lookup(self.model, k[first:], tp_rank=r)
                           for r, k in enumerate(keys))
        except Exception as e:  # an unreachable server is a miss, never an error
            self.link.failed(e)
            return None

    def _store_in_flight(self, st: _Req, keys: list[list[bytes]], first: int, stop: int) -> bool:
        """Whether chunk `stop` (the first one the server lacks) is still being stored."""
        if self.inflight is None:
            return False
        for k in keys:
            self.inflight.discard(k[first:stop])  # the server holds these
        if stop < len(keys[0]) and any(self.inflight.pending(k[stop]) for k in keys):
            self.inflight.stats.deferred += 1
            if st.waiting_since is None:
                st.waiting_since = time.monotonic()
            return True
        if st.waiting_since is not None:
            waited, st.waiting_since = time.monotonic() - st.waiting_since, None
            # still short: the deadline passed (a slow or failed store): say so, it costs a
            # recompute; otherwise the wait did its job
            log = logger.info if stop < len(keys[0]) else logger.debug
            log("kvedit: %s waited %.1f ms for in-flight stores; %d of %d chunks in the server",
                st.request.request_id, 1e3 * waited, stop, len(keys[0]))
        return False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        with self.stats.timed("alloc_s"):
            self._after_alloc(request, blocks, num_external_tokens)

    def _after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.budgets.after_alloc(request, blocks):
            return  # the stash is written back, nothing comes from the server
        st = self.reqs.get(request.request_id)
        if num_external_tokens <= 0:
            self.pins.release(self.link.client, request.request_id)  # nothing to load
        if st is None or num_external_tokens <= 0:
            return
        st.load = (st.held - num_external_tokens, st.held)

    def build_meta(self, out) -> KVEditMetadata:
        try:
            with self.stats.timed("meta_s"):
                return self._build_meta(out)
        finally:
            self.stats.steps += 1
            self.stats.maybe_log()

    def _build_meta(self, out) -> KVEditMetadata:
        meta = KVEditMetadata()
        meta.budgets = self.budgets.build()
        self.queries.relock()
        meta.query_drops = self.queries.take_drops()
        step, self.steps = self.steps, self.steps + 1
        if self.layouts is None:
            return meta
        self.pins.expire(self.link.client)
        if self.watch is not None:
            self.watch.sync()   # each step: its queue stays short, its renewals go out
        # remembered chunks pushed out of the table: before the forward, as their blocks
        # may be taken by this step's schedule
        self._store_deferred(self.to_store, meta.pre_stores)
        self.to_store = []
        with self.stats.timed("watch_s"):
            due = self.admission.due(_written_before_forward(out))
        self.stats.take_s += self.admission.take_s
        self.admission.take_s = 0.0
        self._store_deferred(due, meta.pre_stores)
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan(st, new.req_id, new.num_computed_tokens,
                           out.num_scheduled_tokens[new.req_id], meta, step)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # back from preemption: fresh block list
                st.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                st.block_ids.extend(new_blocks[0])
            self._plan(st, req_id, cached.num_computed_tokens[i],
                       out.num_scheduled_tokens[req_id], meta, step)
        return meta

    def _plan(self, st: _Req, req_id: str, computed: int, scheduled: int,
              meta: KVEditMetadata, step: int) -> None:
        c = self.chunk
        if st.load is not None:
            start, end = st.load
            st.load = None
            first, last = start // c, -(-end // c)
            keys = [k[first:last] for k in self._keys(st, last)]
            meta.loads.append(ChunkRun(req_id, first, keys, start, end, list(st.block_ids)))
            self.pins.loading(req_id, step)
            if self.events is not None:
                st.taint = self.events.request_chunks(st.request, first, last,
                                                      self._keys(st, last), c, False, st.taint)
            if st.stored >= first:  # the loaded whole chunks are in the server: never store
                st.stored = max(st.stored, end // c)  # them again (a failed load resets it)
        # Chunks whose every token has KV in vLLM's blocks once this step has run, and
        # whose token ids are known (generated tokens can lag under async scheduling).
        run = self.queries.plan(req_id, st.block_ids, computed, scheduled, self.layouts)
        if run is not None:
            meta.queries.append(run)
        req = st.request
        done = min(computed + scheduled, len(req.all_token_ids))
        # A budgeted request's blocks are compacted once it decodes: store its prompt only.
        if not self.settings.transfer.store_generated or self.budgets.is_budgeted(req_id):
            done = min(done, req.num_prompt_tokens)
        st.done = max(st.done, done)
        n_full = done // c
        if n_full <= st.stored:
            return
        keys = self._keys(st, n_full)
        if self.admission.mode == "reuse" and st.sighted < n_full:
            self.admission.sighted(keys[0][st.sighted:n_full])
            st.sighted = n_full
        upto = n_full if st.eager else self.admission.storable(keys[0], st.stored, n_full)
        if upto > st.stored:
            self._store(meta, ChunkRun(req_id, st.stored, [k[st.stored:upto] for k in keys],
                                       st.stored * c, upto * c, list(st.block_ids)))
            if self.events is not None:
                self.events.request_chunks(req, st.stored, upto, keys, c, True, st.taint)
            st.stored = upto

    def _store(self, meta: KVEditMetadata, run: ChunkRun) -> None:
        meta.stores.append(run)
        if self.inflight is not None:
            for k in run.keys:
                self.inflight.add(k)

    def _store_deferred(self, chunks: list[Deferred], runs: list[ChunkRun]) -> None:
        """Store remembered chunks of finished requests (store mode "evict") in `runs` (the
        step's stores, after its forward, or pre_stores, before it)."""
        c = self.chunk
        for d in chunks:
            run = ChunkRun(d.req_id, d.index, [[k] for k in d.keys], d.index * c,
                           (d.index + 1) * c, d.block_ids)
            runs.append(run)
            if self.inflight is not None:
                for k in run.keys:
                    self.inflight.add(k)

    def invalid_blocks(self, block_ids: set[int]) -> None:
        """vLLM will recompute from the first block that failed to load: store it again then."""
        for st in self.reqs.values():
            for i, b in enumerate(st.block_ids):
                if b in block_ids:
                    bad = i * self.block_size // self.chunk
                    if self.inflight is not None:  # the worker skips storing those chunks
                        for k in st.keys:
                            self.inflight.discard(k[bad:])
                    st.stored = min(st.stored, bad)
                    break

    def step_done(self) -> None:
        """A step's output came back (vLLM calls update_connector_output in step order)."""
        self.pins.step_done(self.link.client)

    def request_finished(self, request) -> None:
        with self.stats.timed("finished_s"):
            self._finished(request)

    def _finished(self, request) -> None:
        st = self.reqs.pop(request.request_id, None)
        self.queries.finished(request.request_id)
        self.pins.release(self.link.client, request.request_id)
        if st is not None and self.layouts is not None and not st.eager:
            full = st.done // self.chunk
            if full > st.stored:
                keys = self._keys(st, full)
                self.to_store += self.admission.finished(
                    request.request_id, keys, st.stored, full, list(st.block_ids))
                if self.events is not None and self.admission.defers:  # stored when evicted
                    self.events.request_chunks(request, st.stored, full, keys, self.chunk,
                                               True, st.taint)
        self.budgets.finished(request.request_id)

    def take_events(self) -> list:
        """KV events since the last call (vLLM publishes them after each step)."""
        if self.events is None:
            return []
        with self.stats.timed("events_s"):
            if self.watch is not None:
                self.watch.sync()
            return self.events.take(self.link.client is not None)

    def close(self) -> None:
        self.pins.release_all(self.link.client)
        self.link.close()


def _written_before_forward(out) -> set[int]:
    """Blocks vLLM writes before this step's forward: zeroed new blocks (hybrid and
    mixed-precision caches) and copy-on-write destinations."""
    blocks = set(getattr(out, "new_block_ids_to_zero", None) or ())
    for copy in getattr(out, "kv_cache_block_copies", None) or ():
        blocks.add(copy[1] if isinstance(copy, (tuple, list)) else getattr(copy, "dst", -1))
    return blocks


def _budget_scheduler(vllm_config, settings: ConnectorSettings,
                      block_size: int) -> BudgetScheduler:
    """In-engine budgets' scheduler side, with the reason budgets cannot apply here, if any."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    token_bytes = (2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size()
                   * mc.dtype.itemsize)
    why = None
    if not settings.budgets.in_engine:
        why = ('in-engine budgets are off in this vLLM (start it with kv_connector_extra_config '
               '{"in_engine": true})')
    elif getattr(vllm_config, "speculative_config", None) is not None:
        why = ("this vLLM runs speculative decoding, whose rollbacks move the token counts a "
               "compaction relies on")
    elif pc.pipeline_parallel_size > 1:
        why = (f"this vLLM runs pipeline parallel ({pc.pipeline_parallel_size} stages); each "
               "stage would have to compact alike")
    elif pc.tensor_parallel_size > 1:
        why = (f"this vLLM runs tensor parallel ({pc.tensor_parallel_size} ranks): in-engine "
               "compaction is single-rank for now")
    elif max(getattr(pc, "decode_context_parallel_size", 1),
             getattr(pc, "prefill_context_parallel_size", 1)) > 1:
        why = "this vLLM runs context parallel, whose KV split the compaction does not know"
    no_queries = capture_unavailable(settings.capture.query_capture, vllm.__version__, vllm_config,
                                     decodes=True)
    budgets = settings.budgets
    return BudgetScheduler(block_size, token_bytes, budgets.stash_bytes, why, no_queries,
                           turn_tokens=budgets.turn_tokens,
                           cached_kept_blocks=budgets.cached_kept_blocks,
                           stats_every=settings.stats_interval_s)

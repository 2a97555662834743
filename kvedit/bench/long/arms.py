"""The SDK's arms of `kvedit bench long` on the kvedit engine: `none` (prefill every stream,
then decode, no budget) and `host` (the budget kept by round trips: `BatchedStream.run` given
a HostBudget, decode rounds of K and an edit whenever the next round would pass B).

Each arm runs on fresh streams (a salt of its own, so it hits no other arm's blocks) and
releases them when done, so the server holds one arm's chunks at a time (kvedit.bench.long.
sizing counts on it); what was left in the server that no stream referenced is counted
before the release (`unreferenced_objects`).
"""
from __future__ import annotations

import time
import uuid

import kvedit
from kvedit.bench.long.logs import STATS_INTERVAL_S, flush
from kvedit.bench.long.policies import main_policy, queries_of
from kvedit.bench.serve.counters import connector_counters, moved
from kvedit.harness.experiment import block_size, cpu_seconds
from kvedit.harness.vocab import engine_steps, fixed_length, vllm_counters


def sdk_arm(ctx, completion, prompts, args, eng, *, budget: bool, progress: bool) -> dict:
    """One SDK arm on fresh streams; its figures and its streams' outputs (`outputs`)."""
    salt = f"long-{'host' if budget else 'none'}-{uuid.uuid4().hex[:8]}"
    policy = main_policy(args) if budget else None
    capture = queries_of(policy) if policy is not None else 0
    batch = kvedit.BatchedStream(progress=progress)
    for p in prompts:
        batch.add(kvedit.create_request(ctx, completion, p, cache_salt=salt,
                                        capture_queries=capture))
    before, cpu0 = vllm_counters(eng.vllm_url), cpu_seconds(eng.pids)
    conn0 = connector_counters(eng.log_path) if eng.log_path else None
    t0 = time.perf_counter()
    if budget:
        m = batch.run(fixed_length(1), kvedit.HostBudget(args.budget, args.every, policy),
                      fixed_length(args.max_tokens))
        edits = m.parts["modify"]
        extra = {"edit_rounds": m.edit_rounds, "edit_busy_s": edits.duration,
                 "edit_fn_s": edits.fn_s, "edit_store_s": edits.store_s,
                 "edit_retrieve_s": edits.retrieve_s, "chunks_deleted": edits.chunks_deleted}
    else:
        batch.prefill(fixed_length(1))
        # the two phases apart: what the flow costs (prefill every stream first) is then
        # told from what the decode under pressure costs
        extra = {"prefill_phase_s": time.perf_counter() - t0}
        batch.decode(fixed_length(args.max_tokens))
    wall = time.perf_counter() - t0
    if conn0 is not None:
        # what the connector did meanwhile (its stats lines: stores, loads, hook time a
        # step): the lines come at most every stats_interval_s while the engine steps, so
        # one step (a 1-token request) past the interval writes the arm's last counts
        time.sleep(STATS_INTERVAL_S + 0.2)
        flush(eng.vllm_url, eng.model)
        extra["connector"] = moved(connector_counters(eng.log_path), conn0)
    out = {"wall_s": wall, "cpu_s": cpu_seconds(eng.pids) - cpu0,
           "output_tokens": sum(len(s.output_token_ids) for s in batch),
           **engine_steps(before, vllm_counters(eng.vllm_url)), **extra,
           "max_request_tokens": max(g.prompt_tokens + len(g.token_ids)
                                     for s in batch for g in s.generations),
           # the rounds after the prefill: what a budget binds (the prefill holds the prompt)
           "max_decode_request_tokens": max((g.prompt_tokens + len(g.token_ids) for s in batch
                                             for g in s.generations[1:]), default=0)}
    out["decode_tput"] = out["output_tokens"] / wall
    out["tokens_per_cpu_s"] = out["output_tokens"] / out["cpu_s"] if out["cpu_s"] else None
    out["mean_footprint_tokens"] = mean_footprint(batch)
    out["mean_footprint_blocks"] = mean_footprint(batch, block_size())
    out["outputs"] = [list(s.output_token_ids) for s in batch]
    out.update(release(ctx, batch))
    return out


def release(ctx, batch) -> dict:
    """Release a finished arm's streams; the objects the server held that none of them
    referenced just before (0 expected: a chunk no stream holds is a leak)."""
    live = {k for s in batch for k in s.keys}
    held = ctx.client.stats()["objects"]
    batch.release()
    return {"unreferenced_objects": held - len(live)}


def mean_footprint(batch, block_size: int = 1) -> float:
    """KV a sequence held while generating, averaged over every generated token (the i-th
    token of a request sent with p prompt tokens is computed holding p + i tokens): in
    tokens, or in blocks of `block_size` tokens."""
    held = count = 0
    for s in batch:
        for g in s.generations:
            k = len(g.token_ids)
            held += sum(-(-(g.prompt_tokens + i) // block_size) for i in range(k))
            count += k
    return held / count if count else 0.0

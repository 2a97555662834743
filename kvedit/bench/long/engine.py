"""The in-engine arm of `kvedit bench long --in-engine`: the same streams and budget as the
host arm, but each stream sends one request and vLLM compacts its KV in place
(`BatchedStream.run` given an EngineBudget).

Where the in-engine figures come from:
- decode throughput and tokens per engine step: as for the other arms (wall clock; vLLM's
  counters).
- mean footprint: the budget rule replayed per stream (a stream holds P, grows by one per
  generated token, and drops to `budget - every` when the next token would pass `budget`):
  exactly what the scheduler side enforces, so the bound is min(N, cap/F) as for the others;
  in tokens, and in the vLLM blocks those tokens occupy (what the pool really gives out).
- edit overhead: the workers' time inside compactions (scoring, moving KV, stash copies),
  from the `kvedit: in-engine worker stats` lines the connector logs (stats_interval_s 0),
  over the arm's wall time. On CUDA it includes waiting for the device work it queued.
- blocks: the scheduler side's `kvedit: in-engine stats` line (compactions, blocks released
  back to vLLM, freed blocks vLLM handed out again, copies on write, stashes/restores).
- leaked blocks: vLLM's own `vllm:kv_cache_usage_perc` once every request is done (a block
  still held by nobody's request), times the pool size; and the scheduler side's count of
  free blocks when idle, as a second opinion.
"""
from __future__ import annotations

import re
import time
import urllib.request
import uuid

import kvedit
from kvedit.bench.long.arms import release
from kvedit.bench.long.full import InFlight
from kvedit.bench.long.logs import flush, stats
from kvedit.harness.experiment import block_size, cpu_seconds
from kvedit.harness.vocab import engine_steps, fixed_length
from kvedit.harness.vocab import vllm_counters as counters


def delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def mean_footprint(prompt_len: int, max_tokens: int, budget: int, every: int,
                   block_size: int = 1) -> float:
    """KV a stream holds while generating, averaged over its tokens, under the in-engine rule
    (the i-th token is computed over the resident tokens before it): in tokens, or in blocks
    of `block_size` tokens."""
    resident, held = prompt_len, 0
    for _ in range(max_tokens + 1):   # the prefill's token, then max_tokens more
        held += -(-resident // block_size)
        if resident + 1 > budget:
            resident = budget - every
        resident += 1
    return held / (max_tokens + 1)


def kv_usage(vllm_url: str) -> float | None:
    try:
        with urllib.request.urlopen(f"{vllm_url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)$", text, re.M)
    return float(m[1]) if m else None


def arm(ctx, completion, prompts, args, eng, policy, *, progress: bool,
        budget: int | None = None, queries: int = 0) -> dict:
    """The in-engine arm on fresh streams: its figures and outputs (`outputs`); its streams
    are released when it ends (kvedit.bench.long.arms.release). `budget`: the budget's tokens
    (default args.budget); `queries`: the device query ring's rows of a query-aware policy,
    or the prompt's last rows that rank it (PromptAnchored; kvedit.engine_budget)."""
    salt = f"long-engine-{uuid.uuid4().hex[:8]}"
    batch = kvedit.BatchedStream(progress=progress)
    for p in prompts:
        batch.add(kvedit.create_request(ctx, completion, p, cache_salt=salt))
    before_stats, before = stats(eng.log_path), counters(eng.vllm_url)
    cpu0 = cpu_seconds(eng.pids)
    t0 = time.perf_counter()
    budget = args.budget if budget is None else budget
    spec = kvedit.EngineBudget.from_policy(policy, budget, args.every, positions=args.positions,
                                           queries=queries)
    with InFlight(eng.vllm_url) as running:
        batch.run(fixed_length(1), spec, fixed_length(args.max_tokens))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(eng.pids) - cpu0
    after = counters(eng.vllm_url)
    flush(eng.vllm_url, eng.model)
    usage = kv_usage(eng.vllm_url)
    time.sleep(0.5)  # the log lines of the flush step
    after_stats = stats(eng.log_path)
    sched = delta(before_stats.get("scheduler", {}), after_stats.get("scheduler", {}))
    work = delta(before_stats.get("worker", {}), after_stats.get("worker", {}))
    total_blocks = after_stats.get("scheduler", {}).get("pool_total")
    out = {"budget": budget, "engine_budget": spec.to_dict(), "wall_s": wall, "cpu_s": cpu,
           "output_tokens": sum(len(s.output_token_ids) for s in batch),
           **engine_steps(before, after),
           # compactions, stash copies and the per-step input shifts of compacted requests:
           # the workers' host time and (on a GPU) the device time of the same work are
           # one interval seen from two sides (the device runs the copies as the host
           # queues them), so the longer of the two counts, not their sum
           "edit_busy_s": max(work.get("compact_s", 0.0), work.get("device_s", 0.0))
           + work.get("shift_s", 0.0),
           "in_engine": sched,
           "worker": work, "kv_cache_usage_after": usage,
           "pool_free_when_idle": after_stats.get("scheduler", {}).get("pool_free"),
           "pool_total": total_blocks, **running.summary()}
    out["decode_tput"] = out["output_tokens"] / wall
    out["tokens_per_cpu_s"] = out["output_tokens"] / cpu if cpu else None
    # prompts of different lengths (long-generation tasks): the mean over the streams
    out["mean_footprint_tokens"] = sum(mean_footprint(len(p), args.max_tokens, budget,
                                                      args.every) for p in prompts) / len(prompts)
    out["mean_footprint_blocks"] = sum(mean_footprint(len(p), args.max_tokens, budget,
                                                      args.every, block_size())
                                       for p in prompts) / len(prompts)
    out["leaked_blocks"] = round(usage * total_blocks) if usage is not None and total_blocks \
        else None
    out["outputs"] = [list(s.output_token_ids) for s in batch]
    out.update(release(ctx, batch))
    return out

"""The eval's reuse-with-repair cell: one compressed cache per sample, repaired for each of its
questions from the original before that question is decoded.

Why a cell kind of its own: the reuse cell (runner.py) measures what one cache edited once
keeps for every question; a `Repair` policy in `--policies` (`repair:base=keydiff`) asks
instead what kvedit's repair gives back (kvedit.sdk.repair). Per sample:

1. a fresh stream of the prompt (context + the first question) is compressed by the Repair's
   query-agnostic base alone (`Repair.base_policy` at the cell's ratio), its original kept
   in an `Originals` ledger (the prefill streams hold the original chunks for every cell
   anyway);
2. every question is asked of that one compressed cache: the first by that stream, each
   further one by a new stream of the compressed context + its question, under the
   compressed stream's salt (as the reuse cell asks them), sharing the original;
3. each of those streams is repaired for its own question (`BatchedStream.repair`: capture
   the question's queries on the original, re-select within the same budget) and decoded
   greedily on the repaired cache; every answer token comes from it (`first_token=False`).

The records are the reuse cell's (`question` says which, `kept_fraction` the compressed
size), so report.py and gating.py count them unchanged: the main questions in the per-cell
figures, every question in the reuse block, under the label `Repair:...`.
"""
from __future__ import annotations

import time

from kvedit.harness.vocab import greedy
from kvedit.sdk.loop import run_sync
from kvedit.sdk.originals import Originals


def run(acc, policy, cell) -> tuple[list[dict], dict]:
    """The cell's records and info, as AccuracyRun.cell returns them (`acc` the run)."""
    t0 = time.perf_counter()
    ledger = Originals(1 << 62)     # the prefill streams hold the originals anyway
    main = acc._batch()
    mod = main.modify(policy.base_policy, originals=ledger)
    # each sample's context (its original region) and the share the compression kept
    regions = [len(ledger.record(st).original.tokens) for st in main]
    kept = [(len(st.prompt) - (len(s.prompt_ids) - r)) / r
            for s, st, r in zip(acc.samples, main, regions)]
    asks, where = acc._asks(acc._contexts(main)) if acc.reuse else (None, [])
    for (i, _), st in zip(where, asks or []):
        ledger.share(main.streams[i], st)
    t1 = time.perf_counter()
    fixed = [main.repair(policy, originals=ledger, sampling_params=greedy(1), first_token=False)]
    if asks is not None:
        fixed.append(asks.repair(policy, originals=ledger, sampling_params=greedy(1),
                                 first_token=False))
    t2 = time.perf_counter()
    dec = acc._decode(main, greedy(acc.max_tokens), asks)
    records = [acc._record(s, st.output_token_ids, cell, k)
               for s, st, k in zip(acc.samples, main, kept)]
    records += acc._answers(asks, where, cell, kept)
    acc._release(main)
    run_sync(ledger.arelease())
    return records, {
        "kept_tokens": sum(k * r for k, r in zip(kept, regions)),
        "context_tokens": sum(regions), "tokens_before": mod.tokens_before,
        "tokens_after": mod.tokens_after, "modify_s": mod.duration,
        "retrieve_s": mod.retrieve_s, "fn_s": mod.fn_s, "store_s": mod.store_s,
        "repair_s": t2 - t1, "repair_capture_s": sum(m.capture_s for m in fixed),
        "repair_fn_s": sum(m.fn_s for m in fixed),
        "repaired": sum(m.streams_repaired for m in fixed),
        "repair_skipped": sum(m.streams_evicted for m in fixed),
        "decode_s": dec.duration, "seconds": time.perf_counter() - t0}

"""repair: mend a compressed stream for the question that just arrived, from its original.

A stream compressed without knowing the question (`modify(KeyDiff(0.5), originals=ledger)`)
serves any later question from one small cache, but loses facts the question needs. Its
original chunks are still in the kvedit server (kvedit.sdk.originals). When a question (or
any new turn) has been appended to the stream, `repair_stream`:

1. **captures the question's queries on the original**: one request of the original region
   + everything after the compressed region (the question), under the original's salt,
   asking vLLM to capture the queries of that tail (W rows). The connector loads the whole
   chunks before the window from the server (the original: a host-to-device copy), vLLM
   computes only the tail, and answers one token (computed on the full original);
2. **re-selects within the same budget** (`modify` of that request's original region with
   the caller's query-aware edit, fitted to exactly as many tokens as the compressed region
   held, and those queries): with a `kvedit.edits.Repair` naming the compressing policy as
   its base, the base keeps its best tokens and the question's ranking fills the share
   `restore` of the budget from the rest (the SDK names no policy: the edit says what it
   keeps, `Fits` makes it keep that many);
3. **swaps** the stream onto the repaired region (its compressed chunks are released; the
   original stays in the ledger for the next question). The stream decodes on it next.

`first_token=True` (default) keeps the token the capture pass answered as the answer's first
token: the question is prefilled on its whole original and decoded on the repaired cache,
as an in-engine budget prefills a prompt whole and compacts it before decoding. The
question's time to first token is then the capture pass's, and the repair's cost moves to
the second token. False: every answer token is decoded on the repaired cache (the eval's
strict measure), so the first one waits for the whole repair and a second prefill of the
question.

Atomic per stream: until the swap nothing of the stream changes; a failure raises
RepairError naming the stream, whose compressed cache stays as it was. An original no
longer in the server (let go by the ledger's budget, or evicted by the server) is skipped
(`if_evicted="skip"`: the stream decodes on its compressed cache; counted) or computed
again by the capture pass (`"recompute"`: a prefill of the original).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from kvedit.query_contract import MAX_WINDOW
from kvedit.sdk.contracts import Fits, wants_queries
from kvedit.sdk.errors import StreamError
from kvedit.sdk.metrics import Metrics, add_modify
from kvedit.sdk.modify import modify_stream
from kvedit.sdk.originals import Originals
from kvedit.sdk.stream import Stream

log = logging.getLogger("kvedit.sdk")
IfEvicted = Literal["skip", "recompute"]


class RepairError(StreamError):
    """A stream could not be repaired; it is unchanged (its compressed cache is kept)."""


@dataclass
class RepairMetrics(Metrics):
    """Metrics("repair"): the capture passes (input/cached tokens; `ttft` per stream from
    its repair's start to the capture pass's answer token), the re-selections (modify's
    counters), and per stream what happened."""
    streams_repaired: int = 0
    streams_evicted: int = 0         # skipped: the original was no longer in the server
    recomputed_tokens: int = 0       # original tokens the capture passes computed again
    capture_s: float = 0.0           # summed over streams


def check_how(how) -> None:
    """TypeError unless `how` can repair: an edit that scores with the question's queries
    and can be fitted to a budget (`Fits`: kvedit.edits.Repair)."""
    if not isinstance(how, Fits) or not wants_queries(how):
        raise TypeError(f"repair needs an edit that scores with the question's queries and "
                        f"can be fitted to a budget (a kvedit.edits.Repair naming the policy "
                        f"that compressed the streams), got {type(how).__name__}")


def window_for(following: int, window: int | None) -> int:
    """Rows to capture: the whole turn after the compressed region, or its last `window`."""
    return max(1, min(following, window or following, MAX_WINDOW))


async def repair_stream(stream: Stream, ledger: Originals, how, *, params,
                        cpu_slots, m: RepairMetrics, first_token: bool = True,
                        window: int | None = None, if_evicted: IfEvicted = "skip",
                        wait_timeout: float = 60.0) -> None:
    """Repair one stream for what follows its compressed region (module docstring); `how`
    passed check_how."""
    rec = ledger.record(stream)
    if rec is None:
        raise RepairError(stream, "it has no original kept: compress it with modify(fn, "
                                  "originals=ledger) (or ledger.share it) first")
    n = len(rec.current)
    if stream.prompt[:n] != rec.current:
        raise RepairError(stream, "its cache was edited since it was compressed or last "
                                  "repaired: the original no longer describes it")
    following = stream.prompt[n:]
    if not following:
        raise RepairError(stream, "nothing follows its compressed region: append the new "
                                  "question (stream.append) before repairing")
    fn = how.keeping(n)      # the same budget: as many tokens as the compressed region
    original, ctx = rec.original, stream.ctx
    have = await ctx.call(ctx.client.lookup, ctx.model, original.keys)
    if have < len(original.keys):
        ledger.counts["evicted_seen"] += int(original.held)
        if if_evicted == "skip":
            ledger.counts["skipped"] += 1
            m.streams_evicted += 1
            log.warning("%s: not repaired: %d of the %d chunks of its original are no longer "
                        "in the kvedit server (%s)", stream.label, len(original.keys) - have,
                        len(original.keys), "let go by the ledger's budget"
                        if not original.held else "evicted by the server")
            return
        ledger.readmit(original)
        m.recomputed_tokens += (len(original.keys) - have) * ctx.chunk_size
        ledger.counts["recomputed_tokens"] += (len(original.keys) - have) * ctx.chunk_size
    start = time.perf_counter()
    w = window_for(len(following), window)
    probe = Stream(ctx, stream.post_completion, original.tokens + following, original.salt,
                   name=f"{stream.name or stream.id}/repair", capture_queries=w)
    try:
        t0 = time.perf_counter()
        gen = await probe.generate(params, max_tokens=1, capture_queries=w)
        m.capture_s += time.perf_counter() - t0
        m.input_tokens += gen.prompt_tokens
        m.output_tokens += len(gen.token_ids)
        m.add_cached(gen.cached_tokens)
        if gen.ttft is not None:   # from the repair's start: what first_token=True waits
            m.ttft.append(t0 - start + gen.ttft)
        probe.kv_tokens = len(original.tokens)   # re-select the original region only
        add_modify(m, await modify_stream(probe, fn, cpu_slots=cpu_slots,
                                          wait_timeout=wait_timeout))
    except StreamError as e:
        await probe.arelease()
        raise RepairError(stream, f"repair failed: {e.reason}") from e
    except BaseException:
        await probe.arelease()
        raise
    await _adopt(stream, probe, gen, first_token)
    kept = len(stream.prompt) - len(following) - (1 if first_token else 0)
    ledger.moved(stream, stream.prompt[:kept])
    ledger.counts["repairs"] += 1
    m.streams_repaired += 1
    await ledger.fit()


async def _adopt(stream: Stream, probe: Stream, gen, first_token: bool) -> None:
    """The stream takes over the probe's repaired region (and its references); its own
    compressed chunks are released (deleted where no other stream uses them)."""
    token = probe.suffix.pop()   # the capture pass's answer, computed on the original
    if first_token:
        probe.suffix.append(token)
        stream.output_token_ids.append(token)
        stream.logprobs.append(None)
        stream.generations.append(gen)
    old = stream.keys
    stream.tokens, stream.suffix = probe.tokens, probe.suffix
    stream.cache_salt, stream.kv_tokens, stream.keys = probe.cache_salt, probe.kv_tokens, \
        probe.keys
    probe.keys, probe.released = [], True   # its references are the stream's now
    ctx = stream.ctx
    dead = ctx.unref(old)
    if dead:
        try:
            await ctx.call(ctx.delete_kv, dead)
        except Exception as e:  # the repair is done; a failed clean-up only costs memory
            log.warning("%s: deleting %d compressed chunks failed: %s", stream.label,
                        len(dead), e)

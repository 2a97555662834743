"""The accuracy half of `kvedit eval`: every sample through the real path.

Each sample is prefilled once by vLLM (the connector stores its chunks under the sample's
own cache salt). The baseline decodes that prefilled stream unedited. For every policy x
ratio, a fresh stream of the same prompt and salt finds those chunks in the kvedit server,
`BatchedStream.modify` applies the policy, and vLLM decodes greedily on the edited cache.
The original chunks stay referenced by the prefill streams, so one prefill serves every
policy; each policy's edited chunks are deleted once its answers are in.

Where a policy's queries come from (its `queries_from`): a query-aware policy (SnapKV,
TOVA: "prompt") gets the queries vLLM captured for the prompt's tail (the question) during
the prefill; KVzip ("reconstruction") those of one reconstruction pass per sample
(`kvedit.sdk.kvzip`), and Expected Attention or a head-adaptive budget's null keys
("context") those of one pass over the context alone (`kvedit.sdk.context_pass`): each
pass runs once after the prefill, by streams that hold its queries for every cell.

Reuse (SCBench style): a sample with several questions (one per needle) is edited once, for
its first question, and then every other question is asked of the same edited cache: a new
request of the edited tokens + that question's tail under the edited stream's salt, which
loads the edited chunks. The records say which question (`question`, 0 = the main one).

What a policy really drops: the editable region is the chunk-aligned prefix of the prompt
(the tasks put the question after it, in the stream's suffix, so no policy can drop it). A
token-granularity edit may leave a partial last chunk; the SDK re-sends those tokens and vLLM
recomputes them (see `kvedit.sdk.modify`). `kept_fraction` counts every context token that
survives, stored or recomputed.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from kvedit.harness.eval.tasks import Sample
from kvedit.harness.vocab import greedy

# Requests in flight at once. vLLM's throughput on two CPU cores is the same with 16 as with
# all of them, but a request's wait is then a slice of the batch's, not the whole: on a loaded
# machine a batch of 120 prompts sent at once outlasts the completion client's read timeout.
# A GPU batches far more at no cost in latency (`in_flight` of AccuracyRun).
IN_FLIGHT = 16
IN_FLIGHT_GPU = 64


class NoOp:
    """The no-op edit: retrieve -> identity -> store -> decode. Its answers should be the
    unedited baseline's (what the edit path itself costs, with nothing dropped)."""
    needs_queries = False

    def __call__(self, kv, tokens):
        return kv, tokens


class Reload:
    """The no-op edit's control: no edit at all. Fresh requests of the same prompts decode
    from the original chunks (loaded from the kvedit server, as the no-op's are), with no
    retrieve or store between. Where the no-op's answers differ from the baseline's, this
    says how many differ without any edit: on a GPU vLLM is not batch-invariant, and a
    request whose prompt is loaded decodes in other batches than the prefill's own."""
    needs_queries = False


@dataclass(frozen=True)
class Cell:
    """One policy at one ratio (policy None: the unedited baseline)."""
    policy: str | None
    ratio: float

    @property
    def label(self) -> str:
        return "baseline" if self.policy is None else f"{self.policy} {self.ratio:g}"


@dataclass(frozen=True)
class Reconstruction:
    """KVzip's pass for the eval's prompts: the repeat prompt and the first token repeated."""
    repeat_ids: list[int]
    start: int


def editable(sample: Sample, chunk: int) -> int:
    """Prompt tokens a KV edit may change: the whole chunks of the prompt."""
    return len(sample.prompt_ids) // chunk * chunk


def query_window(sample: Sample, chunk: int) -> int:
    """W to capture for `sample`: its un-editable tail (the question), at least 1."""
    return max(1, len(sample.prompt_ids) - editable(sample, chunk))


class AccuracyRun:
    """Prefill once, then answer with the baseline and with each policy x ratio."""

    def __init__(self, ctx, completion, samples: list[Sample], decode, *, progress: bool = True,
                 capture: bool = False, reconstruction: Reconstruction | None = None,
                 context_rows: int | None = None, reuse: bool = False,
                 in_flight: int = IN_FLIGHT, modify_concurrency: int = 2):
        self.ctx, self.completion, self.samples = ctx, completion, samples
        self.in_flight, self.modify_concurrency = in_flight, modify_concurrency
        self.decode_text = decode  # token ids -> text (the model's tokenizer)
        self.progress = progress
        self.capture = capture  # some policy needs queries: the prefill captures them
        self.reconstruction = reconstruction  # some policy needs KVzip's pass
        self.context_rows = context_rows      # some policy needs the context's own queries
        self.reuse = reuse      # ask every question of multi-question samples too
        self.salts = [f"eval-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(samples))]
        self.max_tokens = max(s.max_tokens for s in samples)
        self._held = None
        # by queries_from: streams holding each sample's pass queries ("reconstruction",
        # "context")
        self._passes: dict = {}

    def _batch(self, source: str | None = None):
        """Fresh streams of every sample; `source` says where their queries come from:
        "prompt" captures the tail at their prefill, a pass's name shares its queries."""
        import kvedit
        from kvedit.sdk.passes import share_queries

        batch = kvedit.BatchedStream(progress=self.progress, max_concurrency=self.in_flight,
                                     modify_concurrency=self.modify_concurrency)
        for i, (s, salt) in enumerate(zip(self.samples, self.salts)):
            kw = ({"capture_queries": query_window(s, self.ctx.chunk_size)}
                  if source == "prompt" else {})
            st = batch.add(kvedit.create_request(self.ctx, self.completion, s.prompt_ids,
                                                 cache_salt=salt, name=self._name(s), **kw))
            if source in self._passes:
                share_queries(self._passes[source].streams[i], st)
        return batch

    @staticmethod
    def _name(s: Sample) -> str:
        return f"s{s.seed}/{s.task}/{s.length}/{s.index}"

    def baseline(self) -> tuple[list[dict], dict]:
        """Prefill every sample (chunks stored, queries captured if asked), run KVzip's
        reconstruction pass if asked, and decode the unedited streams."""
        t0 = time.perf_counter()
        batch = self._batch("prompt" if self.capture else None)
        pre = batch.prefill(greedy(1))
        info = {"prefill_s": pre.duration, "prefill_tokens": pre.input_tokens}
        if self.reconstruction is not None:
            from kvedit.sdk.kvzip import reconstruct

            self._passes["reconstruction"] = self._batch()
            r = reconstruct(self._passes["reconstruction"], self.reconstruction.repeat_ids,
                            start=self.reconstruction.start)
            info.update(reconstruct_s=r.duration, reconstruct_tokens=r.input_tokens,
                        reconstruct_cached_tokens=r.cached_tokens)
        if self.context_rows:
            from kvedit.sdk.context_pass import capture_context

            self._passes["context"] = self._batch()
            r = capture_context(self._passes["context"], self.context_rows)
            info.update(context_pass_s=r.duration, context_pass_tokens=r.input_tokens,
                        context_pass_cached_tokens=r.cached_tokens)
        asks, where = None, []
        if self.reuse:
            contexts = [(s.prompt_ids[:len(s.prompt_ids) - len(s.questions[0].tail)], salt)
                        if s.questions else None for s, salt in zip(self.samples, self.salts)]
            asks, where = self._asks(contexts)
        dec = self._decode(batch, greedy(self.max_tokens - 1), asks)
        self._held = batch  # keeps the original chunks referenced for the policies
        chunk = self.ctx.chunk_size
        records = [self._record(s, st.output_token_ids, Cell(None, 0.0), 1.0)
                   for s, st in zip(self.samples, batch)]
        records += self._answers(asks, where, Cell(None, 0.0), [1.0] * len(self.samples))
        stored = sum(editable(s, chunk) for s in self.samples)
        self.baseline_outputs = [r["output"] for r in records[:len(self.samples)]]
        return records, {**info, "decode_s": dec.duration, "stored_tokens": stored,
                         "seconds": time.perf_counter() - t0}

    def cell(self, policy, cell: Cell) -> tuple[list[dict], dict]:
        """Answers of every sample after `policy` edited its KV (and, with reuse, of every
        further question from the same edited KV)."""
        return self.cells([(policy, cell)])[0]

    def cells(self, pairs) -> list[tuple[list[dict], dict]]:
        """`cell` for every (policy, cell) of `pairs` at once: their edits and decodes
        overlap on the engine (a GPU batches the cells' requests together), each cell on its
        own fresh streams. Results in the order of `pairs`."""
        from kvedit.sdk.loop import run_sync

        async def all_of():
            return await asyncio.gather(*(self.acell(p, c) for p, c in pairs))

        return run_sync(all_of())

    async def acell(self, policy, cell: Cell) -> tuple[list[dict], dict]:
        """`cell` on the SDK's loop (every stream of the run is made and released there)."""
        from kvedit.edits.repair import Repair

        if isinstance(policy, Repair):  # reuse with repair: its own cell kind, synchronous
            from kvedit.harness.eval import repair_cell

            return await asyncio.to_thread(repair_cell.run, self, policy, cell)
        source = (getattr(policy, "queries_from", None) or "prompt") if policy.needs_queries \
            else None
        if (source == "prompt" and not self.capture) or (
                source not in (None, "prompt") and source not in self._passes):
            raise ValueError(f"{cell.label} needs the queries of {source!r}: build "
                             "AccuracyRun with capture=True, reconstruction=... or "
                             "context_rows=... so the prefill or its pass gets them")
        batch = self._batch(source)
        t0 = time.perf_counter()
        control = isinstance(policy, Reload)
        mod = None if control else await batch.amodify(policy)
        chunk = self.ctx.chunk_size
        kept = []
        for s, st in zip(self.samples, batch):
            region = editable(s, chunk)
            tail = len(s.prompt_ids) - region  # the question: never edited
            kept.append(1.0 if control else (len(st.tokens) + len(st.suffix) - tail) / region)
        # The no-op edit and its control are judged on the main answers alone (against the
        # baseline's).
        ask = self.reuse and not isinstance(policy, (NoOp, Reload))
        asks, where = self._asks(self._contexts(batch)) if ask else (None, [])
        dec = await self._adecode(batch, greedy(self.max_tokens), asks)
        records = [self._record(s, st.output_token_ids, cell, k)
                   for s, st, k in zip(self.samples, batch, kept)]
        if isinstance(policy, (NoOp, Reload)) and getattr(self, "baseline_outputs", None):
            for r, base in zip(records, self.baseline_outputs):
                r["same_as_baseline"] = r["output"] == base
        records += self._answers(asks, where, cell, kept, release=False)
        for b in (batch, asks):
            if b is not None:
                await self._arelease(b)
        context = sum(editable(s, chunk) for s in self.samples)
        edit = {} if mod is None else {
            "tokens_before": mod.tokens_before, "tokens_after": mod.tokens_after,
            "modify_s": mod.duration, "retrieve_s": mod.retrieve_s, "fn_s": mod.fn_s,
            "store_s": mod.store_s}
        return records, {
            "kept_tokens": sum(k * editable(s, chunk) for s, k in zip(self.samples, kept)),
            "context_tokens": context, **edit,
            "decode_s": dec.duration, "seconds": time.perf_counter() - t0}

    def _contexts(self, batch) -> list[tuple[list[int], str] | None]:
        """Each edited stream's context (its edited tokens and what follows them up to the
        question) and salt, before it decodes: what a further question is appended to."""
        return [(st.prompt[: len(st.prompt) - len(s.questions[0].tail)], st.cache_salt)
                if s.questions else None for s, st in zip(self.samples, batch)]

    def _asks(self, contexts):
        """The further questions of multi-question samples as one batch (not sent yet): each
        a request of its sample's context + the question's tail under the context's salt,
        so it loads the context's (edited or original) chunks from the kvedit server.
        Returns (the batch or None, [(sample index, question index)])."""
        import kvedit

        asks, where = kvedit.BatchedStream(progress=self.progress,
                                           max_concurrency=self.in_flight), []
        for i, (s, cs) in enumerate(zip(self.samples, contexts)):
            for j, q in enumerate(s.questions[1:], start=1):
                context, salt = cs
                asks.add(kvedit.create_request(self.ctx, self.completion, context + list(q.tail),
                                               cache_salt=salt, name=f"{self._name(s)}/q{j}"))
                where.append((i, j))
        return (asks if where else None), where

    def _decode(self, batch, params: dict, asks):
        """The synchronous `_adecode`."""
        from kvedit.sdk.loop import run_sync

        return run_sync(self._adecode(batch, params, asks))

    async def _adecode(self, batch, params: dict, asks):
        """Decode `batch` and the further questions `asks` at once: one wave of requests on
        the engine instead of two (a GPU batches them; the edited chunks load once into its
        prefix cache for both). Returns the main batch's decode Metrics."""
        if asks is None:
            return await batch.adecode(params)
        dec, _ = await asyncio.gather(batch.adecode(params),
                                      asks.adecode(greedy(self.max_tokens)))
        return dec

    def _answers(self, asks, where, cell: Cell, kept: list[float],
                 release: bool = True) -> list[dict]:
        """The further questions' records (and their chunks released, unless not asked)."""
        if asks is None:
            return []
        out = [self._record(self.samples[i], st.output_token_ids, cell, kept[i], j)
               for (i, j), st in zip(where, asks)]
        if release:
            self._release(asks)
        return out

    def _record(self, s: Sample, output_ids, cell: Cell, kept: float, question: int = 0) -> dict:
        text = self.decode_text(output_ids)
        q = s.questions[question] if s.questions else None
        answers = q.answers if q else s.answers
        return {"seed": s.seed, "task": s.task, "length": s.length, "depth": s.depth,
                "index": s.index, "question": question, "questions": max(1, len(s.questions)),
                "policy": cell.policy, "ratio": cell.ratio, "kept_fraction": kept,
                "ok": q.correct(text) if q else s.correct(text), "answer": list(answers),
                "output": text}

    def _release(self, batch) -> None:
        """Delete the edited chunks no other stream references (the originals stay held)."""
        dead = self.ctx.unref([k for st in batch for k in st.keys])
        if dead:
            self.ctx.client.delete(self.ctx.model, dead)

    async def _arelease(self, batch) -> None:
        """`_release` on the SDK's loop (the delete in the context's pool)."""
        dead = self.ctx.unref([k for st in batch for k in st.keys])
        if dead:
            await self.ctx.call(self.ctx.client.delete, self.ctx.model, dead)

    def close(self) -> None:
        for batch in [self._held, *self._passes.values()]:
            if batch is not None:
                self._release(batch)
                release_queries(batch)
        self._held, self._passes = None, {}


def release_queries(batch) -> None:
    """The held prefill streams let go of their captured queries (the last holders: the
    objects are deleted from the server; edited streams already let go of theirs)."""
    import asyncio

    from kvedit.sdk.queries import release_queries as release

    async def all_of():
        await asyncio.gather(*(release(st) for st in batch))

    if any(st.queries is not None for st in batch):
        asyncio.run(all_of())

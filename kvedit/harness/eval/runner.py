"""The accuracy half of `kvedit eval`: every sample through the real path.

Each sample is prefilled once by vLLM (the connector stores its chunks under the sample's
own cache salt). The baseline decodes that prefilled stream unedited. For every policy x
ratio, a fresh stream of the same prompt and salt finds those chunks in the kvedit server,
`BatchedStream.modify` applies the policy, and vLLM decodes greedily on the edited cache.
The original chunks stay referenced by the prefill streams, so one prefill serves every
policy; each policy's edited chunks are deleted once its answers are in.

What a policy really drops: the editable region is the chunk-aligned prefix of the prompt
(the tasks put the question after it, in the stream's suffix, so no policy can drop it). A
token-granularity edit may leave a partial last chunk; the SDK re-sends those tokens and vLLM
recomputes them (see `kvedit.sdk.modify`). `kept_fraction` counts every context token that
survives, stored or recomputed.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from kvedit.harness.eval.tasks import Sample
from kvedit.harness.vocab import greedy


@dataclass(frozen=True)
class Cell:
    """One policy at one ratio (policy None: the unedited baseline)."""
    policy: str | None
    ratio: float

    @property
    def label(self) -> str:
        return "baseline" if self.policy is None else f"{self.policy} {self.ratio:g}"


def editable(sample: Sample, chunk: int) -> int:
    """Prompt tokens a KV edit may change: the whole chunks of the prompt."""
    return len(sample.prompt_ids) // chunk * chunk


def query_window(sample: Sample, chunk: int) -> int:
    """W to capture for `sample`: its un-editable tail (the question), at least 1."""
    return max(1, len(sample.prompt_ids) - editable(sample, chunk))


class AccuracyRun:
    """Prefill once, then answer with the baseline and with each policy x ratio."""

    def __init__(self, ctx, completion, samples: list[Sample], decode, *, progress: bool = True,
                 capture: bool = False):
        self.ctx, self.completion, self.samples = ctx, completion, samples
        self.decode_text = decode  # token ids -> text (the model's tokenizer)
        self.progress = progress
        self.capture = capture  # some policy needs queries: the prefill captures them
        self.salts = [f"eval-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(samples))]
        self.max_tokens = max(s.max_tokens for s in samples)
        self._held = None

    def _batch(self, capture: bool = False):
        import kvedit

        batch = kvedit.BatchedStream(progress=self.progress)
        for s, salt in zip(self.samples, self.salts):
            kw = {"capture_queries": query_window(s, self.ctx.chunk_size)} if capture else {}
            batch.add(kvedit.create_request(self.ctx, self.completion, s.prompt_ids,
                                            cache_salt=salt, name=f"{s.task}/{s.length}/{s.index}",
                                            **kw))
        return batch

    def baseline(self) -> tuple[list[dict], dict]:
        """Prefill every sample (chunks stored, queries captured if asked) and decode the
        unedited streams."""
        batch = self._batch(self.capture)
        pre = batch.prefill(greedy(1))
        dec = batch.decode(greedy(self.max_tokens - 1))
        self._held = batch  # keeps the original chunks referenced for the policies
        chunk = self.ctx.chunk_size
        records = [self._record(s, st, Cell(None, 0.0), 1.0) for s, st in zip(self.samples, batch)]
        stored = sum(editable(s, chunk) for s in self.samples)
        return records, {"prefill_s": pre.duration, "decode_s": dec.duration,
                         "prefill_tokens": pre.input_tokens, "stored_tokens": stored}

    def cell(self, policy, cell: Cell) -> tuple[list[dict], dict]:
        """Answers of every sample after `policy` edited its KV."""
        if policy.needs_queries and not self.capture:
            raise ValueError(f"{cell.label} needs captured queries: build AccuracyRun with "
                             "capture=True so the prefill captures them")
        batch = self._batch(policy.needs_queries)
        t0 = time.perf_counter()
        mod = batch.modify(policy)
        chunk = self.ctx.chunk_size
        kept = []
        for s, st in zip(self.samples, batch):
            region = editable(s, chunk)
            tail = len(s.prompt_ids) - region  # the question: never edited
            kept.append(len(st.tokens) + len(st.suffix) - tail)
        dec = batch.decode(greedy(self.max_tokens))
        records = [self._record(s, st, cell, k / editable(s, chunk))
                   for s, st, k in zip(self.samples, batch, kept)]
        self._release(batch)
        total = sum(editable(s, chunk) for s in self.samples)
        return records, {
            "kept_fraction": sum(kept) / total,
            "stored_fraction": mod.tokens_after / mod.tokens_before if mod.tokens_before else None,
            "modify_s": mod.duration, "decode_s": dec.duration,
            "seconds": time.perf_counter() - t0}

    def _record(self, s: Sample, stream, cell: Cell, kept: float) -> dict:
        text = self.decode_text(stream.output_token_ids)
        return {"task": s.task, "length": s.length, "depth": s.depth, "index": s.index,
                "policy": cell.policy, "ratio": cell.ratio, "kept_fraction": kept,
                "ok": s.correct(text), "answer": list(s.answers), "output": text}

    def _release(self, batch) -> None:
        """Delete the edited chunks no other stream references (the originals stay held)."""
        keys = [k for st in batch for k in st.keys]
        dead = self.ctx.unref(keys)
        if dead:
            self.ctx.client.delete(self.ctx.model, dead)

    def close(self) -> None:
        if self._held is not None:
            self._release(self._held)
            release_queries(self._held)
            self._held = None


def release_queries(batch) -> None:
    """The held prefill streams let go of their captured queries (the last holders: the
    objects are deleted from the server; edited streams already let go of theirs)."""
    import asyncio

    from kvedit.sdk.queries import release_queries as release

    async def all_of():
        await asyncio.gather(*(release(st) for st in batch))

    if any(st.queries is not None for st in batch):
        asyncio.run(all_of())

"""The workloads of `kvedit bench serve`, sent to one OpenAI-compatible vLLM (any arm alike).

- long-document QA (as LMCache's `long-doc-qa`): N documents of L tokens; a warm-up round
  asks one question per document, then a query round asks another (same document prefix,
  new question). Prompts go one at a time, so each TTFT is that prompt's alone; the round
  time is the round's wall time.
- multi-round QA (as LMCache's `multi-round-qa`): U users, each with a shared system prompt
  and a history that grows by its question and the answer every round; users run
  concurrently, rounds one after another.
- no reuse: random prompts sent together (nothing to hit): the overhead of each arm.
Prompts are token ids drawn from a seeded generator, so every arm gets the same ones. TTFT
is the time to the first streamed token.
"""
from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workloads:
    docs: int = 12               # long-document QA: documents
    doc_tokens: int = 4096       # ... tokens each (a multiple of the chunk is reusable)
    question_tokens: int = 32
    answer_tokens: int = 8
    users: int = 4               # multi-round QA
    rounds: int = 4
    system_tokens: int = 1024
    user_tokens: int = 128       # each round's new question
    random_prompts: int = 8      # no reuse: prompts sent together
    random_tokens: int = 2048
    vocab: int = 8000            # token ids drawn from [10, vocab)

    def long_doc_tokens(self) -> int:
        """Tokens of every document's KV: the live working set of long-document QA."""
        return self.docs * (self.doc_tokens + self.question_tokens + self.answer_tokens)


def stream(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion -> ttft_s, total_s, output tokens, cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0 = time.perf_counter()
    ttft, usage, text = None, {}, 0
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if msg.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total,
            "output_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] for r in results]
    return {"prompts": len(results), "round_s": wall,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_median_s": statistics.median(ttft),
            "ttft_per_prompt_s": ttft,
            "cached_tokens": sum(r["cached_tokens"] for r in results)}


def long_doc_qa(base_url: str, model: str, w: Workloads, seed: int = 1) -> dict:
    rng = random.Random(seed)
    docs = [_ids(rng, w.doc_tokens, w.vocab) for _ in range(w.docs)]
    rounds = {}
    for name in ("warmup", "query"):
        questions = [_ids(rng, w.question_tokens, w.vocab) for _ in docs]
        t0 = time.perf_counter()
        res = [stream(base_url, model, d + q, w.answer_tokens) for d, q in zip(docs, questions)]
        rounds[name] = _summary(res, time.perf_counter() - t0)
    return rounds


def multi_round_qa(base_url: str, model: str, w: Workloads, seed: int = 2) -> dict:
    rng = random.Random(seed)
    system = _ids(rng, w.system_tokens, w.vocab)
    questions = [[_ids(rng, w.user_tokens, w.vocab) for _ in range(w.rounds)]
                 for _ in range(w.users)]

    def user(u: int) -> list[dict]:
        history, out = list(system), []
        for q in questions[u]:
            prompt = history + q
            r = stream(base_url, model, prompt, w.answer_tokens)
            out.append(r)
            # the answer joins the history (its ids stand in for the generated ones: the
            # next round's prompt then shares the previous prompt as its prefix)
            history = prompt + _ids(random.Random(len(prompt) + u), w.answer_tokens, w.vocab)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(w.users) as pool:
        per_user = list(pool.map(user, range(w.users)))
    wall = time.perf_counter() - t0
    res = [r for rs in per_user for r in rs]
    later = [r for rs in per_user for r in rs[1:]]   # rounds that can reuse a prefix
    out = _summary(res, wall)
    out["ttft_mean_after_first_round_s"] = statistics.fmean(r["ttft_s"] for r in later) \
        if later else None
    return out


def no_reuse(base_url: str, model: str, w: Workloads, seed: int = 3) -> dict:
    rng = random.Random(seed)
    prompts = [_ids(rng, w.random_tokens, w.vocab) for _ in range(w.random_prompts)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        res = list(pool.map(lambda p: stream(base_url, model, p, w.answer_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(map(len, prompts)) + sum(r["output_tokens"] for r in res)
    return {"prompts": len(prompts), "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in res)}

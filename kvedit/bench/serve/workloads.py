"""The workloads of `kvedit bench serve`, sent to one OpenAI-compatible vLLM (any arm alike).

- long-document QA (as LMCache's `long-doc-qa`): N documents of L tokens; a warm-up round
  asks one question per document, then a query round asks another (same document prefix,
  new question). Prompts go one at a time, so each TTFT is that prompt's alone; the round
  time is the sum of its prompts' times.
- multi-round QA (as LMCache's `multi-round-qa`): U users, each with a shared system prompt
  and a history that grows by its question and the answer every round; users run
  concurrently, rounds one after another.
- no reuse: random prompts sent together (nothing to hit): the overhead of each arm.
Every arm is up at once and the workloads alternate between them (each prompt, round or
batch goes to every arm in turn), so load from other work on the machine hits all arms
alike instead of whichever arm ran at a busy moment. Prompts are token ids drawn from a
seeded generator: every arm gets the same ones. TTFT is the time to the first streamed token.
The sizes a run derives from the workloads (the longest prompt, KV bytes per token) are here
too: they need nothing but the workloads and the model's config.json.
"""
from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvedit.bench.http import stream_completion
from kvedit.harness.vocab import fixed_length


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


# ---- sizes ----------------------------------------------------------------------------------
def kv_bytes_per_token(model_dir: Path, dtype: str) -> tuple[int, int]:
    """(KV bytes per token, vocab size) from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    size = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}[dtype]
    kv_heads = cfg.get("num_key_value_heads", heads)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size, int(cfg["vocab_size"])


def max_len(w: Workloads) -> int:
    """vLLM's max model length for `w`: its longest prompt, an answer and slack, in 256s."""
    longest = max(w.doc_tokens + w.question_tokens,
                  w.system_tokens + w.rounds * (w.user_tokens + w.answer_tokens),
                  w.random_tokens)
    return -(-(longest + w.answer_tokens + 64) // 256) * 256


def stream(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion -> ttft_s, total_s, output tokens, cached prompt tokens."""
    return stream_completion(base_url, {"model": model, "prompt": prompt,
                                        **fixed_length(max_tokens)})


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] for r in results]
    return {"prompts": len(results), "round_s": wall,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_median_s": statistics.median(ttft),
            "ttft_per_prompt_s": ttft,
            "cached_tokens": sum(r["cached_tokens"] for r in results)}


def long_doc_qa(targets: dict[str, str], model: str, w: Workloads, seed: int = 1) -> dict:
    """Per arm (name -> base URL): the warm-up and the query round. Each prompt goes to every
    arm in turn before the next prompt, so load from other work hits all arms alike."""
    rng = random.Random(seed)
    docs = [_ids(rng, w.doc_tokens, w.vocab) for _ in range(w.docs)]
    out: dict[str, dict] = {a: {} for a in targets}
    for name in ("warmup", "query"):
        questions = [_ids(rng, w.question_tokens, w.vocab) for _ in docs]
        res: dict[str, list] = {a: [] for a in targets}
        for d, q in zip(docs, questions):
            for arm, url in targets.items():
                res[arm].append(stream(url, model, d + q, w.answer_tokens))
        for arm in targets:   # a round's time: the sum of its prompts' (they ran one by one)
            out[arm][name] = _summary(res[arm], sum(r["total_s"] for r in res[arm]))
    return out


def multi_round_qa(targets: dict[str, str], model: str, w: Workloads, seed: int = 2) -> dict:
    """Per arm: every user's rounds; round r of all users runs on one arm, then on the next."""
    rng = random.Random(seed)
    system = _ids(rng, w.system_tokens, w.vocab)
    questions = [[_ids(rng, w.user_tokens, w.vocab) for _ in range(w.rounds)]
                 for _ in range(w.users)]
    answers = [[_ids(rng, w.answer_tokens, w.vocab) for _ in range(w.rounds)]
               for _ in range(w.users)]
    history = [list(system) for _ in range(w.users)]
    res: dict[str, list[list[dict]]] = {a: [[] for _ in range(w.users)] for a in targets}
    for r in range(w.rounds):
        prompts = [history[u] + questions[u][r] for u in range(w.users)]
        for arm, url in targets.items():
            with ThreadPoolExecutor(w.users) as pool:
                got = list(pool.map(lambda p: stream(url, model, p, w.answer_tokens), prompts))
            for u, g in enumerate(got):
                res[arm][u].append(g)
        # the answer joins the history (fixed ids stand in for the generated ones, so every
        # arm's next prompt is the same and shares the previous prompt as its prefix)
        history = [prompts[u] + answers[u][r] for u in range(w.users)]
    out = {}
    for arm in targets:
        flat = [g for per in res[arm] for g in per]
        later = [g for per in res[arm] for g in per[1:]]   # rounds that can reuse a prefix
        out[arm] = _summary(flat, sum(g["total_s"] for g in flat)) | {
            "ttft_mean_after_first_round_s": statistics.fmean(g["ttft_s"] for g in later)
            if later else None}
    return out


def no_reuse(targets: dict[str, str], model: str, w: Workloads, seed: int = 3) -> dict:
    """Per arm: random prompts sent together, twice (arms in ABBA order), the better run."""
    rng = random.Random(seed)
    batches = [[_ids(rng, w.random_tokens, w.vocab) for _ in range(w.random_prompts)]
               for _ in range(2)]
    runs: dict[str, list[dict]] = {a: [] for a in targets}
    order = list(targets)
    for i, prompts in enumerate(batches):
        for arm in (order if i % 2 == 0 else order[::-1]):
            url = targets[arm]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                res = list(pool.map(lambda p: stream(url, model, p, w.answer_tokens), prompts))
            wall = time.perf_counter() - t0
            tokens = sum(map(len, prompts)) + sum(r["output_tokens"] for r in res)
            runs[arm].append({"wall_s": wall, "tokens_per_s": tokens / wall,
                              "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in res)})
    return {arm: max(rs, key=lambda r: r["tokens_per_s"]) | {"prompts": w.random_prompts,
                                                               "runs": rs}
            for arm, rs in runs.items()}

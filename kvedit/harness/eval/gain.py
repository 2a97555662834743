"""The throughput half of `kvedit eval`: decode gain of each policy x ratio, KV-bound.

As `kvedit bench dropping` measures it (kvedit.harness.experiment): N prompts of P random
token ids, O output tokens each (ignore_eos, so every arm decodes N·O tokens), on a vLLM
whose KV capacity C is set so the baseline decode is KV-memory-bound. The gain is the dropped
arm's decode throughput over the baseline's; `step_gain` is decode tokens per vLLM engine
step (free of CPU contention from other processes, which the wall-clock gain is not);
`bound` is the baseline's number of decode waves over the dropped arm's (GainConfig).

The arms run on their own vLLM (the accuracy cells need a roomy KV cache, this one a tight
one), against the same kvedit server. Kept short: the prompts are prefilled once; every arm
is a fresh set of streams of the same prompts and salt that find those chunks in the kvedit
server, so an arm costs its modify and its decode. The decode of a KV-bound batch depends on
how many KV tokens each request holds, not on which: policies that keep the same number of
tokens (all of them at token granularity and one ratio) share one arm unless every cell is
asked for (`kvedit eval --gain-each`); the JSON names the arm each gain comes from. The
baseline arm runs first and last; its mean is the reference (a slow drift on
a shared machine hits both halves alike). When an arm's policy scores from captured queries,
the prefill captures the last `QUERY_WINDOW` prompt tokens' queries (the prompts are random
tokens with no question; the rows lie inside the edited KV) and that arm's streams ask for
the same object.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvedit.harness.eval.runner import release_queries
from kvedit.harness.vocab import (
    at_once, blocks, counter_delta as _delta, fixed_length as sampling, vllm_counters, wave_bound,
)

QUERY_WINDOW = 32  # rows captured for query-aware arms (no question in random prompts)


@dataclass
class GainConfig:
    """N prompts of P tokens, O output tokens, KV capacity C blocks. Requests decode the same
    number of tokens, so a batch drains in waves of as many requests as fit at once, and the
    gain is (baseline waves) / (dropped waves). Sizes keep every request in the blocks it is
    admitted with (P a multiple of 128, O < 128: vLLM never has to grow, and so never
    preempts, a running request): P + O = 544 tokens = 5 blocks; kept at r = 0.25 / 0.5 /
    0.75 is 4 / 3 / 2 blocks. With C = 12 blocks, 2 baseline requests decode at once (6
    waves of 12) and 3 / 4 / 6 dropped ones (4 / 3 / 2 waves): bounds 1.5, 2.0, 3.0. Small,
    because SmolLM2 decodes ~10-40 tokens/s on two busy cores."""
    num_prompts: int = 12
    prompt_len: int = 512
    max_tokens: int = 32
    kv_blocks: int = 12
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_prompts", "prompt_len", "max_tokens", "kv_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"gain {name} must be positive, got {getattr(self, name)}")

    def prompts(self) -> list[list[int]]:
        from kvedit.harness.vocab import Workload

        return Workload(self.num_prompts, self.prompt_len, self.max_tokens,
                        seed=self.seed).prompts()

    def at_once(self, tokens: float, block: int) -> int:
        """Requests of `tokens` (prompt + output) that fit in the capacity at once."""
        return int(at_once(self.num_prompts, self.kv_blocks, blocks(tokens, block)))

    def bound(self, kept_tokens: float, block: int) -> float:
        """Baseline waves over dropped waves: the most the decode can gain."""
        full = self.prompt_len + self.max_tokens
        if self.at_once(full, block) == 0:
            raise ValueError(f"gain: KV capacity {self.kv_blocks} blocks cannot hold one "
                             f"request of {full} tokens")
        return wave_bound(self.num_prompts, self.kv_blocks, blocks(full, block),
                          blocks(kept_tokens + self.max_tokens, block))


class GainRun:
    def __init__(self, ctx, completion, vllm_url: str, cfg: GainConfig, block: int, *,
                 progress: bool = True, capture: bool = False):
        self.ctx, self.completion, self.vllm_url, self.cfg = ctx, completion, vllm_url, cfg
        self.block, self.progress = block, progress
        self.capture = capture  # some arm's policy needs queries: the prefill captures them
        self.prompts = cfg.prompts()
        self.salt = f"gain-{uuid.uuid4().hex[:8]}"
        self._held = None
        self.baselines: list[dict] = []

    def _batch(self, capture: bool = False):
        import kvedit

        kw = {"capture_queries": QUERY_WINDOW} if capture else {}
        batch = kvedit.BatchedStream(progress=self.progress)
        for p in self.prompts:
            batch.add(kvedit.create_request(self.ctx, self.completion, p, cache_salt=self.salt,
                                            **kw))
        return batch

    def prefill(self) -> dict:
        self._held = self._batch(self.capture)
        m = self._held.prefill(sampling(1))
        return {"prefill_s": m.duration, "prefill_tput": m.input_tput}

    def arm(self, policy=None) -> dict:
        """Decode the prompts (edited by `policy` if given): throughput and engine steps."""
        needs = policy is not None and policy.needs_queries
        if needs and not self.capture:
            raise ValueError(f"{type(policy).__name__} needs captured queries: build GainRun "
                             "with capture=True")
        batch = self._batch(needs)
        out: dict = {}
        if policy is not None:
            out["modify_s"] = batch.modify(policy).duration
        kept = sum(len(s.tokens) + len(s.suffix) for s in batch) / len(batch)
        before = vllm_counters(self.vllm_url)
        dec = batch.decode(sampling(self.cfg.max_tokens))
        e = _delta(before, vllm_counters(self.vllm_url)) or {}
        steps = e.get("steps") or 0
        out.update(decode_tput=dec.output_tput, decode_s=dec.duration, kept_tokens=kept,
                   tokens_per_step=e["generated"] / steps if steps else None,
                   preemptions=e.get("preemptions"), bound=self.cfg.bound(kept, self.block))
        dead = self.ctx.unref([k for s in batch for k in s.keys])
        if dead:
            self.ctx.client.delete(self.ctx.model, dead)
        if policy is None:
            self.baselines.append(out)
        return out

    def reference(self) -> dict:
        """Mean of the baseline arms run so far."""
        n = len(self.baselines)
        tps = [b["tokens_per_step"] for b in self.baselines if b["tokens_per_step"]]
        return {"decode_tput": sum(b["decode_tput"] for b in self.baselines) / n,
                "tokens_per_step": sum(tps) / len(tps) if tps else None,
                "rounds": [b["decode_tput"] for b in self.baselines]}

    @staticmethod
    def gains(arm: dict, ref: dict) -> dict:
        step = (arm["tokens_per_step"] / ref["tokens_per_step"]
                if arm["tokens_per_step"] and ref["tokens_per_step"] else None)
        return {"decode_gain": arm["decode_tput"] / ref["decode_tput"], "step_gain": step,
                "decode_gain_bound": arm["bound"], "decode_tput": arm["decode_tput"],
                "decode_tokens_per_step": arm["tokens_per_step"],
                "preemptions": arm["preemptions"]}

    def close(self) -> None:
        if self._held is not None:
            dead = self.ctx.unref([k for s in self._held for k in s.keys])
            if dead:
                self.ctx.client.delete(self.ctx.model, dead)
            release_queries(self._held)
            self._held = None

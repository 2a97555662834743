"""The experiment vocabulary, written once: greedy sampling, tokens per engine step, a policy by
name, a workload and its KV bound, a model by name.

`kvedit bench`, `kvedit eval` and `kvedit demo` all speak these words; each used to write its
own copy, and copies drift (one bench decoding to EOS where another ignored it, one bound
counted in tokens where another counted in blocks). This module imports nothing of kvedit at
its top beyond the stdlib, so every command room can import it without a circle.
"""
from __future__ import annotations

import random
import re
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path

# --- greedy sampling -----------------------------------------------------------------------


def greedy(max_tokens: int) -> dict:
    """Greedy sampling params for `Stream.prefill`/`decode`/`run`: stops at EOS or max_tokens."""
    return {"max_tokens": max_tokens, "temperature": 0.0}


def fixed_length(max_tokens: int) -> dict:
    """Greedy and ignore_eos: every request decodes exactly max_tokens tokens, so arms that
    are compared decode the same amount of work."""
    return {**greedy(max_tokens), "ignore_eos": True}


# --- tokens per engine step ----------------------------------------------------------------

# vLLM counters read around each phase. Engine steps make a measure free of CPU contention:
# a KV bound limits how many requests one step decodes, so tokens per step is what it limits.
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "steps": "vllm:iteration_tokens_total_count",
    "step_tokens": "vllm:iteration_tokens_total_sum",
    "generated": "vllm:generation_tokens_total",
    "prompt_computed": 'vllm:prompt_tokens_by_source_total{source="local_compute"}',
}


def vllm_counters(vllm_url: str) -> dict[str, float] | None:
    """The COUNTERS from vLLM's /metrics, summed over engines (None if unreadable)."""
    try:
        with urllib.request.urlopen(f"{vllm_url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for key, name in COUNTERS.items():
        metric, _, label = name.partition("{")
        pattern = rf"^{re.escape(metric)}\{{([^}}]*)\}}\s+([0-9.eE+-]+)$"
        out[key] = sum(float(v) for labels, v in re.findall(pattern, text, re.M)
                       if not label or label.rstrip("}") in labels)
    return out


def counter_delta(before, after) -> dict[str, float] | None:
    """after - before per counter (None when either snapshot was unreadable)."""
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}


def steps_of(delta: dict | None) -> dict:
    """Engine steps, tokens generated, preemptions, prompt tokens recomputed and decode tokens
    per engine step (how many requests decode at once, on average) from a counter delta."""
    if not delta:
        return {"steps": None, "generated": None, "preemptions": None,
                "prompt_tokens_computed": None, "tokens_per_step": None}
    steps = delta.get("steps") or 0
    return {"steps": steps, "generated": delta["generated"],
            "preemptions": delta.get("preemptions"),
            "prompt_tokens_computed": delta.get("prompt_computed"),
            "tokens_per_step": delta["generated"] / steps if steps else None}


def engine_steps(before, after) -> dict:
    """steps_of the counters read before and after a phase."""
    return steps_of(counter_delta(before, after))


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, None when either is missing or zero (a gain of two measured figures)."""
    return num / den if num and den else None


# --- a workload and its KV bound -----------------------------------------------------------

FILL = 0.55  # engine KV capacity as a fraction of all requests' full length (the anchor's)
TOKEN_RANGE = (100, 8192)  # below every real vocab size, above the tiny model's specials


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids from TOKEN_RANGE (the same for the same seed)."""
    rng = random.Random(seed)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(n)]


def at_once(n: int, capacity: float, footprint: float) -> float:
    """How many of n sequences of `footprint` KV tokens one engine step can decode when the
    engine holds `capacity` tokens: the KV bound on decode tokens per step."""
    return min(n, capacity / footprint)


def decode_bound(n: int, capacity: float, full: float, kept: float) -> float:
    """Most an edit that shrinks each sequence from `full` to `kept` KV tokens can gain in
    decode: how many more sequences fit at once."""
    return at_once(n, capacity, kept) / at_once(n, capacity, full)


def blocks(tokens: float, block: int) -> int:
    """Whole KV blocks of `block` tokens that a sequence of `tokens` tokens occupies."""
    return -(-int(tokens) // block)


def waves(n: int, capacity_blocks: int, request_blocks: int) -> int:
    """Decode waves n requests of `request_blocks` blocks each drain in, the engine holding
    `capacity_blocks`: requests that decode the same number of tokens finish together, so a
    batch drains in waves of as many whole requests as fit at once."""
    fit = int(at_once(n, capacity_blocks, request_blocks))
    if fit == 0:
        raise ValueError(f"KV capacity {capacity_blocks} blocks cannot hold one request of "
                         f"{request_blocks} blocks")
    return -(-n // fit)


def wave_bound(n: int, capacity_blocks: int, full_blocks: int, kept_blocks: int) -> float:
    """decode_bound in whole blocks and whole waves: baseline waves over dropped waves (for
    arms whose requests all decode the same number of tokens)."""
    return waves(n, capacity_blocks, full_blocks) / waves(n, capacity_blocks, kept_blocks)


@dataclass
class Workload:
    """N prompts of P random token ids, O output tokens each, drop ratio r."""
    num_prompts: int = 8
    prompt_len: int = 2048
    max_tokens: int = 768
    ratio: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_prompts", "prompt_len", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio}")

    def prompts(self) -> list[list[int]]:
        return random_prompts(self.num_prompts, self.prompt_len, self.seed)

    def capacity(self, fill: float = FILL) -> int:
        """KV tokens that make decode memory-bound: fill · N · (P + O)."""
        return int(fill * self.num_prompts * (self.prompt_len + self.max_tokens))

    def bound(self, capacity: int) -> float:
        """Most the decode can gain: how many more requests fit at once."""
        p, o = self.prompt_len, self.max_tokens
        return decode_bound(self.num_prompts, capacity, p + o, p * (1 - self.ratio) + o)


# --- a policy by name ----------------------------------------------------------------------

# Short names the benchmarks' command lines use, beside the registry's keys and class names.
POLICY_ALIASES = {"streaming": "streaming_llm", "keynorm": "key_norm",
                  "anchored": "prompt_anchored"}


def policy_key(name: str) -> str:
    """The kvedit.edits.POLICIES key for a registry key, a short alias or a class name
    (any case: KeyNorm, keynorm)."""
    from kvedit.edits import POLICIES

    if name in POLICIES:
        return name
    by_class = {cls.__name__.lower(): key for key, cls in POLICIES.items()}
    key = POLICY_ALIASES.get(name) or by_class.get(name.lower())
    if key is None:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)} "
                         f"(or {sorted(POLICY_ALIASES)}, or a class name)")
    return key


def policy(name: str, *, sink: int | None = None, **options):
    """The policy called `name` (see policy_key) built with `options` (ratio, granularity,
    ...). `sink` (tokens kept whole at the start, e.g. a prompt's header) goes only to the
    policies that have that option; None leaves each policy its own default."""
    from kvedit.edits import POLICIES

    cls = POLICIES[policy_key(name)]
    if sink is not None and any(f.name == "sink" for f in fields(cls)):
        options["sink"] = sink
    return cls(**options)


# --- a model by name -----------------------------------------------------------------------

TINY_SERVED = "tiny-qwen3"  # the name vLLM serves the tiny model as


def resolve_model(name: str) -> tuple[Path, str]:
    """(model dir, served name) for a packaged model (`kvedit.harness.models.MODELS`: smollm2,
    qwen2.5-coder-1.5b; built on first use), tiny or a model dir."""
    from kvedit.harness.models import MODELS, build_packaged

    if name in MODELS:
        return Path(build_packaged(MODELS[name])), name
    if name == "tiny":
        from kvedit.harness.tiny_model import default_tiny_model

        return Path(default_tiny_model()), TINY_SERVED
    path = Path(name)
    if not path.is_dir():
        raise SystemExit(f"--model {name!r}: expected one of {sorted(MODELS)}, tiny or a model "
                         "directory")
    return path, path.name

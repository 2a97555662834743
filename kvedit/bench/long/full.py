"""The `vllm_full` arm of `kvedit bench long`: plain vLLM decoding the same requests with
their full KV, the arm a user compares kvedit's budgets with.

Plain means: the same vLLM build, model, dtype, KV pool (blocks) and max_model_len as the
kvedit arms, prefix caching on, and no kvedit connector or server at all (with the
connector attached, its stores would cost time that vLLM alone does not spend). Every
request is sent at once, as one completion of O tokens (greedy, ignore_eos), so vLLM admits
what its pool holds and preempts and recomputes as the sequences outgrow it.

Figures, as the other arms': decode throughput (output tokens over the arm's wall time,
prefill included), tokens per engine step and preemptions (vLLM's counters), and requests in
flight (vLLM's `num_requests_running` gauge, sampled while the arm runs: `InFlight`).
"""
from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request

from kvedit.harness.experiment import block_size, cpu_seconds, plain_vllm
from kvedit.harness.vocab import engine_steps, fixed_length, vllm_counters
from kvedit.sdk.openai import openai_completion


class InFlight:
    """Samples vLLM's running-requests gauge every `every` s from a thread while in use:
    the mean and the most requests it decoded at once."""

    def __init__(self, vllm_url: str, every: float = 0.25):
        self.url, self.every = f"{vllm_url}/metrics", every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            found = re.findall(r"^vllm:num_requests_running\{[^}]*\}\s+([0-9.eE+-]+)$",
                               text, re.M)
            if found:
                self.samples.append(sum(float(x) for x in found))

    def __enter__(self) -> "InFlight":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        busy = [x for x in self.samples if x > 0]
        return {"mean_running": sum(busy) / len(busy) if busy else None,
                "max_running": max(busy) if busy else None, "samples": len(self.samples)}


async def _complete_all(post, prompts, sampling, label: str) -> list[list[int]]:
    """Every prompt at once, one completion each; a salt per arm and prompt, so no arm hits
    another's blocks in vLLM's prefix cache."""
    async def one(i, p):
        return [e.token_id async for e in post(p, sampling, f"{label}-{i}")]

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await post.aclose()


# A request queued behind the pool's full working set streams nothing until a stream ahead
# of it ends: on a CPU that is many minutes, past the SDK's default 600 s between reads.
READ_TIMEOUT_S = 4 * 3600.0


def completion(url: str, model: str):
    """The bench's OpenAI completion: as the SDK's, with a read timeout long enough for a
    request that waits its turn under KV pressure."""
    return openai_completion(url, model, read_timeout=READ_TIMEOUT_S)


def _requests(url: str, model: str, prompts, sampling, label: str) -> list[list[int]]:
    return asyncio.run(_complete_all(completion(url, model), prompts, sampling, label))


def flow(eng, prompts: list[list[int]], max_tokens: int, *, two_phase: bool,
         label: str) -> dict:
    """One arm on a running engine `eng` (harness.experiment.Engines), its requests sent by
    plain OpenAI completions (no SDK, no kvedit server calls):
    - one phase (`two_phase` False): every prompt at once as one completion of O tokens, what
      a user of plain vLLM sends;
    - two phases: every prompt at once with max_tokens 1 (the prefill), then every prompt
      plus its first token at once with O more: the flow kvedit's SDK arms use (prefill every
      stream, then decode), so with the same flow on both engines the connector's own cost
      and the flow's cost are two figures (`kvedit bench long`'s docstring).
    The figures: the same fields as the kvedit arms' where they apply."""
    before, cpu0 = vllm_counters(eng.vllm_url), cpu_seconds(eng.pids)
    t0 = time.perf_counter()
    with InFlight(eng.vllm_url) as running:
        if two_phase:
            first = _requests(eng.vllm_url, eng.model, prompts, fixed_length(1), label)
            sent = [p + f for p, f in zip(prompts, first)]
            rest = _requests(eng.vllm_url, eng.model, sent, fixed_length(max_tokens), label)
            outputs = [f + r for f, r in zip(first, rest)]
        else:
            sent = prompts
            outputs = _requests(eng.vllm_url, eng.model, prompts, fixed_length(max_tokens),
                                label)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(eng.pids) - cpu0
    steps = engine_steps(before, vllm_counters(eng.vllm_url))
    out = {"flow": "two_phase" if two_phase else "one_phase", "wall_s": wall, "cpu_s": cpu,
           "output_tokens": sum(map(len, outputs)), **steps, **running.summary(),
           "max_request_tokens": max(len(p) + len(o) for p, o in zip(prompts, outputs))}
    out["decode_tput"] = out["output_tokens"] / wall
    out["tokens_per_cpu_s"] = out["output_tokens"] / cpu if cpu else None
    # every token computed over the whole sequence before it: P + i for the i-th
    n = sum(len(o) for o in outputs)
    out["mean_footprint_tokens"] = sum(len(p) + i for p, o in zip(prompts, outputs)
                                       for i in range(len(o))) / n if n else 0.0
    bs = block_size()
    out["mean_footprint_blocks"] = sum(-(-(len(p) + i) // bs) for p, o in zip(prompts, outputs)
                                       for i in range(len(o))) / n if n else 0.0
    out["outputs"] = outputs
    return out


def warm(eng, prompt: list[int]) -> None:
    """One short request, so the arm that follows pays no first-call costs."""
    _requests(eng.vllm_url, eng.model, [prompt[:64]], fixed_length(4), "warm")


def arm(prompts: list[list[int]], max_tokens: int, *, model: str | None, served: str,
        dtype: str, kv_tokens: int, max_model_len: int, vllm_args=(), log=print,
        two_phase: bool = True) -> dict:
    """Start plain vLLM, warm it up, run `flow` one phase (`vllm_full`) and, with
    `two_phase`, two phases (`vllm_two_phase`) on fresh salts. Returns {arm: figures} and
    "engine_config", the engine's effective settings (`engine_config`)."""
    out = {}
    with plain_vllm(model=model, served_model_name=served, dtype=dtype, kv_tokens=kv_tokens,
                    max_model_len=max_model_len, vllm_args=vllm_args, log=log) as eng:
        out["engine_config"] = engine_config(eng.log_path)
        warm(eng, prompts[0])
        log(f"vllm_full: N={len(prompts)} O={max_tokens}, plain vLLM, one phase, KV capacity "
            f"{kv_tokens} tokens ...")
        out["vllm_full"] = flow(eng, prompts, max_tokens, two_phase=False, label="vllm-full")
        if two_phase:
            log("vllm_two_phase: plain vLLM, prefill every prompt, then decode ...")
            out["vllm_two_phase"] = flow(eng, prompts, max_tokens, two_phase=True,
                                         label="vllm-two-phase")
    return out


# --- the engines' effective settings --------------------------------------------------------

# What vLLM logs at start: the arguments that differ from its defaults (API server) and the
# engine's resolved config (engine core). Keys that name the engine's connector, port or a
# random id are the connector's business or per-start: left out of the comparison.
_ARGS = re.compile(r"non-default args: \{(.*)\}\s*$")
_CONFIG = re.compile(r"with config: (.*)$")
NOT_COMPARED = ("kv_transfer_config", "port", "engine_id")


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append("".join(cur))
            cur, i = [], i + len(sep)
            continue
        cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def engine_config(log_path) -> dict[str, str]:
    """{setting: value as vLLM printed it} from a vLLM log: the non-default arguments
    ("args.<name>") and the engine's resolved config ("config.<name>")."""
    out: dict[str, str] = {}
    if log_path is None:
        return out
    with open(log_path, errors="replace") as f:
        for line in f:
            if (m := _ARGS.search(line)) and not any(k.startswith("args.") for k in out):
                for part in _split_top(m[1], ", "):
                    key, _, value = part.partition(": ")
                    out[f"args.{key.strip(chr(39))}"] = value
            elif (m := _CONFIG.search(line)) and not any(k.startswith("config.") for k in out):
                for part in _split_top(m[1], ", "):
                    key, _, value = part.partition("=")
                    out[f"config.{key}"] = value
    return out


def config_differences(a: dict[str, str], b: dict[str, str]) -> dict[str, list]:
    """The settings two engines' `engine_config` disagree on, but for NOT_COMPARED:
    {setting: [a's, b's]} (None where one engine did not print it)."""
    keys = sorted(set(a) | set(b))
    return {k: [a.get(k), b.get(k)] for k in keys
            if k.split(".", 1)[1] not in NOT_COMPARED and a.get(k) != b.get(k)}

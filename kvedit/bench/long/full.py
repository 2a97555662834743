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


async def _complete_all(post, prompts, sampling) -> list[list[int]]:
    async def one(i, p):
        return [e.token_id async for e in post(p, sampling, f"vllm-full-{i}")]

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await post.aclose()


def arm(prompts: list[list[int]], max_tokens: int, *, model: str | None, served: str,
        dtype: str, kv_tokens: int, max_model_len: int, vllm_args=(), log=print) -> dict:
    """Start plain vLLM, warm it up with one short request, run every prompt at once; the
    arm's figures (the same fields as the kvedit arms' where they apply)."""
    from kvedit.harness.experiment import block_size, cpu_seconds, plain_vllm
    from kvedit.harness.vocab import engine_steps, fixed_length, vllm_counters
    from kvedit.sdk.openai import openai_completion

    with plain_vllm(model=model, served_model_name=served, dtype=dtype, kv_tokens=kv_tokens,
                    max_model_len=max_model_len, vllm_args=vllm_args, log=log) as eng:
        asyncio.run(_complete_all(openai_completion(eng.vllm_url, eng.model),
                                  [prompts[0][:64]], fixed_length(4)))
        log(f"vllm_full: N={len(prompts)} O={max_tokens}, plain vLLM, KV capacity "
            f"{kv_tokens} tokens ...")
        before, cpu0 = vllm_counters(eng.vllm_url), cpu_seconds(eng.pids)
        t0 = time.perf_counter()
        with InFlight(eng.vllm_url) as running:
            outputs = asyncio.run(_complete_all(openai_completion(eng.vllm_url, eng.model),
                                                prompts, fixed_length(max_tokens)))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(eng.pids) - cpu0
        steps = engine_steps(before, vllm_counters(eng.vllm_url))
    out = {"wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, outputs)),
           **steps, **running.summary(),
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

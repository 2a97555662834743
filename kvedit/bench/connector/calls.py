"""Engine calls the connector benchmarks share: one completion, a batch's prefill throughput,
a process tree's CPU seconds. A module of its own so `bench connector` (run.py), its
`--kv-events` arm (events.py) and `bench l2 --vllm` (kvedit/bench/l2/paths.py) call the same
code, none importing another."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from kvedit.bench.http import post_json
from kvedit.harness.vocab import greedy
from kvedit.request_params import RequestAsks


def complete_one(vp, prompt: list[int], capture: int = 0) -> tuple[float, dict]:
    """One max_tokens=1 request; `capture` > 0 asks for its last `capture` queries."""
    body = {"model": vp.model, "prompt": prompt, **greedy(1)}
    if capture:
        body["kv_transfer_params"] = RequestAsks(capture=capture).to_params()
    t0 = time.perf_counter()
    r = post_json(vp.base_url + "/v1/completions", body)
    return time.perf_counter() - t0, r["usage"]


def prefill_tput(vp, prompts: list[list[int]], capture: int = 0) -> float:
    """Tokens/s of prefilling `prompts` sent at once (vLLM batches them)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: complete_one(vp, p, capture), prompts))
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its descendants (vLLM's API server and
    engine core): what a batch cost in work, much less disturbed by other load on a shared
    machine than its wall time."""
    import psutil  # a vLLM dependency; here so that `bench l2` (paths.py) runs without it

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total

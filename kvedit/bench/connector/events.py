"""`kvedit bench connector --kv-events`: what publishing the kvedit tier in vLLM's KV events
costs, and whether its removals are exact after evictions.

Two vLLMs on the tiny model (default), both with vLLM's own KV events on (--kv-events-config,
ipc endpoints) and the kvedit connector storing every chunk into one kvedit server; they
differ only in the connector's "kv_events" (on / off). Measured in alternation, fresh prompts
each time (no prefix hit anywhere), so machine noise hits both sides of each ratio alike:
- prefill_throughput_vs_off: tokens/s of `prompts` prompts sent together, on / off, pairs in
  ABBA order; the median of the pair ratios. Target >= 0.98.
- ttft_vs_off: a single fresh prompt's max_tokens=1 latency, on / off, alternating; the median
  of the pair ratios.
- where the time goes: each arm's kvedit scheduler hooks per step and, on the events arm,
  take_events (from the connector's stats lines in vLLM's log).
- exactness: the server's pool holds a fraction of what both arms store, so it evicts; a
  subscriber on the events arm's publisher (from seq 0, gaps filled by replay) applies every
  batch as a router would (kvedit.harness.kv_index); at the end the CPU blocks it holds are
  compared with the server, chunk by chunk over every prompt sent to that arm:
  removed_missing (announced, gone from the server, never removed), removed_extra (removed
  though the server still holds it, or a removal without a store), stored_missing (held by
  the server, never announced). Targets 0, 0, 0.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time

from kvedit.bench.connector.calls import complete_one as _complete
from kvedit.bench.connector.calls import prefill_tput as _prefill_tput
from kvedit.bench.connector.calls import tree_cpu_seconds as _tree_cpu_seconds
from kvedit.bench.http import post_json
from kvedit.client import KVClient
from kvedit.harness.kv_index import EngineView, Subscriber, block_hashes
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.keys import request_keys
from kvedit.launch.server import start_server
from kvedit.launch.vllm import kv_transfer_config, start_vllm
from kvedit.vllm.scheduler_stats import scheduler_counters

BLOCK = 128   # vLLM's block size on the CPU


def run(args) -> int:
    result = events_bench(args.tokens, args.prompts, args.rounds, model=args.model,
                          dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                          server_gb=args.server_gb or 0.25, vllm_args=args.vllm_arg)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def events_bench(tokens: int, n_prompts: int, rounds: int, *, model: str | None = None,
                 dtype: str = "float32", kv_cache_gib: float = 1.0, server_gb: float = 0.25,
                 vllm_args=(), singles: int = 4) -> dict:
    rng = random.Random(0)
    sent: list[list[int]] = []        # every prompt sent to the events arm

    def fresh() -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(tokens)]

    with tempfile.TemporaryDirectory(prefix="kvedit-events-") as d, \
            start_server(server_gb, chunk_size=256) as server:
        ends = {arm: (f"ipc://{d}/{arm}-pub", f"ipc://{d}/{arm}-replay") for arm in ("on", "off")}
        sub = Subscriber(*ends["on"], topic="kv", from_seq=0)
        view = EngineView()

        def engine(arm: str):
            conn = kv_transfer_config(server.url, server.http_url, extra_config={
                "kv_events": arm == "on", "stats_interval_s": 1.0})
            ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ends[arm][0],
                  "replay_endpoint": ends[arm][1], "topic": "kv"}
            return start_vllm(model or default_tiny_model(), server=None, dtype=dtype,
                              served_model_name=f"tiny-{arm}", dev_mode=True,
                              kv_cache_gib=kv_cache_gib, max_model_len=max(8192, tokens + 16),
                              extra_args=[*vllm_args, "--kv-transfer-config", conn,
                                          "--kv-events-config", json.dumps(ev)])

        with engine("on") as on, engine("off") as off, KVClient(server.url) as client:
            print("kvedit bench connector --kv-events: engines up, measuring", file=sys.stderr)
            arms = {"on": on, "off": off}

            def batch(arm: str, prompts=None) -> list[list[int]]:
                prompts = prompts or [fresh() for _ in range(n_prompts)]
                if arm == "on":
                    sent.extend(prompts)
                return prompts

            for arm in arms:   # warm-up: first requests pay one-off costs
                _prefill_tput(arms[arm], batch(arm, [fresh() for _ in range(2)]))
            tput: dict[str, list[float]] = {"on": [], "off": []}
            ttft: dict[str, list[float]] = {"on": [], "off": []}
            cpu: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(rounds):
                for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    c0 = _tree_cpu_seconds(arms[arm].pid)
                    tput[arm].append(_prefill_tput(arms[arm], batch(arm)))
                    cpu[arm].append(_tree_cpu_seconds(arms[arm].pid) - c0)
                for i in range(singles):
                    for arm in (("off", "on") if (r + i) % 2 == 0 else ("on", "off")):
                        ttft[arm].append(_complete(arms[arm], batch(arm, [fresh()])[0])[0])
                for _, b in sub.poll(0.0):
                    view.apply(b)
            check = _exactness(on, sub, view, client, sent)
            logs = {arm: arms[arm].log_path.read_text() for arm in arms}
        sub.close()
    return _report(tokens, n_prompts, rounds, model, dtype, server_gb, tput, ttft, cpu, check,
                   logs)


def _exactness(vp, sub, view, client, sent: list[list[int]], settle_s: float = 60.0) -> dict:
    """Flush the events arm (events leave with an engine step) until its CPU view stops
    changing and matches the server, or `settle_s` passes; then count what differs."""
    layout = client.get_layout(vp.model)
    chunk = layout.chunk_size
    per_prompt = [(request_keys(vp.model, layout, p), block_hashes(p, BLOCK)) for p in sent]

    def truth() -> tuple[set, int, int]:
        held, evicted, n = set(), 0, 0
        for keys, hashes in per_prompt:
            per = chunk // BLOCK
            for i, k in enumerate(keys):
                n += 1
                if client.lookup(vp.model, [k]) == 1:
                    held.update(hashes[i * per:(i + 1) * per])
                else:
                    evicted += 1
        return held, evicted, n

    deadline = time.monotonic() + settle_s
    while True:
        post_json(vp.base_url + "/v1/completions",
                  {"model": vp.model, "prompt": [1, 2, 3], "max_tokens": 1})
        for _, b in sub.poll(0.5):
            view.apply(b)
        held, evicted, chunks = truth()
        if view.holds("CPU") == held or time.monotonic() > deadline:
            break
    cpu, ever = view.holds("CPU"), view.ever.get("CPU", set())
    return {"chunks_stored": chunks, "evicted_chunks": evicted, "held_chunks": chunks - evicted,
            "announced_blocks": view.stored["CPU"], "removed_blocks": view.removed["CPU"],
            "removed_missing": len(cpu - held),
            "removed_extra": len((held & ever) - cpu) + len(view.removed_unknown),
            "stored_missing": len(held - ever), "stored_twice": len(view.stored_twice),
            "orphans": len(view.orphans), "malformed": len(view.malformed),
            "clears": view.clears, "batches_replayed": sub.replayed}


def _per_step(log: str) -> dict:
    c = scheduler_counters(log)
    steps = c.get("steps") or 1
    return {"steps": int(c.get("steps", 0)), "hooks_ms_per_step": c.get("hooks_ms", 0) / steps,
            "take_events_ms_per_step": c.get("events_ms", 0.0) / steps}


def _report(tokens, n_prompts, rounds, model, dtype, server_gb, tput, ttft, cpu, check,
            logs) -> dict:
    med = statistics.median
    pairs = [a / b for a, b in zip(tput["on"], tput["off"])]
    ttft_pairs = [a / b for a, b in zip(ttft["on"], ttft["off"])]
    return {
        "prompt_tokens": tokens, "prompts_per_round": n_prompts, "rounds": rounds,
        "model": str(model or "tiny-qwen3"), "dtype": dtype, "server_gb": server_gb,
        "kv_events": {
            "prefill_throughput_vs_off": med(pairs), "prefill_pair_ratios": pairs,
            "prefill_median_tok_s_on": med(tput["on"]),
            "prefill_median_tok_s_off": med(tput["off"]),
            "prefill_cpu_s_per_batch_on_vs_off": med(a / b for a, b in zip(cpu["on"], cpu["off"])),
            "ttft_vs_off": med(ttft_pairs), "ttft_median_s_on": med(ttft["on"]),
            "ttft_median_s_off": med(ttft["off"]),
            "scheduler_on": _per_step(logs["on"]), "scheduler_off": _per_step(logs["off"]),
            **check},
        "targets": {"kv_events.prefill_throughput_vs_off": ">= 0.98",
                    "kv_events.removed_missing": "== 0", "kv_events.removed_extra": "== 0"},
    }

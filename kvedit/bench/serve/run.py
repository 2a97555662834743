"""`kvedit bench serve` from start to end: the sizes from the model and the workloads, every
arm up at once, the workloads measured on all of them in alternation (--repeats times, within
--deadline-s), the JSON after every run (--out).

Heavy on purpose (vLLM is imported for its version): cli.py loads it when the command runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import vllm

from kvedit.bench.http import post_json
from kvedit.bench.serve.arms import MODEL_NAME, ArmUnavailable, degraded, start_arm
from kvedit.bench.serve.counters import connector_counters, moved, server_counters
from kvedit.bench.serve.figures import result_json
from kvedit.bench.serve.workloads import (Workloads, kv_bytes_per_token, long_doc_qa, max_len,
                                          multi_round_qa, no_reuse)
from kvedit.harness.tiny_model import default_tiny_model


def main(args, arms: list[str]) -> int:
    """The command, its options checked by cli.py: print the JSON (and write it to --out)."""
    w = Workloads(**{f: getattr(args, f) for f in Workloads.__dataclass_fields__
                     if hasattr(args, f)})

    def write(result: dict) -> None:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)   # a reader never sees half a file

    result = serve_bench(w, arms, model=args.model, dtype=args.dtype,
                         tier_fraction=args.tier_fraction,
                         vllm_kv_fraction=args.vllm_kv_fraction, eviction=args.eviction,
                         chunk=args.chunk_size, repeats=args.repeats,
                         lmcache_python=args.lmcache_python, vllm_args=args.vllm_arg,
                         connector_config=args.connector_config, deadline_s=args.deadline_s,
                         on_result=write if args.out else None)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def measure(targets: dict[str, str], w: Workloads, seed: int = 0,
            servers: dict[str, str] | None = None,
            logs: dict[str, Path] | None = None) -> dict[str, dict]:
    """Every workload on every running arm (name -> base URL), alternating between arms;
    vLLM's prefix cache is reset on every arm before each workload. `servers` (arm -> its
    kvedit server's HTTP address): each workload's figures get "server", what the counters
    moved by while it ran. `logs` (arm -> its vLLM log): each workload's figures get
    "connector", what the connector's stats lines moved by (to within their interval: the
    last second of a workload may count in the next)."""
    servers, logs = servers or {}, logs or {}
    out: dict[str, dict] = {a: {} for a in targets}
    for name, fn, base in (("long_doc", long_doc_qa, 1), ("multi_round", multi_round_qa, 2),
                           ("no_reuse", no_reuse, 3)):
        for url in targets.values():
            post_json(url + "/reset_prefix_cache", {})
        before = {a: server_counters(u) for a, u in servers.items()}
        stats0 = {a: connector_counters(p) for a, p in logs.items()}
        for arm, figures in fn(targets, MODEL_NAME, w, seed=base + 10 * seed).items():
            out[arm][name] = figures
        for arm, url in servers.items():
            now = server_counters(url)
            out[arm][name]["server"] = {k: v - before[arm].get(k, 0.0) for k, v in now.items()}
        for arm, path in logs.items():
            out[arm][name]["connector"] = moved(connector_counters(path), stats0[arm])
    return out


def serve_bench(w: Workloads, arms: list[str], *, model: str | None = None,
                dtype: str = "float32", tier_fraction: float = 0.5,
                vllm_kv_fraction: float = 0.6, eviction: str = "lru", chunk: int = 256,
                repeats: int = 1, lmcache_python: str | None = None, vllm_args=(),
                connector_config: dict | None = None, deadline_s: float | None = None,
                on_result=None) -> dict:
    """`deadline_s`: no run starts that would end past it (seconds from now; a run is
    expected to take 1.1x the one before). `on_result(result)`: the result so far, once the
    arms are up and after every run."""
    t0 = time.monotonic()
    model_dir = Path(model or default_tiny_model())
    bpt, vocab = kv_bytes_per_token(model_dir, dtype)
    w = Workloads(**{**asdict(w), "vocab": min(w.vocab, vocab)})
    working_set = w.long_doc_tokens() * bpt
    mlen = max_len(w)
    tier = int(tier_fraction * working_set)
    vllm_kv = max(int(vllm_kv_fraction * working_set), 2 * mlen * bpt)
    runs: dict[str, list] = {a: [] for a in arms}
    with contextlib.ExitStack() as stack:   # every arm up at once: measured in alternation
        running = {}
        for arm in arms:
            print(f"kvedit bench serve: starting {arm}", file=sys.stderr)
            try:
                running[arm] = stack.enter_context(start_arm(
                    arm, model_dir, tier_bytes=tier, vllm_kv_bytes=vllm_kv, dtype=dtype,
                    max_model_len=mlen, chunk=chunk, eviction=eviction,
                    lmcache_python=lmcache_python, vllm_args=vllm_args,
                    connector_config=connector_config))
            except ArmUnavailable as e:
                runs[arm].append({"unavailable": str(e)})
        targets = {a: r.base_url for a, r in running.items()}
        servers = {a: r.server_http_url for a, r in running.items() if r.server_http_url}
        logs = {a: r.log_path for a, r in running.items() if r.server_http_url}

        def result(done: int) -> dict:
            return result_json(runs, done, vllm_version=vllm.__version__, model=model,
                               dtype=dtype, vllm_args=vllm_args, w=w, bpt=bpt,
                               working_set=working_set, tier=tier,
                               tier_fraction=tier_fraction, vllm_kv=vllm_kv,
                               eviction=eviction, chunk=chunk,
                               connector_config=connector_config)

        if on_result is not None:
            on_result(result(0))
        done, last_s = 0, 0.0
        for rep in range(repeats):
            left = None if deadline_s is None else deadline_s - (time.monotonic() - t0)
            if rep and left is not None and 1.1 * last_s > left:
                print(f"kvedit bench serve: stopping after {rep} of {repeats} runs: "
                      f"{left:.0f} s to --deadline-s, a run takes ~{last_s:.0f} s",
                      file=sys.stderr)
                break
            print(f"kvedit bench serve: measuring {list(targets)} (run {rep + 1}/{repeats})",
                  file=sys.stderr)
            r0, load0 = time.monotonic(), os.getloadavg()[0]
            figures = measure(targets, w, seed=rep, servers=servers, logs=logs)
            for arm, f in figures.items():
                f["load_avg_1m"] = [load0, os.getloadavg()[0]]
                why = degraded(running[arm].log_tail(1 << 30))
                if why:
                    f["degraded"] = why
                runs[arm].append(f)
            done, last_s = rep + 1, time.monotonic() - r0
            if on_result is not None:
                on_result(result(done))
    return result(done)

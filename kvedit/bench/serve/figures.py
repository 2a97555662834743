"""The figures of `kvedit bench serve`: each arm's medians over its runs, the ratios against
vLLM alone and the best peer, the acceptance fields, and the JSON they make.

Pure arithmetic over the runs' figures (no engine, no server), so tests check it on made-up
arms; "kvedit" in the acceptance fields is the connector's default store mode.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict

from kvedit.bench.serve.workloads import Workloads
from kvedit.vllm.settings import ConnectorSettings

PEERS = ("native", "native_simple", "lmcache")   # what a user would run instead of kvedit


def result_json(runs: dict[str, list], repeats: int, *, vllm_version: str, model,
                dtype: str, vllm_args, w: Workloads, bpt: int, working_set: int, tier: int,
                tier_fraction: float, vllm_kv: int, eviction: str, chunk: int,
                connector_config: dict | None) -> dict:
    """The JSON of `kvedit bench serve` for the runs done so far (`repeats` of them)."""
    default = ConnectorSettings().transfer.store
    per_arm = {a: median_run(rs) for a, rs in runs.items()}
    return {
        "vllm_version": vllm_version, "model": str(model or "tiny-qwen3"), "dtype": dtype,
        "vllm_args": list(vllm_args), "workloads": asdict(w), "repeats": repeats,
        "kv_bytes_per_token": bpt, "working_set_bytes": working_set, "tier_bytes": tier,
        "tier_fraction": tier_fraction, "vllm_kv_bytes": vllm_kv, "eviction": eviction,
        "chunk_size": chunk, "kvedit_default_store": default,
        "connector_config": connector_config or {},
        "arms": per_arm, "runs": runs,
        "ratios": ratios(per_arm),
        **acceptance(per_arm, default, tier_fraction),
        "targets": {"half_tier.kvedit_ttft_vs_vllm_alone": "<= 1.0",
                    "half_tier.kvedit_ttft_vs_eager": "<= 1.0",
                    "no_reuse.kvedit_throughput_vs_vllm_alone": ">= 0.95"},
    }


_KEYS = {"query_ttft_s": ("long_doc", "query", "ttft_mean_s"),
         "query_round_s": ("long_doc", "query", "round_s"),
         "warmup_ttft_s": ("long_doc", "warmup", "ttft_mean_s"),
         "multi_round_ttft_s": ("multi_round", "ttft_mean_s"),
         "no_reuse_tokens_per_s": ("no_reuse", "tokens_per_s")}


def _get(figures: dict, path) -> float | None:
    for p in path:
        if not isinstance(figures, dict) or p not in figures:
            return None
        figures = figures[p]
    return figures


def median_run(runs: list[dict]) -> dict:
    """One arm's headline figures, medians over its runs (or why it did not run)."""
    ok = [r for r in runs if "unavailable" not in r]
    if not ok:
        return {"unavailable": runs[0]["unavailable"]} if runs else {"unavailable": "not run"}
    out = {k: statistics.median(_get(r, path) for r in ok) for k, path in _KEYS.items()}
    why = next((r["degraded"] for r in ok if "degraded" in r), None)
    return out | ({"degraded": why} if why else {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def ratios(arms: dict) -> dict:
    base = arms.get("vllm", {})
    out = {}
    for key in _KEYS:
        out[f"{key}_vs_vllm_alone"] = {a: _ratio(f.get(key), base.get(key))
                                       for a, f in arms.items() if "unavailable" not in f}
        peer = _best_peer(arms, key)
        out[f"{key}_best_peer"] = peer
        out[f"{key}_vs_best_peer"] = {a: _ratio(f.get(key), arms[peer][key])
                                      for a, f in arms.items()
                                      if peer and a.startswith("kvedit_")
                                      and "unavailable" not in f}
    return out


def _best_peer(arms: dict, key: str) -> str | None:
    """The best peer arm that ran with its cache (not unavailable, not degraded)."""
    ran = [a for a in PEERS if a in arms and "unavailable" not in arms[a]
           and "degraded" not in arms[a]]
    if not ran:
        return None
    pick = max if key.endswith("_per_s") else min
    return pick(ran, key=lambda a: arms[a][key])


def acceptance(arms: dict, default: str, tier_fraction: float) -> dict:
    kv = f"kvedit_{default}"
    get = lambda a, k: arms.get(a, {}).get(k)   # noqa: E731
    modes = [a for a in arms if a.startswith("kvedit_") and "unavailable" not in arms[a]]
    best = min(modes, key=lambda a: arms[a]["query_ttft_s"], default=None)
    peer = _best_peer(arms, "query_ttft_s")
    return {
        "half_tier": {
            "tier_fraction": tier_fraction, "kvedit_mode": default,
            "kvedit_ttft_vs_vllm_alone": _ratio(get(kv, "query_ttft_s"),
                                                get("vllm", "query_ttft_s")),
            "kvedit_ttft_vs_eager": _ratio(get(kv, "query_ttft_s"),
                                           get("kvedit_eager", "query_ttft_s")),
            "kvedit_ttft_vs_best_peer": _ratio(get(kv, "query_ttft_s"),
                                               get(peer, "query_ttft_s")) if peer else None,
            "best_mode": best and best.removeprefix("kvedit_"),
            "best_mode_ttft_vs_vllm_alone": _ratio(get(best, "query_ttft_s"),
                                                   get("vllm", "query_ttft_s")),
            "best_mode_ttft_vs_eager": _ratio(get(best, "query_ttft_s"),
                                              get("kvedit_eager", "query_ttft_s")),
        },
        "no_reuse": {"kvedit_throughput_vs_vllm_alone": _ratio(
            get(kv, "no_reuse_tokens_per_s"), get("vllm", "no_reuse_tokens_per_s"))},
        "multi_round": {
            "kvedit_ttft_vs_vllm_alone": _ratio(get(kv, "multi_round_ttft_s"),
                                                get("vllm", "multi_round_ttft_s")),
            "kvedit_ttft_vs_best_peer": _ratio(
                get(kv, "multi_round_ttft_s"),
                get(_best_peer(arms, "multi_round_ttft_s"), "multi_round_ttft_s"))},
        "peers_unavailable": {a: arms[a].get("unavailable") or f"ran without its cache: "
                                 f"{arms[a]['degraded']}" for a in PEERS
                              if a in arms and ("unavailable" in arms[a]
                                                or "degraded" in arms[a])},
    }

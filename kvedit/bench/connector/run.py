"""`kvedit bench connector`: what the vLLM connector saves and costs, against same-run baselines.

Default (real vLLM on the tiny model, one kvedit server, two vLLMs up at once and measured
in alternation so machine noise hits both sides of each ratio alike):
- hit_ttft_vs_recompute: latency of a max_tokens=1 request for a 4096-token prompt whose
  chunks come from the server (vLLM's prefix cache reset; timed once every chunk has landed
  in the server) / the same prompt's first, recomputed request on the same vLLM. Target
  <= 0.3. Where the hit's time goes: local_prefix_hit_ttft_median_s (the same prompt again,
  now from vLLM's own prefix cache: the request's fixed costs and its 1-token forward; the
  connector loads only the chunk of the last, partial vLLM block) and load_breakdown_ms
  (the connector's load, medians over the hits, read from the worker's log lines with
  stats_interval_s 0: mapping, retrieve round trip, queueing the copies and scatters,
  waiting for the device, releasing the lease). --store-commit picks the connector's
  async_store (default: background on CUDA, in the step on the CPU).
- prefill_with_store_vs_without: prefill throughput (tokens/s) of fresh prompts sent
  together, on the vLLM with the connector storing every chunk / on a vLLM started without
  it (rounds in ABBA order). Target >= 0.9.
- prefill_with_query_capture_vs_without: the same prefill throughput on the connector's vLLM
  with every request asking for its last --query-window queries (the capture field of its
  kv_transfer_params, kvedit.request_params) / without asking (pairs in alternating order). Target
  >= 0.95; two pairs per round, ABBA; the pair ratios are listed too. On a loaded machine
  they scatter widely, so two less noise-prone views come with it: best vs best throughput
  (the least disturbed batch of each arm) and the same ratio in CPU seconds of vLLM's
  processes per batch (work done, not time waited). query_bytes_per_request: the size of
  one stored query object, read back from the server.
Each ratio is the median over pairs measured back to back (noise from other work on a
shared machine then hits both sides of a pair alike).
`--paged`: only the copies (paged.py); `--kv-events`: the connector's KV events (events.py).
On a GPU: `--model DIR --dtype bfloat16 --vllm-arg=--load-format --vllm-arg=dummy` runs
a config-only model at any size with random weights; `--vllm-arg=--gpu-memory-utilization
--vllm-arg=0.4` lets the two vLLMs share one GPU (each checks at start that that fraction
is free).
"""
from __future__ import annotations

import json
import random
import statistics
import sys
from dataclasses import dataclass, field

import torch

from kvedit.bench.connector.calls import complete_one as _complete
from kvedit.bench.connector.calls import prefill_tput as _prefill_tput
from kvedit.bench.connector.calls import tree_cpu_seconds as _tree_cpu_seconds
from kvedit.bench.http import post_json
from kvedit.client import KVClient
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.keys import namespace, query_key, request_keys
from kvedit.launch.server import start_server
from kvedit.launch.vllm import kv_transfer_config, start_vllm
from kvedit.vllm.transfer.copier_stats import load_lines


def run(args) -> int:
    """The default mode (cli.py sends --paged to paged.py, --kv-events to events.py)."""
    result = vllm_bench(args.tokens, args.prompts, args.rounds, model=args.model,
                        dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                        server_gb=args.server_gb or 2.0, vllm_args=args.vllm_arg,
                        window=args.query_window if args.query_capture else 0,
                        store_commit=args.store_commit)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _query_bytes(server, model: str, prompt: list[int], window: int) -> int:
    """Size of the query object stored for `prompt` (0 when there is none)."""
    with KVClient(server.url) as c:
        raw = c.fetch_queries(model, query_key(namespace(model, c.get_layout(model)), prompt,
                                               window))
    return 0 if raw is None else raw.nbytes


def vllm_bench(tokens: int, n_prompts: int, rounds: int, *, model: str | None = None,
               dtype: str = "float32", kv_cache_gib: float = 1.0, server_gb: float = 2.0,
               vllm_args=(), window: int = 128, store_commit: str = "auto") -> dict:
    model_dir = model or default_tiny_model()
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(tokens)]

    kw = dict(max_model_len=max(8192, tokens + 16), dtype=dtype, dev_mode=True,
              kv_cache_gib=kv_cache_gib, extra_args=list(vllm_args))
    with start_server(server_gb, chunk_size=256) as server, \
            start_vllm(model_dir, server=None, **{**kw, "extra_args": [
                *kw["extra_args"], "--kv-transfer-config",
                _connector_config(kv_transfer_config(server.url, server.http_url),
                                  store_commit)]}) as with_conn, \
            start_vllm(model_dir, server=None, **kw) as without, \
            KVClient(server.url) as client:
        print("kvedit bench connector: servers up, measuring", file=sys.stderr)
        for vp in (with_conn, without):  # warm-up (first requests pay one-off costs)
            _prefill_tput(vp, [fresh() for _ in range(2)])
        if window:
            _prefill_tput(with_conn, [fresh() for _ in range(2)], window)  # warm capture
        m = _Measured()
        for r in range(rounds):
            _prefill_round(m, r, with_conn, without, fresh, n_prompts, window)
            _ttft_round(m, with_conn, client, fresh, n_prompts)
        query_bytes = _query_bytes(server, with_conn.model, m.last, window) if window else 0
        # the hits' loads; the local repeats load one chunk too: the one holding the
        # prompt's last, partial vLLM block, which vLLM's prefix cache does not keep
        lines = load_lines(with_conn.log_path.read_text())
        most = max((x["chunks"] for x in lines), default=0)
        loads = [x for x in lines if x["chunks"] == most][-len(m.hit):]
    recompute, hit, hit_tokens, local, tput, cpu = (m.recompute, m.hit, m.hit_tokens, m.local,
                                                     m.tput, m.cpu)
    # Each ratio is taken within a pair measured back to back (so both sides saw about the
    # same load from other work on a shared machine); the median ratio is reported.
    med = statistics.median
    return {
        "prompt_tokens": tokens, "prompts_per_round": n_prompts, "rounds": rounds,
        "model": str(model or "tiny-qwen3"), "dtype": dtype, "vllm_args": list(vllm_args),
        "device": _device_name(),
        "recompute_ttft_median_s": med(recompute), "hit_ttft_median_s": med(hit),
        "hit_cached_tokens": min(hit_tokens),
        "hit_ttft_vs_recompute": med(h / r for h, r in zip(hit, recompute)),
        "local_prefix_hit_ttft_median_s": med(local),
        "load_breakdown_ms": {k: med(x[k] for x in loads) for k in loads[0]} if loads else {},
        "loads_logged": len(loads), "store_commit": store_commit,
        "prefill_median_tok_s_with_store": med(tput["with"]),
        "prefill_median_tok_s_without_connector": med(tput["without"]),
        "prefill_with_store_vs_without": med(w / o for w, o in zip(tput["with"],
                                                                   tput["without"])),
        **(_capture_fields(tput, cpu, window, query_bytes) if window else {}),
        "targets": {"hit_ttft_vs_recompute": "<= 0.3", "prefill_with_store_vs_without": ">= 0.9",
                    "prefill_with_query_capture_vs_without": ">= 0.95"},
    }


@dataclass
class _Measured:
    """vllm_bench's samples, appended round by round."""
    recompute: list[float] = field(default_factory=list)    # TTFT, fresh prompt
    hit: list[float] = field(default_factory=list)          # TTFT, loaded from the server
    hit_tokens: list[int] = field(default_factory=list)     # the hits' cached tokens
    local: list[float] = field(default_factory=list)        # TTFT, vLLM's own prefix cache
    tput: dict[str, list[float]] = field(default_factory=lambda: {
        "with": [], "without": [], "capture": [], "no_capture": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {   # CPU s per batch
        "capture": [], "no_capture": []})
    last: list[int] = field(default_factory=list)           # the last captured prompt


def _prefill_round(m: _Measured, r: int, with_conn, without, fresh, n_prompts: int,
                   window: int) -> None:
    """One round's prefill batches: with the connector vs without, in ABBA order, fresh
    prompts each time (no prefix hit anywhere); then query capture on every request vs on
    none, same vLLM: two pairs in ABBA order (this ratio is the one most exposed to noise:
    it is near 1)."""
    for name in (("without", "with") if r % 2 == 0 else ("with", "without")):
        vp = with_conn if name == "with" else without
        m.tput[name].append(_prefill_tput(vp, [fresh() for _ in range(n_prompts)]))
    for name in ("capture", "no_capture", "no_capture", "capture") if window else ():
        prompts = [fresh() for _ in range(n_prompts)]
        c0 = _tree_cpu_seconds(with_conn.pid)
        m.tput[name].append(_prefill_tput(with_conn, prompts,
                                          window if name == "capture" else 0))
        m.cpu[name].append(_tree_cpu_seconds(with_conn.pid) - c0)
        if name == "capture":
            m.last = prompts[-1]


def _ttft_round(m: _Measured, with_conn, client, fresh, n_prompts: int) -> None:
    """One round's TTFTs per fresh prompt: computed, then (vLLM's prefix cache reset) loaded
    from the server, then from vLLM's own prefix cache."""
    for _ in range(n_prompts):
        p = fresh()
        m.recompute.append(_complete(with_conn, p)[0])
        post_json(with_conn.base_url + "/reset_prefix_cache", {})
        # a hit's time, not a wait for the commit of the request just before
        keys = request_keys(with_conn.model, client.get_layout(with_conn.model), p)
        client.lookup(with_conn.model, keys, wait_timeout=30.0)
        dt, usage = _complete(with_conn, p)
        m.hit.append(dt)
        m.hit_tokens.append(usage["prompt_tokens_details"]["cached_tokens"])
        m.local.append(_complete(with_conn, p)[0])  # vLLM's own prefix cache


def _connector_config(config: str, store_commit: str) -> str:
    """The connector's --kv-transfer-config with a log line per load (load_breakdown_ms) and
    the chosen store commit."""
    cfg = json.loads(config)
    extra = cfg["kv_connector_extra_config"]
    extra["stats_interval_s"] = 0
    if store_commit != "auto":
        extra["async_store"] = store_commit == "background"
    return json.dumps(cfg)


def _capture_fields(tput: dict, cpu: dict, window: int, query_bytes: int) -> dict:
    """The query-capture arm's figures (absent with --no-query-capture)."""
    med = statistics.median
    return {
        "query_window": window,
        "prefill_median_tok_s_query_capture": med(tput["capture"]),
        "prefill_median_tok_s_no_query_capture": med(tput["no_capture"]),
        "prefill_with_query_capture_vs_without": med(c / n for c, n in zip(
            tput["capture"], tput["no_capture"])),
        "query_capture_pair_ratios": [c / n for c, n in zip(tput["capture"],
                                                            tput["no_capture"])],
        "prefill_best_with_query_capture_vs_without": max(tput["capture"])
        / max(tput["no_capture"]),
        "prefill_cpu_with_query_capture_vs_without": med(n / c for c, n in zip(
            cpu["capture"], cpu["no_capture"])),
        "query_bytes_per_request": query_bytes,
    }

"""`kvedit bench serve`: kvedit against what a user would run instead, same engine, same bytes.

Arms, one after another on the same model and vLLM, each with the same vLLM KV cache (a
fraction of the live working set, so vLLM must evict) and the same CPU-tier bytes (the rest
of the working set times --tier-fraction):
- vllm: vLLM alone (its prefix cache only);
- native: vLLM's own CPU offload (`--kv-offloading-backend native --kv-offloading-size`,
  the OffloadingConnector), and native_simple (the same with VLLM_USE_SIMPLE_KV_OFFLOAD=1,
  the SimpleCPUOffloadConnector);
- lmcache: vLLM + LMCache's connector (LMCacheConnectorV1, local CPU backend of that size),
  run with --lmcache-python (an interpreter where lmcache imports beside this vLLM);
- kvedit_eager, kvedit_evict, kvedit_reuse: vLLM + the kvedit connector in each store mode
  and a kvedit server whose pool is the tier.
An arm that cannot start says why (the root-cause line of vLLM's log) in the JSON instead of
figures; one that serves without its cache (LMCache's "degraded mode") keeps its figures,
says why, and is not counted as a peer. Every arm is up at once and the workloads alternate
between them (workloads.py), so load from other work hits all arms alike. Workloads (workloads.py): long-document QA, multi-round QA, no-reuse random
prompts; vLLM's prefix cache is reset between them. The JSON gives each arm's figures, the
ratios against vLLM alone and against the best peer arm (native, native_simple, lmcache:
whichever ran best), and the acceptance fields (`half_tier`, `no_reuse`, `multi_round`),
where "kvedit" is the connector's default store mode. Each kvedit arm's workload figures
also hold "server": what its kvedit server stored, loaded, hit, missed and evicted during
that workload (its /metrics counters before and after), and "connector": what the
connector's stats lines in its vLLM log moved by (time in kvedit's scheduler hooks, store
and load time in vLLM's thread). --repeats measures again with new
prompts and reports medians; the machine's load average is recorded beside each run.
No torch/vllm at module level (CLI start-up).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvedit.bench.serve.workloads import Workloads, long_doc_qa, multi_round_qa, no_reuse

ARMS = ("vllm", "native", "native_simple", "lmcache", "kvedit_eager", "kvedit_evict",
        "kvedit_reuse")
PEERS = ("native", "native_simple", "lmcache")
MODEL_NAME = "bench"


# The kvedit server's cumulative counters (its /metrics) that `measure` records per workload,
# so a run says what each workload made a kvedit arm store, load and evict (a store mode
# that defers its stores moves them into whichever workload comes next)
SERVER_COUNTERS = {"kvedit_store_bytes_total": "stored_bytes",
                   "kvedit_store_seconds_count": "stores",
                   "kvedit_retrieve_bytes_total": "retrieved_bytes",
                   "kvedit_hits_total": "hits", "kvedit_misses_total": "misses",
                   "kvedit_evictions_total": "evictions"}


class ArmUnavailable(Exception):
    """The arm could not start here; the message says why."""


@dataclass
class RunningArm:
    """One started arm: its vLLM, and the kvedit server's HTTP address for kvedit arms."""
    vllm: object                        # kvedit.launch.vllm.VllmProcess
    server_http_url: str | None = None

    @property
    def base_url(self) -> str:
        return self.vllm.base_url

    @property
    def log_path(self):
        return self.vllm.log_path

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.vllm.log_tail(n_chars)


def register(bsub) -> None:
    p = bsub.add_parser("serve", help="serving: kvedit vs vLLM alone, vLLM's CPU offload and "
                        "LMCache on long-document QA, multi-round QA and no-reuse prompts",
                        description=__doc__.splitlines()[0])
    d = Workloads()
    for name in ("docs", "doc_tokens", "question_tokens", "answer_tokens", "users", "rounds",
                 "system_tokens", "user_tokens", "random_prompts", "random_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"(default {getattr(d, name)})")
    p.add_argument("--tier-fraction", type=float, default=0.5,
                   help="CPU tier bytes (kvedit pool, native offload size, LMCache CPU size) "
                        "as a fraction of the long-document working set (default 0.5)")
    p.add_argument("--vllm-kv-fraction", type=float, default=0.6,
                   help="vLLM's own KV cache as a fraction of that working set (default 0.6; "
                        "below 1 so vLLM evicts)")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated subset of {','.join(ARMS)} (default: all)")
    p.add_argument("--eviction", default="lru", help="the kvedit server's --eviction "
                   "(default lru)")
    p.add_argument("--chunk-size", type=int, default=256, help="kvedit and LMCache chunk "
                   "tokens (default 256)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every arm (default 1)")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="start no run that would end more than S seconds after the start "
                        "(judged by the run before; the first always runs): for a machine "
                        "that lends a command a fixed time")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the JSON to FILE once the arms are up and after every "
                        "run (what a cut-short command leaves)")
    p.add_argument("--lmcache-python", default=None,
                   help="python to run the lmcache arm's vLLM with (default: this one)")
    p.add_argument("--model", default=None, help="model dir (default: the tiny Qwen3)")
    p.add_argument("--dtype", default="float32", help="vLLM --dtype (default float32)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every vLLM, repeatable, e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy")
    p.add_argument("--connector-config", type=json.loads, default=None, metavar="JSON",
                   help="more kv_connector_extra_config keys for the kvedit arms, e.g. "
                        "'{\"device_wait\": false}' (docs/gpu.md lists them)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = sorted(set(arms) - set(ARMS))
    if bad or not arms:
        print(f"kvedit bench serve: --arms {args.arms!r}: unknown {bad}; expected a "
              f"comma-separated subset of {list(ARMS)}", file=sys.stderr)
        return 2
    if "vllm" not in arms:
        arms.insert(0, "vllm")   # every ratio is against it
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
    longest = max(w.doc_tokens + w.question_tokens,
                  w.system_tokens + w.rounds * (w.user_tokens + w.answer_tokens),
                  w.random_tokens)
    return -(-(longest + w.answer_tokens + 64) // 256) * 256


# ---- arms -----------------------------------------------------------------------------------
def _root_cause(log: str) -> str:
    """The first exception line of a failed vLLM's log (the root cause, not the re-raise)."""
    for line in log.splitlines():
        if " WARNING " in line or " INFO " in line:
            continue
        m = re.search(r"(?:^|\] |: )((?:[A-Za-z_.]+)?(?:Error|Exception): .+)$", line)
        if m and "Engine core initialization failed" not in m[1]:
            return m[1].strip()[:400]
    return log.strip().splitlines()[-1][:400] if log.strip() else "no log"


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def start_arm(arm: str, model_dir, *, tier_bytes: int, vllm_kv_bytes: int, dtype: str,
              max_model_len: int, chunk: int, eviction: str, lmcache_python: str | None,
              vllm_args, connector_config: dict | None = None):
    """Start the processes of one arm -> a RunningArm; ArmUnavailable if it cannot run.
    `connector_config`: more kv_connector_extra_config keys for a kvedit arm."""
    from kvedit.launch.server import start_server
    from kvedit.launch.vllm import kv_transfer_config, start_vllm

    extra = ["--kv-cache-memory-bytes", str(vllm_kv_bytes), *vllm_args]
    tier_gib = tier_bytes / 2**30
    kw = dict(served_model_name=MODEL_NAME, dtype=dtype, kv_cache_gib=None,
              max_model_len=max_model_len, dev_mode=True)
    env: dict = {}
    python = None
    server_http = None
    stack = contextlib.ExitStack()
    with stack:
        if arm in ("native", "native_simple"):
            extra += ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{tier_gib:.6f}"]
            env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1" if arm == "native_simple" else "0"
        elif arm == "lmcache":
            python = lmcache_python or sys.executable
            _check_lmcache(python)
            extra += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
            env.update(LMCACHE_CHUNK_SIZE=chunk, LMCACHE_LOCAL_CPU="True",
                       LMCACHE_MAX_LOCAL_CPU_SIZE=f"{tier_bytes / 1e9:.6f}")
        elif arm.startswith("kvedit_"):
            server = stack.enter_context(start_server(tier_gib, chunk_size=chunk,
                                                      eviction=eviction))
            server_http = server.http_url
            # stats lines each second: measure reads them at its workload boundaries
            extra += ["--kv-transfer-config", kv_transfer_config(
                server.url, server.http_url, chunk, store=arm.removeprefix("kvedit_"),
                extra_config={"stats_interval_s": 1.0, **(connector_config or {})})]
        with _env(**env):
            try:
                vp = stack.enter_context(start_vllm(model_dir, server=None, extra_args=extra,
                                                    python=python, **kw))
            except RuntimeError as e:   # the whole log: the message has only its tail
                m = re.search(r"log (\S+\.log)", str(e))
                log = Path(m[1]).read_text(errors="replace") if m else str(e)
                raise ArmUnavailable(_root_cause(log)) from None
        yield RunningArm(vp, server_http)


def degraded(log: str) -> str | None:
    """Why an arm that served did so without its cache (LMCache falls back to recomputing
    when it has no connector for the device), or None."""
    if "degraded mode" not in log:
        return None
    for line in log.splitlines():
        m = re.match(r"\s*(RuntimeError|ImportError|Exception): (.+)$", line)
        if m:
            return f"{m[1]}: {m[2]}"[:400]
    return "LMCache reported degraded mode (recompute)"


def _check_lmcache(python: str) -> None:
    r = subprocess.run([python, "-c", "import lmcache, vllm; print(vllm.__version__)"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise ArmUnavailable(f"lmcache does not import with {python} ({_root_cause(r.stderr)});"
                             f" pass --lmcache-python with an interpreter where it does")


def server_counters(http_url: str) -> dict[str, float]:
    """A kvedit server's SERVER_COUNTERS now (short names), from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(http_url + "/metrics", timeout=10.0)
    r.raise_for_status()
    return {SERVER_COUNTERS[s.name]: s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples
            if s.name in SERVER_COUNTERS}


def connector_counters(log_path) -> dict[str, dict[str, float]]:
    """A kvedit arm's connector stats now, from its vLLM log: the last scheduler, store and
    load stats lines (cumulative; the connector logs them every stats_interval_s)."""
    from kvedit.vllm.transfer.copier_stats import load_counters, store_counters
    from kvedit.vllm.scheduler_stats import scheduler_counters

    text = Path(log_path).read_text(errors="replace")
    return {"scheduler": scheduler_counters(text), "store": store_counters(text),
            "load": load_counters(text)}


def _moved(now: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for part, values in now.items():
        old = before.get(part, {})
        out[part] = {k: round(v - old.get(k, 0.0), 3) for k, v in values.items()}
    sched = out.get("scheduler", {})
    if sched.get("steps"):
        sched["hooks_ms_per_step"] = round(sched["hooks_ms"] / sched["steps"], 4)
    return out


def measure(targets: dict[str, str], w: Workloads, seed: int = 0,
            servers: dict[str, str] | None = None,
            logs: dict[str, Path] | None = None) -> dict[str, dict]:
    """Every workload on every running arm (name -> base URL), alternating between arms;
    vLLM's prefix cache is reset on every arm before each workload. `servers` (arm -> its
    kvedit server's HTTP address): each workload's figures get "server", what the counters
    moved by while it ran. `logs` (arm -> its vLLM log): each workload's figures get
    "connector", what the connector's stats lines moved by (to within their interval: the
    last second of a workload may count in the next)."""
    from kvedit.bench.connector import post_json

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
            out[arm][name]["connector"] = _moved(connector_counters(path), stats0[arm])
    return out


# ---- the run --------------------------------------------------------------------------------
def serve_bench(w: Workloads, arms: list[str], *, model: str | None = None,
                dtype: str = "float32", tier_fraction: float = 0.5,
                vllm_kv_fraction: float = 0.6, eviction: str = "lru", chunk: int = 256,
                repeats: int = 1, lmcache_python: str | None = None, vllm_args=(),
                connector_config: dict | None = None, deadline_s: float | None = None,
                on_result=None) -> dict:
    """`deadline_s`: no run starts that would end past it (seconds from now; a run is
    expected to take 1.1x the one before). `on_result(result)`: the result so far, once the
    arms are up and after every run."""
    import vllm

    from kvedit.harness.tiny_model import default_tiny_model

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
            return _result(runs, done, vllm_version=vllm.__version__, model=model, dtype=dtype,
                           vllm_args=vllm_args, w=w, bpt=bpt, working_set=working_set,
                           tier=tier, tier_fraction=tier_fraction, vllm_kv=vllm_kv,
                           eviction=eviction, chunk=chunk, connector_config=connector_config)

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


def _result(runs: dict[str, list], repeats: int, *, vllm_version: str, model, dtype: str,
            vllm_args, w: Workloads, bpt: int, working_set: int, tier: int,
            tier_fraction: float, vllm_kv: int, eviction: str, chunk: int,
            connector_config: dict | None) -> dict:
    """The JSON of `kvedit bench serve` for the runs done so far (`repeats` of them)."""
    from kvedit.vllm.settings import ConnectorSettings

    default = ConnectorSettings().transfer.store
    per_arm = {a: _median_run(rs) for a, rs in runs.items()}
    return {
        "vllm_version": vllm_version, "model": str(model or "tiny-qwen3"), "dtype": dtype,
        "vllm_args": list(vllm_args), "workloads": asdict(w), "repeats": repeats,
        "kv_bytes_per_token": bpt, "working_set_bytes": working_set, "tier_bytes": tier,
        "tier_fraction": tier_fraction, "vllm_kv_bytes": vllm_kv, "eviction": eviction,
        "chunk_size": chunk, "kvedit_default_store": default,
        "connector_config": connector_config or {},
        "arms": per_arm, "runs": runs,
        "ratios": _ratios(per_arm),
        **_acceptance(per_arm, default, tier_fraction),
        "targets": {"half_tier.kvedit_ttft_vs_vllm_alone": "<= 1.0",
                    "half_tier.kvedit_ttft_vs_eager": "<= 1.0",
                    "no_reuse.kvedit_throughput_vs_vllm_alone": ">= 0.95"},
    }


# ---- figures --------------------------------------------------------------------------------
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


def _median_run(runs: list[dict]) -> dict:
    """One arm's headline figures, medians over its runs (or why it did not run)."""
    ok = [r for r in runs if "unavailable" not in r]
    if not ok:
        return {"unavailable": runs[0]["unavailable"]} if runs else {"unavailable": "not run"}
    out = {k: statistics.median(_get(r, path) for r in ok) for k, path in _KEYS.items()}
    why = next((r["degraded"] for r in ok if "degraded" in r), None)
    return out | ({"degraded": why} if why else {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def _ratios(arms: dict) -> dict:
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


def _acceptance(arms: dict, default: str, tier_fraction: float) -> dict:
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

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
`--paged`: only the copies (GB/s), on CUDA when there is a GPU: paged gather/scatter, and
the connector's own store/load code (kvedit.vllm.transfer.copier.PagedCopier) through a real kvedit server,
with the pinned host copy of the same bytes as the baseline and a breakdown (server round
trips without copies, gathers alone).
On a GPU: `--model DIR --dtype bfloat16 --vllm-arg=--load-format --vllm-arg=dummy` runs
a config-only model at any size with random weights; `--vllm-arg=--gpu-memory-utilization
--vllm-arg=0.4` lets the two vLLMs share one GPU (each checks at start that that fraction
is free).
No torch/vllm at module level (CLI start-up).
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from kvedit.bench.engine_calls import complete_one as _complete
from kvedit.bench.engine_calls import post_json
from kvedit.bench.engine_calls import prefill_tput as _prefill_tput
from kvedit.bench.engine_calls import tree_cpu_seconds as _tree_cpu_seconds


def register(bsub) -> None:
    p = bsub.add_parser("connector", help="connector: hit TTFT vs recompute, prefill with "
                        "vs without store, with vs without query capture",
                        description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per round (default 4)")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds (default 6); each ratio is a median over paired runs")
    p.add_argument("--query-window", type=int, default=128,
                   help="W of the query-capture arm (default 128)")
    p.add_argument("--paged", action="store_true",
                   help="only time paged gather/scatter copies (GPU if available)")
    p.add_argument("--chunks", type=int, default=16,
                   help="--paged: chunks per timed batch (default 16, 36 MiB each)")
    p.add_argument("--separate-layers", action="store_true",
                   help="--paged: one allocation per layer, as vLLM allocates its KV cache "
                        "(default: all layers in one buffer)")
    p.add_argument("--no-query-capture", dest="query_capture", action="store_false",
                   help="skip the query-capture arm (e.g. on vLLM 0.26, which has none)")
    p.add_argument("--model", default=None, help="model dir (default: the tiny Qwen3)")
    p.add_argument("--dtype", default="float32", help="vLLM --dtype (default float32)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache of each vLLM (default 1; a long prompt on a large model "
                        "needs more)")
    p.add_argument("--server-gb", type=float, default=None,
                   help="kvedit server memory (default 2; 0.25 with --kv-events: it evicts)")
    p.add_argument("--kv-events", action="store_true",
                   help="only KV events for routers: cost on / off, exact removals")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for both vLLMs we start, repeatable; e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy")
    p.add_argument("--store-commit", choices=("auto", "step", "background"), default="auto",
                   help="connector setting async_store: auto (the default: background on "
                        "CUDA, in the step on the CPU), step (False) or background (True)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.kv_events:
        from kvedit.bench.connector_events import run as events_run
        return events_run(args)
    result = (paged_bench(chunks=args.chunks, separate_layers=args.separate_layers)
              if args.paged else
              vllm_bench(args.tokens, args.prompts, args.rounds, model=args.model,
                         dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                         server_gb=args.server_gb or 2.0, vllm_args=args.vllm_arg,
                         window=args.query_window if args.query_capture else 0,
                         store_commit=args.store_commit))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


# ---- paged copies -------------------------------------------------------------------------
def paged_bench(num_layers: int = 36, kv_heads: int = 8, head_dim: int = 128,
                chunk: int = 256, chunks: int = 16, device: str | None = None,
                separate_layers: bool = False) -> dict:
    """GB/s of PagedKV.gather / scatter for Qwen3-8B-shaped bf16 chunks (36 MiB each).

    Block 16 and FlashAttention's NHD order on CUDA, block 128 and the CPU backend's layout
    on CPU; `separate_layers`: one allocation per layer (vLLM's own allocation: one index
    op per layer), else one buffer for all layers (one op per K/V). On CUDA the host copies
    are timed too: device <-> pageable host memory and pinned host memory; gathers in 16-byte
    elements (what the connector uses) and in bf16 elements.
    """
    import torch

    from kvedit.vllm.paged import PagedKV

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, block = ("cuda", 16) if device == "cuda" else ("cpu", 128)
    tokens = chunk * chunks
    nblocks = 2 * tokens // block
    layers = _paged_layers(kind, (num_layers, nblocks, kv_heads, block, 2 * head_dim), device,
                           separate_layers)
    paged = PagedKV(layers, kind, head_dim, block)
    narrow = PagedKV(layers, kind, head_dim, block, wide=False)
    block_ids = torch.randperm(nblocks)[: tokens // block].tolist()
    slots = [paged.slots(block_ids, c * chunk, (c + 1) * chunk) for c in range(chunks)]
    batch = paged.chunk_slots([(block_ids, c) for c in range(chunks)], chunk)
    shape = (2, num_layers, chunk, kv_heads * head_dim)
    staged = torch.empty((chunks, *shape), dtype=torch.bfloat16, device=device)
    dev = list(staged.unbind(0))
    nbytes = staged.numel() * staged.element_size()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timed = _rate_timer(nbytes, sync)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "layout": kind, "block_size": block, "chunk_bytes": nbytes // chunks,
           "chunks": chunks, "separate_layers": separate_layers,
           "layer_groups": len(paged.groups), "wide_ratio": paged.ratio,
           "gather_GBps": timed(lambda: [paged.gather(s, d) for s, d in zip(slots, dev)]),
           "scatter_GBps": timed(lambda: [paged.scatter(s, d) for s, d in zip(slots, dev)]),
           "gather_narrow_GBps": timed(lambda: [narrow.gather(s, d)
                                                for s, d in zip(slots, dev)]),
           "gather_batch_GBps": timed(lambda: paged.gather_chunks(batch, staged)),
           "scatter_batch_GBps": timed(lambda: paged.scatter_chunks(batch, staged))}
    # Baseline: a plain contiguous copy of the same bytes on the same device.
    src = [torch.empty_like(d) for d in dev]
    out["memcpy_GBps"] = timed(lambda: [d.copy_(s) for s, d in zip(src, dev)])
    if device == "cuda":
        out.update(_host_copies(paged, slots, dev, shape, timed))
    for async_store in (True, False):
        res = _through_server(paged, block_ids, shape, chunk, chunks, sync, nbytes,
                              async_store=async_store)
        out.update(res if async_store else
                   {"store_via_server_sync_GBps": res["store_via_server_GBps"],
                    "breakdown_sync_ms": res["breakdown_ms"]})
    if device == "cuda":
        out["store_via_server_vs_pinned_copy"] = out["store_via_server_GBps"] / out["pinned_d2h_GBps"]
        out["load_via_server_vs_pinned_copy"] = out["load_via_server_GBps"] / out["pinned_h2d_GBps"]
        out["targets"] = {"store_via_server_vs_pinned_copy": ">= 0.8",
                          "load_via_server_vs_pinned_copy": ">= 0.8"}
    return out


def _paged_layers(kind: str, logical: tuple, device: str, separate_layers: bool) -> list:
    """Per-layer views of random bf16 paged KV, `logical` (layers, blocks, heads, block,
    2 * head_dim) in the backend's memory order: FlashAttention's NHD on CUDA, the CPU
    backend's HND on CPU; one allocation per layer or one for all layers."""
    import torch

    perm = (0, 1, 3, 2, 4) if kind == "cuda" else (0, 1, 2, 3, 4)  # LBNHC / LBHNC
    if separate_layers:
        lperm, lshape = tuple(i - 1 for i in perm[1:]), logical[1:]  # one layer's order
        bufs = [torch.randn([lshape[i] for i in lperm], dtype=torch.bfloat16, device=device)
                for _ in range(logical[0])]
        return [b.permute(*[lperm.index(i) for i in range(4)]) for b in bufs]
    buf = torch.randn([logical[i] for i in perm], dtype=torch.bfloat16, device=device)
    view = buf.permute(*[perm.index(i) for i in range(5)])
    return [view[i] for i in range(logical[0])]


def _rate_timer(nbytes: int, sync):
    """timed(fn, reps=5) -> GB/s of `nbytes` over fn's best of `reps` runs, after a warm-up."""
    def timed(fn, reps: int = 5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    return timed


def _host_copies(paged, slots: list, dev: list, shape, timed) -> dict:
    """CUDA only: paged <-> host through a /dev/shm mapping, as the server's segment is used,
    pageable then pinned, and the plain pinned copies of the same bytes (the baseline the
    copy target is against: no gather, no server)."""
    import torch

    from kvedit.vllm.transfer.gpu_memory import pin_host

    host = _shm_tensors(len(dev), shape, torch.bfloat16)

    def store():
        for s, d, h in zip(slots, dev, host):
            paged.gather(s, d)
            h.copy_(d)

    def load():
        for s, d, h in zip(slots, dev, host):
            paged.scatter(s, d.copy_(h))
    out = {"store_to_shm_GBps": timed(store), "load_from_shm_GBps": timed(load)}
    t0 = time.perf_counter()
    out["shm_pinned"] = pin_host(host[0])
    out["pin_seconds"] = time.perf_counter() - t0
    out["store_to_pinned_shm_GBps"] = timed(store)
    out["load_from_pinned_shm_GBps"] = timed(load)
    out["pinned_d2h_GBps"] = timed(lambda: [h.copy_(d) for d, h in zip(dev, host)])
    out["pinned_h2d_GBps"] = timed(lambda: [d.copy_(h) for d, h in zip(dev, host)])
    return out


def _through_server(paged, block_ids: list[int], shape, chunk: int, n: int, sync,
                    nbytes: int, reps: int = 5, async_store: bool = True) -> dict:
    """The connector's own store and load code (kvedit.vllm.transfer.copier.PagedCopier, what
    wait_for_save and start_load_kv run) through a real kvedit server: paged -> its shared
    memory (prepare_store / commit) and back (retrieve / release), fresh keys each time.
    A store is timed until committed (the background thread flushed).

    Best of `reps`; deleting the previous round's keys is outside the timed part. The
    breakdown times the server round trips alone (the same requests, no copies) and the
    batched gathers / scatters alone, so the copies' share is the rest."""
    import os

    import torch

    from kvedit.client import KVClient
    from kvedit.layout import ModelLayout
    from kvedit.launch.server import start_server
    from kvedit.vllm.transfer.plan import ChunkRun
    from kvedit.vllm.transfer.copier import PagedCopier

    layout = ModelLayout(num_layers=shape[1], num_kv_heads=paged.num_heads,
                         head_dim=paged.head_dim, dtype="bfloat16", chunk_size=chunk)
    pool_gb = 3 * n * layout.chunk_bytes / 2**30 + 0.5
    copier = PagedCopier(paged, layout, "bench", async_store=async_store)
    batch = paged.chunk_slots([(block_ids, c) for c in range(n)], chunk)
    with start_server(pool_gb, chunk_size=chunk) as server, KVClient(server.url) as client:
        client.register("bench", layout)
        keys: list[bytes] = []

        def fresh():
            if keys:
                client.delete("bench", keys)
            keys[:] = [os.urandom(16) for _ in range(n)]

        def store():
            copier.store_chunks(client, {k: (block_ids, c) for c, k in enumerate(keys)})
            copier.flush()

        def load():
            run = ChunkRun(req_id="bench", first=0, keys=[keys], start=0, end=n * chunk,
                           block_ids=block_ids)
            if copier.load_run(client, run) != n * chunk:
                raise RuntimeError("bench connector: the server lost chunks mid-benchmark")

        def store_rpc_only():  # the same requests, nothing copied
            with client.prepare_store("bench", keys) as handle:
                for _ in handle.writable():
                    pass

        def load_rpc_only():
            with client.retrieve("bench", keys) as got:
                assert len(got.tensors) == n

        staged = torch.empty((n, *shape), dtype=paged.dtype, device=paged.device)

        def best(fn, setup=None) -> float:
            return _best_seconds(fn, sync, reps, setup)

        t = {"store_total": best(store, fresh), "load_total": best(load),
             "store_server_round_trips": best(store_rpc_only, fresh),
             "load_server_round_trips": best(load_rpc_only),
             "store_gathers": best(lambda: paged.gather_chunks(batch, staged)),
             "load_scatters": best(lambda: paged.scatter_chunks(batch, staged))}
        copier.close()
        return {"transfer_mode": client.transfer_mode,
                "store_via_server_GBps": nbytes / t["store_total"] / 1e9,
                "load_via_server_GBps": nbytes / t["load_total"] / 1e9,
                "breakdown_ms": {k: 1e3 * t[k] for k in (
                    "store_total", "store_server_round_trips", "store_gathers",
                    "load_total", "load_server_round_trips", "load_scatters")},
                **({"server_shm_pin_attempted": True} if copier.pinned else {})}


def _best_seconds(fn, sync, reps: int, setup=None) -> float:
    """fn's best time of `reps` runs after a warm-up run; `setup` before each, untimed."""
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _shm_tensors(n: int, shape, dtype) -> list:
    """n tensors in one fresh /dev/shm mapping (unlinked at once: the mapping stays)."""
    import mmap
    import os

    import torch

    one = torch.empty(shape, dtype=dtype)
    nbytes = n * one.numel() * one.element_size()
    path = f"/dev/shm/kvedit-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    flat = torch.frombuffer(mm, dtype=dtype)
    return list(flat.view(n, *shape).unbind(0))


# ---- real vLLM ----------------------------------------------------------------------------
def _query_bytes(server, model: str, prompt: list[int], window: int) -> int:
    """Size of the query object stored for `prompt` (0 when there is none)."""
    from kvedit.client import KVClient
    from kvedit.keys import namespace, query_key

    with KVClient(server.url) as c:
        raw = c.fetch_queries(model, query_key(namespace(model, c.get_layout(model)), prompt,
                                               window))
    return 0 if raw is None else raw.nbytes


def vllm_bench(tokens: int, n_prompts: int, rounds: int, *, model: str | None = None,
               dtype: str = "float32", kv_cache_gib: float = 1.0, server_gb: float = 2.0,
               vllm_args=(), window: int = 128, store_commit: str = "auto") -> dict:
    from kvedit.client import KVClient
    from kvedit.harness.tiny_model import default_tiny_model
    from kvedit.launch.vllm import kv_transfer_config, start_vllm
    from kvedit.launch.server import start_server
    from kvedit.vllm.transfer.copier_stats import load_lines

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
    from kvedit.keys import request_keys

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

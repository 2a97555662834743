"""The engines of `kvedit bench long` and the order of its speed arms.

Plain vLLM first (`vllm_full`, `vllm_two_phase`), then a kvedit server and vLLM with the
connector, started with the same arguments but the connector: the run is refused there if
the two engines' effective settings (what each vLLM logs at start) differ in anything else,
since every "÷ plain vLLM" figure assumes they do not. On the kvedit engine: a warm-up, then
`none`, `connector_one_phase` (its requests belong to no SDK stream: their chunks are deleted
after it, so the server's leak count stays exact), `host` and the in-engine arms.
"""
from __future__ import annotations

import json
import os
import time

import kvedit
from kvedit.bench.long import arms, engine, figures, full, logs, sizing
from kvedit.bench.long.policies import budget_list, main_policy, queries_of
from kvedit.bench.long.prompts import Prompts, score
from kvedit.bench.long.sizing import Plan
from kvedit.harness.experiment import engines
from kvedit.harness.vocab import fixed_length
from kvedit.vllm.settings import ConnectorSettings, TransferSettings


def run(args, prompts: Prompts, plan: Plan, log, extra=()) -> dict:
    """The speed arms' JSON; `extra`: kvedit.bench.long.policies.entries, one more in-engine
    arm each."""
    n, o, b = args.streams, args.max_tokens, args.budget
    dtype = sizing.dtype(args, prompts)
    cap = plan.kv_blocks * plan.block_size
    overrides = connector_settings(args)   # --connector-setting (run.main refused bad ones)
    max_len = max(map(len, prompts.ids)) + o + 64
    t0 = time.perf_counter()
    out: dict = {"bench": "long", "model": prompts.served, "dtype": dtype,
                 "config": {"streams": n, "prompt_len": args.prompt_len, "max_tokens": o,
                            "every": args.every, "budget": b, "kv_blocks": plan.kv_blocks,
                            "kv_capacity_tokens": cap, "chunk_size": args.chunk_size,
                            "policy": args.policy, "block_size": plan.block_size,
                            "preset": args.preset,
                            "connector_store": TransferSettings().store,
                            "connector_settings": overrides},
                 "sizing": plan.to_dict()}
    configs = {}
    if args.vllm_full:
        plain = full.arm(prompts.ids, o, model=prompts.model_dir, served=prompts.served,
                         dtype=dtype, kv_tokens=cap, max_model_len=max_len,
                         vllm_args=args.vllm_args, log=log, two_phase=args.two_phase)
        configs["plain"] = plain.pop("engine_config")
        out.update(plain)
        _checkpoint(args, out)
    # the connector's default store mode, as `kvedit vllm serve` runs it: connector_one_phase
    # is then what a user who turns the connector on pays; the SDK's requests ask for their
    # chunks stored as computed whatever the mode (kvedit.request_params)
    # stats lines once a second: the SDK arms read the connector's stores, loads and hook
    # time from them (arms.sdk_arm), the in-engine arms their workers' counts
    conn = {"store": TransferSettings().store, "stats_interval_s": logs.STATS_INTERVAL_S}
    if args.in_engine:
        conn["in_engine"] = True
    conn.update(overrides)
    with engines(model=prompts.model_dir, served_model_name=prompts.served, dtype=dtype,
                 kv_tokens=cap, max_model_len=max_len, chunk_size=args.chunk_size, log=log,
                 connector_config=conn, vllm_args=args.vllm_args,
                 l1_size_gb=plan.l1_size_gb) as eng:
        configs["kvedit"] = full.engine_config(eng.log_path)
        _same_settings(configs)
        ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=120)
        completion = full.completion(eng.vllm_url, eng.model)
        try:
            _warm(ctx, completion, prompts.ids[0], args, log)
            progress = not args.json
            log(f"none: N={n} P={max(map(len, prompts.ids))} O={o}, KV capacity {cap} tokens")
            out["none"] = arms.sdk_arm(ctx, completion, prompts.ids, args, eng, budget=False,
                                       progress=progress)
            _checkpoint(args, out)
            if args.vllm_full and args.connector_arm:   # its chunks are deleted at its end
                out["connector_one_phase"] = _connector_one_phase(ctx, eng, prompts.ids, o, log)
                _checkpoint(args, out)
            if args.host_arm:
                log(f"host: every={args.every} budget={b} policy={args.policy} ...")
                out["host"] = arms.sdk_arm(ctx, completion, prompts.ids, args, eng,
                                           budget=True, progress=progress)
                _checkpoint(args, out)
            if args.in_engine:
                _engine_arms(out, ctx, completion, prompts, args, eng, extra, log)
            stats = ctx.client.stats()
            out["leaked_objects"], out["evictions"] = stats["objects"], stats["evictions"]
        finally:
            kvedit.close(ctx)
    out["engine_configs"] = {**configs, "differences": full.config_differences(
        configs.get("plain", {}), configs["kvedit"]) if "plain" in configs else None}
    outputs = {k: r.pop("outputs") for k, r in figures.all_arms(out).items()}
    answers = score(outputs, prompts.samples, prompts.model_dir) if prompts.samples else None
    figures.assemble(out, n=n, cap=cap, kv_blocks=plan.kv_blocks, budget=b, answers=answers)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _checkpoint(args, out: dict) -> None:
    """--checkpoint: the arms so far, raw (outputs included), rewritten after each arm."""
    if not args.checkpoint:
        return
    tmp = f"{args.checkpoint}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, args.checkpoint)


def _same_settings(configs: dict) -> None:
    """Refuse the run when plain vLLM and kvedit's vLLM differ in more than the connector."""
    if "plain" not in configs:
        return
    diff = full.config_differences(configs["plain"], configs["kvedit"])
    if diff:
        lines = "; ".join(f"{k}: plain {a!r} vs kvedit {b!r}" for k, (a, b) in diff.items())
        raise SystemExit(f"refused: plain vLLM and the kvedit engine differ in more than the "
                         f"connector ({lines}); every comparison with plain vLLM would be "
                         "suspect")


def _warm(ctx, completion, prompt, args, log) -> None:
    """One short stream through every path the arms take, so none pays first-call costs
    (on a GPU the in-engine compaction's kernels compile on first use)."""
    log("warm-up ...")
    p = prompt[:256]
    warm = kvedit.BatchedStream([kvedit.create_request(ctx, completion, p, cache_salt="warm")],
                                progress=False)
    warm.prefill(fixed_length(1))
    warm.decode(fixed_length(2 * args.every))
    warm.release()
    if args.host_arm:
        policy = main_policy(args)
        warm = kvedit.BatchedStream([kvedit.create_request(
            ctx, completion, p, cache_salt="warm-host", capture_queries=queries_of(policy))],
            progress=False)
        warm.run(fixed_length(1), kvedit.HostBudget(
            max(args.budget, len(p) + args.every + 3 * args.chunk_size), args.every, policy),
            fixed_length(2 * args.every), release=True)
    if args.in_engine:
        policy = main_policy(args)
        warm = kvedit.BatchedStream([kvedit.create_request(ctx, completion, p,
                                                           cache_salt="warm-engine")],
                                    progress=False)
        spec = kvedit.EngineBudget.from_policy(policy, len(p) + 32, 32,
                                               queries=queries_of(policy))
        warm.run(fixed_length(1), spec, fixed_length(96), release=True)


def _engine_arms(out: dict, ctx, completion, prompts: Prompts, args, eng, extra, log) -> None:
    """in_engine (--policy at --budget), in_engine_matched, one per --engine-policies entry
    and one per other --budgets entry."""
    policy, progress = main_policy(args), not args.json

    def one(label, pol, budget, queries):
        log(f"{label}: every={args.every} budget={budget} policy={type(pol).__name__} "
            f"queries={queries} positions={args.positions} ...")
        r = engine.arm(ctx, completion, prompts.ids, args, eng, pol, progress=progress,
                       budget=budget, queries=queries)
        _checkpoint(args, {**out, label: r})
        return r

    out["in_engine"] = one("in_engine", policy, args.budget, queries_of(policy))
    if args.matched_arm and "host" in out:
        # the budget the host arm really kept to (its chunk-granular edits leave room for
        # the round's tail): in-engine at the same footprint
        matched = out["host"]["max_request_tokens"]
        out["in_engine_matched"] = one("in_engine_matched", policy, matched,
                                       queries_of(policy))
    if extra:
        out["in_engine_policies"] = {e.name: one(f"in_engine {e.name}", e.policy, args.budget,
                                                 e.queries) for e in extra}
    more = budget_list(args)[1:]
    if more:
        out["in_engine_budgets"] = {str(b): one(f"in_engine@{b}", policy, b,
                                                queries_of(policy)) for b in more}


def _connector_one_phase(ctx, eng, prompts, o: int, log) -> dict:
    """The connector alone: every prompt one completion on the kvedit engine, no SDK. Its
    chunks (stored by the connector under the flow's salts) are deleted once they stop
    arriving."""
    log("connector_one_phase: the connector, no budget, one completion per stream ...")
    r = full.flow(eng, prompts, o, two_phase=False, label="connector-one-phase")
    _settle(ctx)
    deleted = sum(ctx.delete_kv(ctx.keys_for(p + out, f"connector-one-phase-{i}"))
                  for i, (p, out) in enumerate(zip(prompts, r["outputs"])))
    r["chunks_deleted"] = deleted
    return r


def _settle(ctx, quiet_s: float = 1.0, most_s: float = 30.0) -> None:
    """Wait until the server's object count has not moved for `quiet_s` (the connector's
    stores land after the replies), at most `most_s`."""
    end, last, since = time.monotonic() + most_s, None, time.monotonic()
    while time.monotonic() < end:
        now = ctx.client.stats()["objects"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def connector_settings(args) -> dict:
    """--connector-setting KEY=VALUE ... as a dict (VALUE as JSON where it parses), checked
    against the connector's own settings: an unknown key or a bad value is refused here,
    before any engine starts, with what the connector expects."""
    out: dict = {}
    for item in args.connector_settings or ():
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--connector-setting {item!r}: expected KEY=VALUE, e.g. "
                             f"async_store=false")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    try:
        ConnectorSettings.from_extra(out)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--connector-setting: {e}") from None
    return out

"""`kvedit bench long`: long generations under a per-stream KV budget vs no edits.

One kvedit server and one vLLM (tiny model by default) with a KV capacity of `--kv-blocks`
blocks, so N streams that each generate O tokens do not fit at once. Two arms on the same
prompts, greedy with ignore_eos (both decode N·O tokens):
- baseline: prefill, then one decode request of O tokens per stream (vLLM preempts and
  recomputes as the sequences outgrow its KV);
- budget: `BatchedStream.run(..., HostBudget(B, K, policy), ...)`: decode rounds of K tokens, and a
  StreamingLLM (sink + recent window) or KeyNorm edit whenever the next round would make a
  stream hold more than B tokens (kvedit.sdk.driver).

Numbers. decode_gain: wall-clock decode throughput, budget / baseline. The KV capacity limits
how many sequences one engine step decodes, so gain_vs_bound uses decode tokens per engine
step (vLLM's counters; free of CPU contention from other processes): step_gain / bound.
The bound: an engine step decodes at most min(N, cap / F) sequences when they hold F tokens
of KV each, so bound = min(N, cap/F_budget) / min(N, cap/F_baseline) with F each arm's mean
footprint over its generated tokens (measured from its requests: baseline ~P + O/2, budgeted
below B). The baseline rarely reaches its own limit (vLLM preempts and recomputes in waves
as its sequences outgrow the KV), which can put gain_vs_bound above 1; `arm_efficiency`
shows each arm's tokens per step against its own limit, and `peak_footprint_bound` the
bound from peak footprints (B vs P+O+1, as `bench dropping` computes it).
edit_overhead_fraction: wall time during which at least one edit ran / the budget arm's
wall time. leaked_objects: objects left in
the server after every stream released its chunks (all streams of this run, both arms);
objects_at_end_vs_live compares the server's objects before that release with the distinct
chunks the streams still referenced.

Which bound. `gain_vs_bound` = step_gain / `decode_gain_bound`, the bound from each arm's
MEAN footprint (what the engine held on average while generating); `peak_footprint_bound`
(B vs P+O+1, each arm's largest footprint) and `step_gain_vs_peak_bound` are printed beside
it; `bounds` names both.

In-engine (`--in-engine`): a third arm on the same prompts and budget, where vLLM keeps
each stream within the budget itself (one request per stream, compacted in place on the
device; kvedit.bench.long_engine). The JSON then holds one object per arm — `none`
(= baseline), `host` (= budgeted) and `in_engine` — each with its decode gain over `none`
against its own mean-footprint bound; `in_engine` adds edit_overhead_fraction (the workers'
compaction time / wall), leaked_blocks (vLLM's KV usage once idle), blocks_freed/reused and
vs_host_decode_throughput.

Equal budget is not equal footprint. The host arm's edits keep whole chunks and leave room
for the next round plus the tail after the last whole chunk, so at budget B it may hold a
chunk less than B (P=256, B=768, K=128, chunks of 128: 513..641 tokens, 5 blocks of 128 at
almost every step), while the in-engine arm holds B - K..B (640..768: 6 blocks at every
step). `in_engine_matched` (skipped with --no-matched-arm) runs the in-engine arm again with
the budget the host arm really kept to (its peak footprint, `max_request_tokens`), so the two
compare at equal footprint too; `kv_limit_blocks` gives each arm's KV limit counted in the
blocks vLLM hands out, which is what bounds tokens per step.

`--engine-policies keynorm:head,snapkv,...`: one more in-engine arm per entry (the entries:
kvedit.bench.long_policies), `in_engine_policies[entry]` with in_engine's fields, and
`in_engine:<entry>` in `kv_limit_blocks` and `answers`.

Plain vLLM (`vllm_full`, on unless --no-vllm-full): after the kvedit arms, the same prompts
on a vLLM started without kvedit (same model, KV pool and prefix caching; kvedit.bench.long_full),
every request one completion of O tokens with its full KV. It is what a user runs without
kvedit: `host_vs_vllm_full_decode_throughput` and, with --in-engine,
`in_engine.vs_vllm_full_decode_throughput` compare against it; each arm reports requests in
flight (vLLM's running gauge, sampled) beside preemptions and recomputed prompt tokens.

Answers in the same run (`--model qwen2.5-coder-1.5b --tasks count,restate`): the streams'
prompts are long-generation tasks (kvedit.harness.eval.longgen) instead of random tokens, and
every arm's outputs are scored: `answers` holds each arm's accuracy per task with its 95%
interval, measured under the same KV pressure as its speed.

Accuracy (`--accuracy-model smollm2`, the default when `kvedit model smollm2` has built it):
after the speed arms, a second engine pair on SmolLM2 runs the long-generation tasks of
kvedit.harness.eval.longgen with no budget, in decode rounds without edits, and with each
policy under a budget (kvedit.bench.long_accuracy); `accuracy` holds each arm's accuracy
per task with Wilson intervals and wall time. `--accuracy-model none` skips it;
`accuracy.skipped` says why when it did not run.
"""
from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

from kvedit.harness.vocab import TINY_SERVED, at_once
from kvedit.harness.vocab import engine_steps as _tokens_per_step
from kvedit.harness.vocab import fixed_length as _sampling
from kvedit.harness.vocab import policy as _policy

POLICIES = ("streaming", "keynorm")


def register(bsub) -> None:
    p = bsub.add_parser("long", help="long generations with a per-stream KV budget vs none")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--streams", type=int, default=8, help="N")
    p.add_argument("--prompt-len", type=int, default=256, help="P")
    p.add_argument("--max-tokens", type=int, default=2048, help="O, generated per stream")
    p.add_argument("--every", type=int, default=128, help="K, tokens per decode round")
    p.add_argument("--budget", type=int, default=768, help="B, KV tokens per stream")
    p.add_argument("--kv-blocks", type=int, default=36,
                   help="engine KV capacity in vLLM blocks (default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--policy", choices=POLICIES, default="streaming")
    p.add_argument("--model", default=None,
                   help="model dir or a built `kvedit model` name such as qwen2.5-coder-1.5b "
                        "(default: the tiny Qwen3 with random prompts)")
    p.add_argument("--tasks", default=None,
                   help="with a real --model: the streams' prompts are these long-generation "
                        "tasks (kvedit.harness.eval.longgen: count, recall, restate; cycled "
                        "over the streams) instead of random tokens, and every arm's outputs "
                        "are scored (speed and answers in one run); --prompt-len is then the "
                        "note's filler tokens and --max-tokens must cover the count")
    p.add_argument("--task-numbers", type=int, default=400,
                   help="with --tasks: numbers each count has (~5 tokens each)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-engine", action="store_true",
                   help="three arms: none, host (the budgeted driver) and in_engine (vLLM "
                        "compacts each stream's KV in place; kvedit.bench.long_engine)")
    p.add_argument("--positions", choices=("compact", "logical"), default="compact",
                   help="the in_engine arm's positions (docs/in-engine.md)")
    p.add_argument("--engine-policies", default=None, metavar="LIST",
                   help="with --in-engine: one more in-engine arm (same prompts and budget) "
                        "per comma-separated entry: a policy (streaming, keynorm, snapkv, tova, "
                        "keydiff, ...) or NAME:head (per layer and KV head selection)")
    p.add_argument("--engine-queries", type=int, default=None, metavar="W",
                   help="query-aware --engine-policies (snapkv, tova): the device query ring, "
                        "the last W tokens whose queries score the others (kept resident); "
                        "default the policy's own window (tova: 1), else 32")
    p.add_argument("--no-matched-arm", dest="matched_arm", action="store_false",
                   help="with --in-engine, skip the in_engine_matched arm (in-engine with "
                        "the budget the host arm really kept to: its peak footprint)")
    p.add_argument("--no-vllm-full", dest="vllm_full", action="store_false",
                   help="skip the vllm_full arm (plain vLLM without kvedit, the same model, "
                        "KV pool and requests, each decoding with its full KV; "
                        "kvedit.bench.long_full)")
    p.add_argument("--l1-size-gb", type=float, default=1.0,
                   help="the kvedit server's memory (the host arm stores its streams there)")
    p.add_argument("--vllm-arg", action="append", default=[], dest="vllm_args",
                   help="one more argument for the vLLM we start (repeat), e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy on a GPU")
    a = p.add_argument_group("accuracy of long-generation tasks (a real model)")
    a.add_argument("--accuracy-model", default="smollm2",
                   help="smollm2 or qwen2.5-coder-1.5b: run the accuracy arms when `kvedit "
                        "model NAME` has built it, else skip with the reason; a model "
                        "directory; none: skip (default %(default)s)")
    a.add_argument("--accuracy-tasks", default=None,
                   help="comma-separated kvedit.harness.eval.longgen.TASKS (default: count,"
                        "recall; count,recall,restate for qwen2.5-coder-1.5b)")
    a.add_argument("--accuracy-note-tokens", type=int, default=512,
                   help="recall/restate: filler tokens of the note around the code")
    a.add_argument("--accuracy-only", action="store_true",
                   help="skip the tiny-model speed arms")
    a.add_argument("--accuracy-samples", type=int, default=8, help="samples per task")
    a.add_argument("--accuracy-numbers", type=int, default=200,
                   help="numbers each sample counts (~5 tokens each)")
    a.add_argument("--accuracy-every", type=int, default=64, help="K of the budgeted arms")
    a.add_argument("--accuracy-budget", type=int, default=512, help="B of the budgeted arms")
    a.add_argument("--accuracy-arms", default=None,
                   help="comma-separated: none (no budget), rounds (decode rounds of K, no "
                        "edit), policies under the budget (streaming, keynorm) and the same "
                        "kept inside vLLM (engine_streaming, engine_keynorm); default: the "
                        "first four, and the engine ones too with --in-engine")
    p.set_defaults(func=_main)


def _arm(ctx, completion, prompts, args, eng, *, budget: bool, progress: bool) -> tuple:
    """One arm on fresh streams; (result dict, the batch)."""
    import kvedit
    from kvedit.harness.experiment import block_size, cpu_seconds
    from kvedit.harness.vocab import vllm_counters

    salt = f"long-{'budget' if budget else 'base'}-{uuid.uuid4().hex[:8]}"
    batch = kvedit.BatchedStream(progress=progress)
    for p in prompts:
        batch.add(kvedit.create_request(ctx, completion, p, cache_salt=salt))
    before, cpu0 = vllm_counters(eng.vllm_url), cpu_seconds(eng.pids)
    t0 = time.perf_counter()
    if budget:
        m = batch.run(_sampling(1), kvedit.HostBudget(args.budget, args.every,
                                                      _policy(args.policy)),
                      _sampling(args.max_tokens))
        edits = m.parts["modify"]
        extra = {"edit_rounds": m.edit_rounds, "edit_busy_s": edits.duration,
                 "edit_fn_s": edits.fn_s, "edit_store_s": edits.store_s,
                 "edit_retrieve_s": edits.retrieve_s, "chunks_deleted": edits.chunks_deleted}
    else:
        batch.prefill(_sampling(1))
        batch.decode(_sampling(args.max_tokens))
        extra = {}
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "cpu_s": cpu_seconds(eng.pids) - cpu0,
           "output_tokens": sum(len(s.output_token_ids) for s in batch),
           **_tokens_per_step(before, vllm_counters(eng.vllm_url)), **extra,
           "max_request_tokens": max(g.prompt_tokens + len(g.token_ids)
                                     for s in batch for g in s.generations)}
    out["decode_tput"] = out["output_tokens"] / wall
    out["tokens_per_cpu_s"] = out["output_tokens"] / out["cpu_s"] if out["cpu_s"] else None
    out["mean_footprint_tokens"] = _mean_footprint(batch)
    out["mean_footprint_blocks"] = _mean_footprint(batch, block_size())
    return out, batch


def _mean_footprint(batch, block_size: int = 1) -> float:
    """KV a sequence held while generating, averaged over every generated token (the i-th
    token of a request sent with p prompt tokens is computed holding p + i tokens): in
    tokens, or in blocks of `block_size` tokens."""
    held = count = 0
    for s in batch:
        for g in s.generations:
            k = len(g.token_ids)
            held += sum(-(-(g.prompt_tokens + i) // block_size) for i in range(k))
            count += k
    return held / count if count else 0.0


def _accuracy(args, log) -> dict:
    """The accuracy arms (kvedit.bench.long_accuracy), or why they did not run."""
    from kvedit.bench import long_accuracy as A

    if args.accuracy_model == "none":
        return {"skipped": "--accuracy-model none"}
    model_dir, why = A.cached_model(args.accuracy_model)
    if model_dir is None:
        log(f"accuracy: skipped ({why})")
        return {"skipped": why}
    default = "none,rounds,streaming,keynorm" + (
        ",engine_streaming,engine_keynorm" if getattr(args, "in_engine", False) else "")
    arms = tuple(x.strip() for x in (args.accuracy_arms or default).split(",") if x.strip())
    bad = [x for x in arms if x not in A.ARMS]
    if bad or not arms:
        raise SystemExit(f"--accuracy-arms: unknown {bad}; expected some of {A.ARMS}")
    from kvedit.harness.eval.longgen import TASKS

    default_tasks = "count,recall" + (",restate" if "qwen" in args.accuracy_model else "")
    tasks = tuple(x.strip() for x in (args.accuracy_tasks or default_tasks).split(",")
                  if x.strip())
    if not tasks or any(t not in TASKS for t in tasks):
        raise SystemExit(f"--accuracy-tasks: got {tasks}; expected some of {TASKS}")
    cfg = A.AccuracyConfig(samples=args.accuracy_samples, numbers=args.accuracy_numbers,
                           every=args.accuracy_every, budget=args.accuracy_budget,
                           chunk_size=args.chunk_size, arms=arms, seed=args.seed, tasks=tasks,
                           note_tokens=args.accuracy_note_tokens)
    return A.run(cfg, model_dir, log)


def _main(args) -> int:
    from kvedit.bench import long_policies

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    extra = long_policies.entries(args)  # refused before any engine starts
    out = {"bench": "long"} if args.accuracy_only else _speed(args, log, extra)
    out["accuracy"] = _accuracy(args, log)
    out["elapsed_s"] = out.get("elapsed_s", 0.0) + out["accuracy"].get("elapsed_s", 0.0)
    print(json.dumps(out, indent=2))
    return 0


def _speed(args, log, extra=()) -> dict:
    """The speed arms; `extra`: long_policies.entries, one more in-engine arm each."""
    import kvedit
    from kvedit.harness.experiment import block_size, engines
    from kvedit.harness.vocab import random_prompts

    n, o, b = args.streams, args.max_tokens, args.budget
    cap = args.kv_blocks * block_size()
    model_dir = _model_dir(args.model)
    samples = _task_samples(args, model_dir, n) if args.tasks else None
    prompts = [s.prompt_ids for s in samples] if samples else \
        random_prompts(n, args.prompt_len, args.seed)
    p = max(map(len, prompts))
    if p + o + 1 > cap:
        raise SystemExit(f"KV capacity {cap} tokens cannot hold one stream of {p}+{o}+1")
    t0 = time.perf_counter()
    in_engine = getattr(args, "in_engine", False)
    conn = {"in_engine": True, "stats_interval_s": 0} if in_engine else None
    served = Path(model_dir).name if model_dir else TINY_SERVED
    with engines(model=model_dir, served_model_name=served, dtype=args.dtype, kv_tokens=cap,
                 max_model_len=p + o + 64,
                 chunk_size=args.chunk_size, log=log, connector_config=conn,
                 vllm_args=args.vllm_args, l1_size_gb=args.l1_size_gb) as eng:
        ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=120)
        completion = kvedit.openai_completion(eng.vllm_url, eng.model)
        try:
            log("warm-up (one short budgeted stream) ...")
            warm = kvedit.BatchedStream([kvedit.create_request(ctx, completion, prompts[0],
                                                               cache_salt="warm")],
                                        progress=False)
            warm.run(_sampling(1), kvedit.HostBudget(
                max(b, p + args.every + 3 * args.chunk_size), args.every, _policy(args.policy)),
                     _sampling(2 * args.every), release=True)
            log(f"baseline: N={n} P={p} O={o}, KV capacity {cap} tokens ...")
            base, base_batch = _arm(ctx, completion, prompts, args, eng, budget=False,
                                    progress=not args.json)
            log(f"budget: every={args.every} budget={b} policy={args.policy} ...")
            bud, bud_batch = _arm(ctx, completion, prompts, args, eng, budget=True,
                                  progress=not args.json)
            batches = [base_batch, bud_batch]
            named = {"host": bud_batch}
            if in_engine:
                from kvedit.bench import long_engine

                log(f"in_engine: every={args.every} budget={b} policy={args.policy} "
                    f"positions={args.positions} ...")
                eng_arm, eng_batch = long_engine.arm(
                    ctx, completion, prompts, args, eng, _policy(args.policy), _sampling,
                    _tokens_per_step, progress=not args.json)
                batches.append(eng_batch)
                named["in_engine"] = eng_batch
                if args.matched_arm:
                    # the budget the host arm really kept to (its chunk-granular edits
                    # leave room for the round's tail): in-engine at the same footprint
                    matched = bud["max_request_tokens"]
                    log(f"in_engine_matched: budget={matched} (the host arm's peak) ...")
                    eng_matched, m_batch = long_engine.arm(
                        ctx, completion, prompts, args, eng, _policy(args.policy),
                        _sampling, _tokens_per_step, progress=not args.json,
                        budget=matched)
                    batches.append(m_batch)
                    named["in_engine_matched"] = m_batch
                extra_arms = {}
                for e in extra:
                    log(f"in_engine {e.name}: budget={b} queries={e.queries} ...")
                    extra_arms[e.name], x_batch = long_engine.arm(
                        ctx, completion, prompts, args, eng, e.policy, _sampling,
                        _tokens_per_step, progress=not args.json, queries=e.queries)
                    batches.append(x_batch)
                    named[f"in_engine:{e.name}"] = x_batch
            none_streams = list(base_batch)
            live = {k for batch in batches for s in batch for k in s.keys}
            stats = ctx.client.stats()
            at_end = stats["objects"]
            for batch in batches:
                batch.release()
            after = ctx.client.stats()
        finally:
            kvedit.close(ctx)
    # Each engine step decodes at most min(N, cap / footprint) sequences: the KV bound on
    # tokens per step, per arm, from the footprints the sequences really had.
    limit = {arm: at_once(n, cap, r["mean_footprint_tokens"]) for arm, r in
             (("baseline", base), ("budgeted", bud))}
    bound = limit["budgeted"] / limit["baseline"]
    peak_bound = at_once(n, cap, b) / at_once(n, cap, p + o + 1)
    step_gain = (bud["tokens_per_step"] / base["tokens_per_step"]
                 if bud["tokens_per_step"] and base["tokens_per_step"] else None)
    out = {
        "bench": "long", "model": served, "dtype": args.dtype,
        "config": {"streams": n, "prompt_len": p, "max_tokens": o, "every": args.every,
                   "budget": b, "kv_capacity_tokens": cap, "chunk_size": args.chunk_size,
                   "policy": args.policy, "block_size": block_size()},
        "baseline": base, "budgeted": bud,
        "decode_gain": bud["decode_tput"] / base["decode_tput"],
        "decode_gain_bound": bound,
        "step_gain": step_gain,
        "gain_vs_bound": step_gain / bound if step_gain else None,
        "wall_gain_vs_bound": bud["decode_tput"] / base["decode_tput"] / bound,
        "kv_limited_tokens_per_step": limit,
        # how close each arm came to its own KV limit (tokens per step / limit)
        "arm_efficiency": {arm: (r["tokens_per_step"] / limit[arm]
                                 if r["tokens_per_step"] else None)
                           for arm, r in (("baseline", base), ("budgeted", bud))},
        "peak_footprint_bound": peak_bound,  # min(N, cap/B) / min(N, cap/(P+O+1))
        "step_gain_vs_peak_bound": step_gain / peak_bound if step_gain else None,
        "bounds": {"gain_vs_bound_uses": "mean_footprint",
                   "mean_footprint": {"bound": bound,
                                      "step_gain_vs_bound": step_gain / bound
                                      if step_gain else None},
                   "peak_footprint": {"bound": peak_bound,
                                      "step_gain_vs_bound": step_gain / peak_bound
                                      if step_gain else None}},
        "edit_overhead_fraction": bud["edit_busy_s"] / bud["wall_s"],
        "objects_at_end": at_end, "live_chunks": len(live),
        "objects_at_end_vs_live": at_end - len(live),
        "leaked_objects": after["objects"],
        "evictions": after["evictions"],
        "budget_respected": bud["max_request_tokens"] <= b,
        "targets": {"gain_vs_bound": ">= 0.9", "edit_overhead_fraction": "<= 0.10",
                    "leaked_objects": "== 0"},
        "elapsed_s": time.perf_counter() - t0,
    }
    if in_engine:
        out.update(_three_arms(out, base, bud, eng_arm, n, cap, limit["baseline"]))
        if args.matched_arm:
            out["in_engine_matched"] = _engine_arm(eng_matched, base, bud, n, cap,
                                                   limit["baseline"])
        if extra_arms:
            out["in_engine_policies"] = {k: _engine_arm(r, base, bud, n, cap, limit["baseline"])
                                         for k, r in extra_arms.items()}
    full_outputs = None
    if getattr(args, "vllm_full", True):
        from kvedit.bench import long_full

        full = long_full.arm(prompts, o, model=model_dir, served=served,
                             dtype=args.dtype, kv_tokens=cap, max_model_len=p + o + 64,
                             vllm_args=args.vllm_args, log=log)
        full_outputs = full["outputs"]
        out.update(_vs_full(out, full, none_streams, base, bud, n, cap, limit["baseline"]))
        out["elapsed_s"] = time.perf_counter() - t0
    if in_engine:
        out["kv_limit_blocks"] = _block_limits(out, n, args.kv_blocks)
    if samples:
        arm_outputs = {"none": [s.output_token_ids for s in none_streams], **{
            name: [s.output_token_ids for s in batch] for name, batch in named.items()}}
        if full_outputs is not None:
            arm_outputs["vllm_full"] = full_outputs
        out["answers"] = _score(arm_outputs, samples, model_dir)
    return out


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _model_dir(model: str | None) -> str | None:
    """--model as a directory: a built `kvedit model` name, or the directory given."""
    from kvedit.harness.models import MODELS, cached, default_dir

    if model is None or model not in MODELS:
        return model
    path = cached(MODELS[model])
    if path is None:
        raise SystemExit(f"--model {model}: not built at {default_dir(MODELS[model])}; run "
                         f"`kvedit model {model}` first")
    return str(path)


def _task_samples(args, model_dir: str | None, n: int) -> list:
    """n long-generation samples (tasks cycled over the streams, seeded), checked to fit."""
    from kvedit.harness.eval import longgen

    if model_dir is None:
        raise SystemExit("--tasks needs a real --model (the tiny model's weights are random)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in longgen.TASKS or t == "recall"]
    if bad or not tasks:
        raise SystemExit(f"--tasks: got {tasks}; expected some of count, restate (recall's "
                         "second turn does not fit one request per stream)")
    per = -(-n // len(tasks))
    pool = {t: longgen.samples(model_dir, t, per, how_many=args.task_numbers,
                               note_tokens=args.prompt_len, seed=args.seed) for t in tasks}
    samples = [pool[tasks[i % len(tasks)]][i // len(tasks)] for i in range(n)]
    need = max(s.max_tokens for s in samples)
    if args.max_tokens < need:
        raise SystemExit(f"--max-tokens {args.max_tokens} is shorter than the tasks' "
                         f"answers ({need} tokens at --task-numbers {args.task_numbers})")
    return samples


def _score(arm_outputs: dict, samples: list, model_dir: str) -> dict:
    """Each arm's answers: per task, correct of n with a 95% Wilson interval."""
    from kvedit.harness.eval.stats import accuracy
    from kvedit.harness.eval.tokenizer import load

    tok = load(model_dir)
    out = {}
    for arm, outputs in arm_outputs.items():
        ok = [(s.task, s.correct(tok.decode(ids))) for s, ids in zip(samples, outputs)]
        out[arm] = {t: accuracy(c for task, c in ok if task == t).to_dict()
                    for t in sorted({t for t, _ in ok})}
    return out


def _vs_full(out: dict, full: dict, none_streams, base: dict, host: dict, n: int, cap: int,
             base_limit: float) -> dict:
    """The vllm_full arm's object, and each kvedit arm's throughput over it."""
    outputs = full.pop("outputs")
    arm = {**full, **_vs_none(full, base, n, cap, base_limit),
           # greedy on the same prompts: plain vLLM and kvedit's unedited arm agree until
           # bf16 batching moves a near tie (random weights have many): reported, not required
           "common_prefix_with_none": sum(_common_prefix(o, s.output_token_ids)
                                          for o, s in zip(outputs, none_streams))
           / max(1, len(outputs))}
    ret = {"vllm_full": arm,
           "host_vs_vllm_full_decode_throughput": host["decode_tput"] / full["decode_tput"]}
    for r in _engine_arms(out).values():
        r["vs_vllm_full_decode_throughput"] = r["decode_tput"] / full["decode_tput"]
        r["vs_vllm_full_step_gain"] = (r["tokens_per_step"] / full["tokens_per_step"]
                                       if r["tokens_per_step"] and full["tokens_per_step"]
                                       else None)
    return ret


def _engine_arms(out: dict) -> dict:
    """The in-engine arms' objects in `out` by arm name: in_engine, in_engine_matched and
    in_engine:<entry> for each --engine-policies entry."""
    arms = {k: out[k] for k in ("in_engine", "in_engine_matched") if k in out}
    extra = out.get("in_engine_policies", {})
    return {**arms, **{f"in_engine:{k}": r for k, r in extra.items()}}


def _vs_none(r: dict, base: dict, n: int, cap: int, base_limit: float) -> dict:
    """An arm's gain over `none` against its own KV bound (from its mean footprint)."""
    limit = min(n, cap / r["mean_footprint_tokens"])
    bound = limit / base_limit
    step = (r["tokens_per_step"] / base["tokens_per_step"]
            if r["tokens_per_step"] and base["tokens_per_step"] else None)
    return {"decode_gain": r["decode_tput"] / base["decode_tput"],
            "decode_gain_bound": bound, "step_gain": step,
            "gain_vs_bound": step / bound if step else None,
            "arm_efficiency": r["tokens_per_step"] / limit if r["tokens_per_step"] else None}


def _block_limits(out: dict, n: int, kv_blocks: int) -> dict:
    """Each arm's KV limit on tokens per step counted in the blocks vLLM gives out:
    min(N, blocks / mean blocks held). A stream that holds 641..768 tokens holds 6 blocks
    of 128 at every step, one that holds 513..640 holds 5: the token bound misses that."""
    limits = {}
    for arm, r in {**{k: out[k] for k in ("none", "host") if k in out},
                   **_engine_arms(out)}.items():
        limit = min(n, kv_blocks / r["mean_footprint_blocks"])
        limits[arm] = {"mean_blocks": r["mean_footprint_blocks"], "limit": limit,
                       "tokens_per_step": r["tokens_per_step"],
                       "efficiency": r["tokens_per_step"] / limit if r["tokens_per_step"]
                       else None}
    return limits


def _engine_arm(eng: dict, base: dict, host: dict, n: int, cap: int,
                base_limit: float) -> dict:
    """An in-engine arm's object: its gain over `none`, its edit overhead and blocks, and
    its throughput over the host arm's (wall clock, CPU seconds, engine steps)."""
    s = eng["in_engine"]
    return {**eng, **_vs_none(eng, base, n, cap, base_limit),
            "edit_overhead_fraction": eng["edit_busy_s"] / eng["wall_s"],
            "vs_host_decode_throughput": eng["decode_tput"] / host["decode_tput"],
            # the same with CPU seconds (engine, server and client) for wall seconds:
            # what a shared box's load does not move
            "vs_host_tokens_per_cpu_s": (eng["tokens_per_cpu_s"] / host["tokens_per_cpu_s"]
                                         if eng["tokens_per_cpu_s"] and
                                         host["tokens_per_cpu_s"] else None),
            "vs_host_step_gain": (eng["tokens_per_step"] / host["tokens_per_step"]
                                  if eng["tokens_per_step"] and host["tokens_per_step"]
                                  else None),
            "blocks_freed": s.get("blocks_released"), "blocks_reused": s.get("blocks_reused"),
            "cow_blocks": s.get("cow_blocks"), "uncached_blocks": s.get("uncached_blocks"),
            "compactions": s.get("compactions"),
            "early_compactions": s.get("early_compactions"),
            "stashes": s.get("stashes"), "restores": s.get("restores"),
            "rotations": s.get("rotations")}


def _three_arms(out: dict, base: dict, host: dict, eng: dict, n: int, cap: int,
                base_limit: float) -> dict:
    """The --in-engine view: one object per arm (none, host, in_engine), each with its gain
    over `none` against its own KV bound; in_engine's targets beside it."""
    host_arm = {**host, **_vs_none(host, base, n, cap, base_limit),
                "edit_overhead_fraction": host["edit_busy_s"] / host["wall_s"],
                "leaked_objects": out["leaked_objects"]}
    eng_arm = _engine_arm(eng, base, host, n, cap, base_limit)
    return {"mode": "in_engine",
            "none": {**base, "decode_gain": 1.0, "arm_efficiency":
                     base["tokens_per_step"] / base_limit if base["tokens_per_step"] else None},
            "host": host_arm, "in_engine": eng_arm,
            "targets": {**out["targets"], "in_engine.gain_vs_bound": ">= 0.95",
                        "in_engine.edit_overhead_fraction": "<= 0.02",
                        "in_engine.leaked_blocks": "== 0",
                        "in_engine.vs_host_decode_throughput": ">= 1.05",
                        "in_engine.vs_vllm_full_decode_throughput":
                            ">= 1.5 (tiny model, default 36-block pool)"}}

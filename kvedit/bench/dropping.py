"""`kvedit bench dropping`: decode gain of DropMiddle against its KV-capacity bound.

One kvedit server and one vLLM (tiny model by default) whose KV capacity C is set so decode
is KV-memory-bound. Per configuration, on identical prompts and with ignore_eos (both arms
decode N·O tokens): a baseline arm (prefill → decode), a dropped arm (prefill → modify →
decode, for the decode throughput) and a pipelined dropped arm (`BatchedStream.run`, for the
end-to-end time). bound = min(N, C/(P(1-r)+O)) / min(N, C/(P+O)).

Sizes. Both configurations share C (one vLLM start, 54 usable blocks of 128 tokens). vLLM
hands out whole blocks, so lengths fill them exactly: a decode request holds the prompt, the
prefill's token and O outputs, 1024 + 1 + 383 = 11 blocks (dropped: 512 + 1 + 383 = 7) and
2048 + 1 + 127 = 17 blocks (dropped: 9). anchor: N=9, O/P ≈ 0.37, C ≈ 0.55·N·(P+O), bound
1.57. short_output: N=6, O/P ≈ 1/16, C ≈ 0.55·N·(P+O) (3 baseline requests at once, all 6
dropped ones), bound 1.89. Concurrency stays below ~8 requests, where a decode step on this
2-core CPU still costs about the same whatever the batch (beyond it the CPU, not the KV,
limits decode, and no KV edit can help).
No torch at module level (CLI start-up): `kvedit bench` imports this module to register it.
"""
from __future__ import annotations

import json
import sys
import time

import kvedit
from kvedit.harness.experiment import block_size, config_dict, engines, run_arm, warm_up
from kvedit.harness.vocab import TINY_SERVED, Workload, ratio, steps_of

# name: (N, P, O)
CONFIGS = {
    "anchor": (9, 1024, 383),
    "short_output": (6, 2048, 127),
}
KV_BLOCKS = 54


def register(bsub) -> None:
    p = bsub.add_parser("dropping", help="decode gain of DropMiddle vs its KV-capacity bound")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply N and the KV capacity (keeps the bound; default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS,
                   help="engine KV capacity in vLLM blocks (default %(default)s)")
    p.add_argument("--ratio", type=float, default=0.5, help="DropMiddle ratio r")
    p.add_argument("--model", default=None, help="model dir (default: the tiny Qwen3)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-pipelined", action="store_true", help="skip the BatchedStream.run arm")
    p.add_argument("--repeats", type=int, default=1,
                   help="baseline/dropped rounds per configuration (medians reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l1-size-gb", type=float, default=1.0,
                   help="memory of the kvedit server we start (default %(default)s; an 8B-shaped "
                        "model needs tens of GB at scale)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the vLLM we start, repeatable; e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy (random weights from config.json)")
    p.set_defaults(func=_main)


def _configs(args) -> tuple[int, list]:
    """The shared capacity C (tokens) and one Workload per configuration."""
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise SystemExit(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    capacity = round(args.kv_blocks * args.scale) * block_size()
    out = []
    for name in names:
        n, p, o = CONFIGS[name]
        w = Workload(max(1, round(n * args.scale)), p, o, args.ratio, args.seed)
        w.validate()
        if p + o + 1 > capacity:
            raise SystemExit(f"KV capacity {capacity} tokens cannot hold one {name} request")
        out.append((name, w))
    return capacity, out


def _steps(arm: dict) -> dict:
    """Decode-phase engine counters of one arm: tokens per engine step and recompute."""
    return steps_of(arm["decode"].get("engine"))


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _one(name, w, capacity, ctx, completion, eng, args, log) -> dict:
    from kvedit.edits import DropMiddle   # torch

    prompts = w.prompts()
    common = dict(max_tokens=w.max_tokens, progress=not args.json, vllm_url=eng.vllm_url)
    pairs = []
    for rep in range(args.repeats):  # alternate the arms: slow drifts hit both alike
        log(f"[{name}] N={w.num_prompts} P={w.prompt_len} O={w.max_tokens} C={capacity} "
            f"round {rep + 1}/{args.repeats}: baseline, dropped")
        base = run_arm(ctx, completion, prompts, label=f"{name}-base", **common)
        drop = run_arm(ctx, completion, prompts, fn=DropMiddle(w.ratio), label=f"{name}-drop",
                       **common)
        pairs.append((base, drop))
        # One line per round, so a run cut short still leaves its figures in the log.
        log(f"[{name}] round {rep + 1}: decode {base['decode']['output_tput']:.1f} -> "
            f"{drop['decode']['output_tput']:.1f} tok/s in {base['decode']['duration']:.1f} + "
            f"{drop['decode']['duration']:.1f} s, gain "
            f"{drop['decode']['output_tput'] / base['decode']['output_tput']:.3f} "
            f"(bound {w.bound(capacity):.3f}); prefill {base['prefill']['duration']:.1f} s, "
            f"modify {drop['modify']['duration']:.1f} s")
    base, drop = pairs[-1]
    b_tput = _median([b["decode"]["output_tput"] for b, _ in pairs])
    d_tput = _median([d["decode"]["output_tput"] for _, d in pairs])
    gain = _median([d["decode"]["output_tput"] / b["decode"]["output_tput"] for b, d in pairs])
    bound = w.bound(capacity)
    b_steps, d_steps = _steps(base), _steps(drop)
    step_gain = ratio(d_steps["tokens_per_step"], b_steps["tokens_per_step"])
    base_e2e = _median([b["prefill"]["duration"] + b["decode"]["duration"] for b, _ in pairs])
    res = {
        "name": name,
        "config": config_dict(w, kv_capacity_tokens=capacity, policy="DropMiddle",
                              repeats=args.repeats),
        "baseline_decode_tput": b_tput, "dropped_decode_tput": d_tput,
        "decode_gain": gain, "decode_gain_bound": bound, "gain_vs_bound": gain / bound,
        "decode_gains_per_round": [d["decode"]["output_tput"] / b["decode"]["output_tput"]
                                   for b, d in pairs],
        "decode_tokens_per_step": {"baseline": b_steps["tokens_per_step"],
                                   "dropped": d_steps["tokens_per_step"]},
        "step_gain": step_gain, "step_gain_vs_bound": step_gain / bound if step_gain else None,
        "prefill_tput": _median([b["prefill"]["input_tput"] for b, _ in pairs]),
        "modify_s": _median([d["modify"]["duration"] for _, d in pairs]),
        "decode_prompt_tokens": {"baseline": base["decode_prompt_tokens"],
                                 "dropped": drop["decode_prompt_tokens"]},
        "decode_cached_tokens": {"baseline": base["decode"]["cached_tokens"],
                                 "dropped": drop["decode"]["cached_tokens"]},
        "preemptions": {"baseline": b_steps["preemptions"], "dropped": d_steps["preemptions"]},
        "decode_prompt_tokens_recomputed": {"baseline": b_steps["prompt_tokens_computed"],
                                            "dropped": d_steps["prompt_tokens_computed"]},
        "baseline_end_to_end_s": base_e2e,
        "barrier_end_to_end_gain": _median([
            (b["prefill"]["duration"] + b["decode"]["duration"])
            / (d["prefill"]["duration"] + d["modify"]["duration"] + d["decode"]["duration"])
            for b, d in pairs]),
    }
    if not args.no_pipelined:
        log(f"[{name}] dropped, pipelined run()")
        pipe = run_arm(ctx, completion, prompts, fn=DropMiddle(w.ratio), pipelined=True,
                       label=f"{name}-run", **common)
        e2e = base_e2e / pipe["run"]["duration"]
        res.update(end_to_end_gain=e2e, end_to_end_vs_decode_gain=e2e / gain,
                   pipelined_end_to_end_s=pipe["run"]["duration"],
                   pipelined_preemptions=(pipe["engine"] or {}).get("preemptions"),
                   pipelined_decode_prompt_tokens=pipe["decode_prompt_tokens"],
                   pipelined_phase_spans_s={k: pipe[k]["duration"]
                                            for k in ("prefill", "modify", "decode")})
    return res


def _main(args) -> int:
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    capacity, workloads = _configs(args)
    longest = max(w.prompt_len + w.max_tokens for _, w in workloads)
    t0 = time.perf_counter()
    with engines(model=args.model, dtype=args.dtype, kv_tokens=capacity,
                 max_model_len=longest + 256, l1_size_gb=args.l1_size_gb,
                 vllm_args=args.vllm_arg, log=log) as eng:
        ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=120)
        completion = kvedit.openai_completion(eng.vllm_url, eng.model)
        try:
            warm_up(ctx, completion, workloads[0][1].prompt_len)
            results = [_one(name, w, capacity, ctx, completion, eng, args, log)
                       for name, w in workloads]
        finally:
            kvedit.close(ctx)
    out = {
        "bench": "dropping", "model": args.model or TINY_SERVED, "dtype": args.dtype,
        "kv_capacity_tokens": capacity, "block_size": block_size(),
        "configs": results,
        "targets": {"gain_vs_bound": ">= 0.95", "end_to_end_vs_decode_gain": ">= 0.95"},
        "notes": "decode_gain is wall-clock; step_gain is decode tokens per vLLM engine step "
                 "(free of CPU contention from other processes, which the bound is about)",
        "elapsed_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=2))
    return 0

"""The JSON of `kvedit bench long` from its arms' results: each arm against `none` and against
plain vLLM, the costs of the connector and of the two-phase flow, the KV bounds, what the
budget held, the answers and the frontier of speed against answers.

Why a module of its own: the arms only measure; every ratio is taken here, once, so each
figure has one definition (the package docstring says what they mean).
"""
from __future__ import annotations

from kvedit.harness.vocab import at_once, ratio

PLAIN = ("vllm_full", "vllm_two_phase")
TARGETS = {"in_engine.vs_vllm_full_step_gain": ">= 1.5 (real-cpu preset, pool 40%)",
           "answers": "each task within 1/32 of vllm_full's",
           "none.vs_vllm_full_decode_throughput": ">= 0.97 (pool 40%)",
           "preemptions_vs_vllm_full.none": "<= 1.5",
           "in_engine.edit_overhead_fraction": "<= 0.02", "in_engine.leaked_blocks": "== 0",
           "leaked_objects": "== 0"}


def engine_arms(out: dict) -> dict:
    """The in-engine arms' objects in `out` by arm name: in_engine, in_engine_matched,
    in_engine:<entry> (--engine-policies) and in_engine@<budget> (--budgets)."""
    arms = {k: out[k] for k in ("in_engine", "in_engine_matched") if k in out}
    for group, sep in (("in_engine_policies", ":"), ("in_engine_budgets", "@")):
        arms.update({f"in_engine{sep}{k}": r for k, r in out.get(group, {}).items()})
    return arms


def all_arms(out: dict) -> dict:
    named = {k: out[k] for k in (*PLAIN, "connector_one_phase", "none", "host") if k in out}
    return {**named, **engine_arms(out)}


def vs_none(r: dict, base: dict, n: int, cap: int) -> dict:
    """An arm's gain over `none` against its own KV bound (from its mean footprint)."""
    limit = at_once(n, cap, r["mean_footprint_tokens"])
    bound = limit / at_once(n, cap, base["mean_footprint_tokens"])
    step = ratio(r["tokens_per_step"], base["tokens_per_step"])
    return {"decode_gain": r["decode_tput"] / base["decode_tput"], "decode_gain_bound": bound,
            "step_gain": step, "gain_vs_bound": step / bound if step else None,
            "arm_efficiency": ratio(r["tokens_per_step"], limit)}


def vs_full(out: dict) -> None:
    """Every arm's decode throughput and tokens per step over plain vLLM's, in place."""
    full = out.get("vllm_full")
    if full is None:
        return
    for r in all_arms(out).values():
        r["vs_vllm_full_decode_throughput"] = r["decode_tput"] / full["decode_tput"]
        r["vs_vllm_full_step_gain"] = ratio(r["tokens_per_step"], full["tokens_per_step"])
        r["preemptions_vs_vllm_full"] = ratio(r.get("preemptions"), full.get("preemptions")) \
            if full.get("preemptions") else None


def engine_arm(r: dict, host: dict | None) -> dict:
    """An in-engine arm's own figures beside the host arm's (wall clock, CPU s, steps)."""
    s = r["in_engine"]
    extra = {"edit_overhead_fraction": r["edit_busy_s"] / r["wall_s"],
             "blocks_freed": s.get("blocks_released"), "blocks_reused": s.get("blocks_reused"),
             "cow_blocks": s.get("cow_blocks"), "uncached_blocks": s.get("uncached_blocks"),
             "compactions": s.get("compactions"),
             "early_compactions": s.get("early_compactions"),
             "stashes": s.get("stashes"), "restores": s.get("restores"),
             "rotations": s.get("rotations")}
    if host is not None:
        extra.update({"vs_host_decode_throughput": r["decode_tput"] / host["decode_tput"],
                      "vs_host_tokens_per_cpu_s": ratio(r["tokens_per_cpu_s"],
                                                        host["tokens_per_cpu_s"]),
                      "vs_host_step_gain": ratio(r["tokens_per_step"],
                                                 host["tokens_per_step"])})
    return {**r, **extra}


def block_limits(out: dict, n: int, kv_blocks: int) -> dict:
    """Each arm's KV limit on tokens per step counted in the blocks vLLM gives out:
    min(N, blocks / mean blocks held). A stream that holds 641..768 tokens holds 6 blocks
    of 128 at every step, one that holds 513..640 holds 5: the token bound misses that."""
    limits = {}
    for arm, r in all_arms(out).items():
        limit = min(n, kv_blocks / r["mean_footprint_blocks"])
        limits[arm] = {"mean_blocks": r["mean_footprint_blocks"], "limit": limit,
                       "tokens_per_step": r["tokens_per_step"],
                       "efficiency": ratio(r["tokens_per_step"], limit)}
    return limits


def costs(out: dict) -> dict:
    """The connector's cost and the two-phase flow's, as separate figures (decode throughput
    ratios), and every arm's preemptions."""
    def tput(name):
        return out[name]["decode_tput"] if name in out else None

    return {"connector_one_phase_vs_vllm_full": ratio(tput("connector_one_phase"),
                                                      tput("vllm_full")),
            "none_vs_vllm_two_phase": ratio(tput("none"), tput("vllm_two_phase")),
            "vllm_two_phase_vs_vllm_full": ratio(tput("vllm_two_phase"), tput("vllm_full")),
            "none_vs_vllm_full": ratio(tput("none"), tput("vllm_full")),
            "preemptions": {k: r.get("preemptions") for k, r in all_arms(out).items()}}


def budget_held(out: dict, budget: int) -> dict:
    """What the budget held, by arm: the prefill computes each prompt whole (a prompt longer
    than the budget is held whole until its first compaction or edit), so the budget binds
    the rounds after it (host: each round's request; in-engine: the engine compacts before
    a step would pass it, by construction)."""
    held = {"tokens": budget, "binds": "every decode round or step after the prefill; the "
            "prefill computes each prompt whole, however long"}
    if "host" in out:
        held["host_max_decode_request_tokens"] = out["host"]["max_decode_request_tokens"]
        held["host_respected"] = out["host"]["max_decode_request_tokens"] <= budget
    return held


def frontier(out: dict, answers: dict | None) -> list[dict]:
    """One row per arm: decode throughput and tokens per step over plain vLLM's, preemptions,
    and its answers per task (correct/n) beside plain vLLM's."""
    rows = []
    for name, r in all_arms(out).items():
        spec = r.get("engine_budget") or {}
        row = {"arm": name, "policy": spec.get("policy"), "budget": r.get("budget"),
               "decode_vs_vllm_full": r.get("vs_vllm_full_decode_throughput"),
               "step_vs_vllm_full": r.get("vs_vllm_full_step_gain"),
               "tokens_per_step": r.get("tokens_per_step"), "preemptions": r.get("preemptions")}
        if answers and name in answers:
            row["answers"] = {t: f"{a['correct']}/{a['n']}" for t, a in answers[name].items()}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The frontier as a text table."""
    tasks = sorted({t for r in rows for t in r.get("answers", {})})
    head = ["arm", "policy", "budget", "decode÷vllm", "step÷vllm", "tok/step", "preempt",
            *tasks]
    lines = [head]
    for r in rows:
        def f(x, fmt="{:.2f}"):
            return "-" if x is None else fmt.format(x)
        lines.append([r["arm"], r["policy"] or "-", f(r["budget"], "{}"),
                      f(r["decode_vs_vllm_full"]), f(r["step_vs_vllm_full"]),
                      f(r["tokens_per_step"], "{:.1f}"), f(r["preemptions"], "{:.0f}"),
                      *(r.get("answers", {}).get(t, "-") for t in tasks)])
    widths = [max(len(str(c)) for c in col) for col in zip(*lines)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths))
                     for line in lines)


def assemble(out: dict, *, n: int, cap: int, kv_blocks: int, budget: int,
             answers: dict | None) -> dict:
    """The whole JSON from the arms' objects in `out` (changed in place and returned)."""
    base, host = out["none"], out.get("host")
    for name, r in all_arms(out).items():
        if name != "none":
            r.update(vs_none(r, base, n, cap))
    out["none"].update({"decode_gain": 1.0, "arm_efficiency": ratio(
        base["tokens_per_step"], at_once(n, cap, base["mean_footprint_tokens"]))})
    if "in_engine" in out:
        out["in_engine"] = engine_arm(out["in_engine"], host)
    if "in_engine_matched" in out:
        out["in_engine_matched"] = engine_arm(out["in_engine_matched"], host)
    for group in ("in_engine_policies", "in_engine_budgets"):
        if group in out:
            out[group] = {k: engine_arm(r, host) for k, r in out[group].items()}
    if host is not None:
        host["edit_overhead_fraction"] = host["edit_busy_s"] / host["wall_s"]
    vs_full(out)
    out["costs"] = costs(out)
    out["kv_limit_blocks"] = block_limits(out, n, kv_blocks)
    out["budget"] = budget_held(out, budget)
    if answers is not None:
        out["answers"] = answers
    out["frontier"] = frontier(out, answers)
    out["targets"] = TARGETS
    return out

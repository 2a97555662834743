"""`kvedit bench long`, start to end: everything checked and sized before any engine starts
(a misconfigured run is refused in seconds), then the speed arms and the accuracy arms."""
from __future__ import annotations

from kvedit.bench.long import accuracy, figures, policies, prompts, sizing, speed


def main(args, log) -> dict:
    extra = policies.entries(args)      # refused before any engine starts
    policies.budget_list(args)
    speed.connector_settings(args)      # so is an unknown or bad connector setting
    if args.accuracy_only:
        out = {"bench": "long"}
    else:
        made = prompts.make(args)
        plan = sizing.plan(args, made)
        if args.dry_run:
            return {"bench": "long", "dry_run": True, "sizing": plan.to_dict()}
        out = speed.run(args, made, plan, log, extra)
        log(figures.table(out["frontier"]))
    out["accuracy"] = accuracy.from_args(args, log)
    out["elapsed_s"] = out.get("elapsed_s", 0.0) + out["accuracy"].get("elapsed_s", 0.0)
    return out

"""`kvedit bench long`'s options and presets (the package docstring says what it measures).

Light on purpose: the bench's heavy modules (torch, vLLM launch, the SDK) load only when the
command runs. Every option's default lives in DEFAULTS, not in argparse, so a preset can
fill what the user did not give: `--preset real-cpu --streams 8` is the preset with 8
streams. `parse(argv)` gives the resolved options (tests use it).
"""
from __future__ import annotations

import argparse
import json
import sys

POLICIES = ("streaming", "keynorm", "anchored")  # --policy: the host and in_engine arms'

DEFAULTS = {
    "json": False, "streams": 8, "prompt_len": 256, "max_tokens": 2048, "every": 128,
    "budget": 768, "kv_blocks": None, "pool": None, "chunk_size": 128, "policy": "streaming",
    "model": None, "tasks": None, "task_numbers": 400, "dtype": None, "seed": 0,
    "in_engine": False, "positions": "compact", "engine_policies": None,
    "engine_queries": None, "budgets": None, "matched_arm": True, "vllm_full": True,
    "two_phase": True, "connector_arm": True, "checkpoint": None,
    "host_arm": True, "l1_size_gb": None, "vllm_args": [], "dry_run": False, "preset": None,
    "connector_settings": [],
    "accuracy_model": "smollm2", "accuracy_tasks": None, "accuracy_note_tokens": 512,
    "accuracy_only": False, "accuracy_samples": 8, "accuracy_numbers": 200,
    "accuracy_every": 64, "accuracy_budget": 512, "accuracy_arms": None,
}
DEFAULT_KV_BLOCKS = 36  # the tiny model's pool when neither --kv-blocks nor --pool is given

# The real model at two scales: answers and speed in one run, under KV pressure (the pool
# holds 40% of the working set), plain vLLM and the no-budget connector beside kvedit's
# budgets. real-cpu: sized to finish in about half an hour on two quiet cores (float32, 4
# streams of a 1k-token note and 1k generated, four arms: plain vLLM, the SDK's flow with no
# budget, in-engine PromptAnchored and KeyNorm); real-gpu: issue 42's 64 streams, every arm
# (docs/gpu.md).
PRESETS = {
    "real-cpu": {"model": "qwen2.5-coder-1.5b", "tasks": "restate,count", "streams": 4,
                 "prompt_len": 1024, "task_numbers": 200, "max_tokens": 1100,
                 "budget": 512, "every": 64, "pool": 0.4, "in_engine": True,
                 "policy": "anchored", "engine_policies": "keynorm", "matched_arm": False,
                 "host_arm": False, "two_phase": False, "connector_arm": False,
                 "accuracy_model": "none"},
    "real-gpu": {"model": "qwen2.5-coder-1.5b", "tasks": "restate,count", "streams": 64,
                 "prompt_len": 2048, "task_numbers": 400, "max_tokens": 2048,
                 "budget": 1024, "every": 64, "pool": 0.4, "in_engine": True,
                 "policy": "anchored", "engine_policies": "keynorm", "matched_arm": False,
                 "host_arm": False, "accuracy_model": "none"},
}

S = argparse.SUPPRESS


def register(bsub) -> None:
    p = bsub.add_parser("long", help="long generations with a per-stream KV budget vs none",
                        argument_default=S)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a whole configuration (the options it sets: kvedit.bench.long.cli."
                        "PRESETS); options given beside it win")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sizes (working set, the pool's share of it, the server's "
                        "L1), the arms and an estimate of the time, and start nothing")
    _workload(p)
    _arms(p)
    _accuracy(p.add_argument_group("accuracy of long-generation tasks without KV pressure"))
    p.set_defaults(func=_main)


def _workload(p) -> None:
    p.add_argument("--streams", type=int, help="N (default 8)")
    p.add_argument("--prompt-len", type=int, help="P (default 256)")
    p.add_argument("--max-tokens", type=int, help="O, generated per stream (default 2048)")
    p.add_argument("--every", type=int, help="K, tokens per decode round (default 128)")
    p.add_argument("--budget", type=int, help="B, KV tokens per stream (default 768)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-blocks", type=int,
                      help=f"engine KV pool in vLLM blocks (default {DEFAULT_KV_BLOCKS})")
    pool.add_argument("--pool", type=float, metavar="SHARE",
                      help="engine KV pool as a share of the working set (every stream's "
                           "prompt and output at once): 1.0 holds it all, 0.4 holds 40%%")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="write the arms finished so far to PATH (JSON) after each arm, so a "
                        "run stopped at a time limit keeps what it measured")
    p.add_argument("--chunk-size", type=int, help="the server's chunk (default 128)")
    p.add_argument("--policy", choices=POLICIES,
                   help="the host and in_engine arms' policy (default streaming); anchored: "
                        "the prompt ranked once by its own last window, generated tokens by "
                        "redundancy and recency (kvedit.edits.PromptAnchored)")
    p.add_argument("--model",
                   help="model dir or a built `kvedit model` name such as qwen2.5-coder-1.5b "
                        "(default: the tiny Qwen3 with random prompts)")
    p.add_argument("--tasks",
                   help="with a real --model: the streams' prompts are these long-generation "
                        "tasks (count, restate; cycled over the streams) instead of random "
                        "tokens, and every arm's outputs are scored; --prompt-len is then the "
                        "note's filler tokens and --max-tokens must cover the count")
    p.add_argument("--task-numbers", type=int,
                   help="with --tasks: numbers each count has (~5 tokens each; default 400)")
    p.add_argument("--dtype", help="the engines' dtype (default: bfloat16; float32 for a real "
                                   "model on a CPU without bf16 arithmetic)")
    p.add_argument("--seed", type=int)


def _arms(p) -> None:
    p.add_argument("--in-engine", action="store_true",
                   help="the in_engine arm too: vLLM compacts each stream's KV in place")
    p.add_argument("--no-in-engine", dest="in_engine", action="store_false",
                   help="no in_engine arm (a preset's off): plain vLLM and the connector alone")
    p.add_argument("--positions", choices=("compact", "logical"),
                   help="the in_engine arm's positions (docs/in-engine.md)")
    p.add_argument("--engine-policies", metavar="LIST",
                   help="with --in-engine: one more in-engine arm (same prompts and budget) "
                        "per comma-separated entry: a policy (streaming, keynorm, anchored, "
                        "snapkv, tova, keydiff, ...) or NAME:head (per layer and KV head)")
    p.add_argument("--engine-queries", type=int, metavar="W",
                   help="query-aware --engine-policies (snapkv, tova): the device query ring, "
                        "the last W tokens whose queries score the others (kept resident); "
                        "default the policy's own window (tova: 1), else 32")
    p.add_argument("--budgets", metavar="LIST",
                   help="with --in-engine: the in_engine arm again at each budget (e.g. "
                        "1024,1536,2048): the frontier of speed and answers, as a table and "
                        "in the JSON's `frontier`")
    p.add_argument("--no-matched-arm", dest="matched_arm", action="store_false",
                   help="skip in_engine_matched (in-engine at the host arm's peak footprint)")
    p.add_argument("--no-vllm-full", dest="vllm_full", action="store_false",
                   help="skip the plain-vLLM arms (vllm_full, vllm_two_phase) and "
                        "connector_one_phase")
    p.add_argument("--no-two-phase", dest="two_phase", action="store_false",
                   help="skip vllm_two_phase (plain vLLM in the SDK's two-phase flow)")
    p.add_argument("--no-connector-arm", dest="connector_arm", action="store_false",
                   help="skip connector_one_phase (the connector alone, one completion a "
                        "stream)")
    p.add_argument("--no-host-arm", dest="host_arm", action="store_false",
                   help="skip the host arm (and in_engine_matched, which needs it)")
    p.add_argument("--l1-size-gb", type=float,
                   help="the kvedit server's memory (default: sized from the working set the "
                        "arms store; a size too small is refused before anything starts)")
    p.add_argument("--vllm-arg", action="append", dest="vllm_args",
                   help="one more argument for the vLLMs we start (repeat), e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy on a GPU")
    p.add_argument("--connector-setting", action="append", dest="connector_settings",
                   metavar="KEY=VALUE",
                   help="one more kv_connector_extra_config setting for the kvedit arms' "
                        "engine (repeat; VALUE read as JSON, else a string), e.g. "
                        "async_store=false: an A/B of one connector setting")


def _accuracy(a) -> None:
    a.add_argument("--accuracy-model",
                   help="smollm2 or qwen2.5-coder-1.5b: run the accuracy arms when `kvedit "
                        "model NAME` has built it, else skip with the reason; a model "
                        "directory; none: skip (default smollm2)")
    a.add_argument("--accuracy-tasks",
                   help="comma-separated kvedit.harness.eval.longgen.TASKS (default: count,"
                        "recall; count,recall,restate for qwen2.5-coder-1.5b)")
    a.add_argument("--accuracy-note-tokens", type=int,
                   help="recall/restate: filler tokens of the note around the code")
    a.add_argument("--accuracy-only", action="store_true",
                   help="skip the speed arms")
    a.add_argument("--accuracy-samples", type=int, help="samples per task")
    a.add_argument("--accuracy-numbers", type=int,
                   help="numbers each sample counts (~5 tokens each)")
    a.add_argument("--accuracy-every", type=int, help="K of the budgeted arms")
    a.add_argument("--accuracy-budget", type=int, help="B of the budgeted arms")
    a.add_argument("--accuracy-arms",
                   help="comma-separated: none (no budget), rounds (decode rounds of K, no "
                        "edit), policies under the budget (streaming, keynorm) and the same "
                        "kept inside vLLM (engine_streaming, engine_keynorm)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The options given, then the preset's, then DEFAULTS."""
    given = vars(args)
    preset = PRESETS.get(given.get("preset")) or {}
    out = {**DEFAULTS, **preset, **given}
    if out["kv_blocks"] is None and out["pool"] is None:
        out["kv_blocks"] = DEFAULT_KV_BLOCKS
    if "host_arm" in given and not given["host_arm"]:
        out["matched_arm"] = False
    return argparse.Namespace(**out)


def parse(argv: list[str]) -> argparse.Namespace:
    """`kvedit bench long ARGV` resolved (what the command runs with)."""
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return resolve(p.parse_args(["long", *argv]))


def _main(args) -> int:
    from kvedit.bench.long import run

    args = resolve(args)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    out = run.main(args, log)
    print(json.dumps(out, indent=2))
    return 0

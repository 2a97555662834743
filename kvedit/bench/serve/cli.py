"""`kvedit bench serve`: kvedit against what a user would run instead, same engine, same bytes.

The command's options. Light on purpose: `kvedit bench` registers every family at start-up,
so the bench itself (run.py: vLLM, the launchers) loads only when the command runs. The
package docstring says what the bench measures.
"""
from __future__ import annotations

import json
import sys

from kvedit.bench.serve.workloads import Workloads

ARMS = ("vllm", "native", "native_simple", "lmcache", "kvedit_eager", "kvedit_evict",
        "kvedit_reuse")   # how each starts: arms.py


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
    p.set_defaults(func=_main)


def _main(args) -> int:
    """Check --arms, then run the bench (its modules load here)."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = sorted(set(arms) - set(ARMS))
    if bad or not arms:
        print(f"kvedit bench serve: --arms {args.arms!r}: unknown {bad}; expected a "
              f"comma-separated subset of {list(ARMS)}", file=sys.stderr)
        return 2
    if "vllm" not in arms:
        arms.insert(0, "vllm")   # every ratio is against it
    from kvedit.bench.serve.run import main

    return main(args, arms)

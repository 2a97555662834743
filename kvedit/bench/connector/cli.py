"""`kvedit bench connector` and `kvedit bench route`: their options (the package docstring
says what they measure).

Light on purpose: the benches' modules (torch, the KVClient, the server and vLLM launchers,
ZMQ) load only when a command runs.
"""
from __future__ import annotations

CONNECTOR = "`kvedit bench connector`: what the vLLM connector saves and costs, against " \
            "same-run baselines."
ROUTE = "`kvedit bench route`: routing by KV events with an existing router (vLLM's router, " \
        "vllm-router), two vLLMs each with its own kvedit server."
ARMS = ("round_robin", "kv_aware", "kv_aware_gpu_only")   # route's arms, in the order run


def register(bsub) -> None:
    p = bsub.add_parser("connector", help="connector: hit TTFT vs recompute, prefill with "
                        "vs without store, with vs without query capture",
                        description=CONNECTOR)
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
    p.set_defaults(func=_connector)


def register_route(bsub) -> None:
    """`kvedit bench route` (registered apart from `connector`: it is listed last)."""
    p = bsub.add_parser("route", help="routing by KV events (vllm-router): cached share and "
                        "TTFT per policy, two vLLMs each with a kvedit server",
                        description=ROUTE)
    p.add_argument("--docs", type=int, default=8, help="documents (default 8)")
    p.add_argument("--doc-tokens", type=int, default=2048, help="tokens a document (2048)")
    p.add_argument("--rounds", type=int, default=4, help="rounds over the documents (4)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight (2)")
    p.add_argument("--gpu-docs", type=float, default=2.5,
                   help="documents each vLLM's KV cache holds (default 2.5)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {','.join(ARMS)}")
    p.add_argument("--router-path", default=None,
                   help="directories holding the vllm_router package and its dependencies, "
                   "os.pathsep-separated (prepended to the router's PYTHONPATH)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=_route)


def _connector(args) -> int:
    """Each mode loads only its own module: --paged needs no vLLM installed, and only
    --kv-events (vLLM's event types) imports vllm in this process."""
    if args.kv_events:
        from kvedit.bench.connector import events

        return events.run(args)
    if args.paged:
        from kvedit.bench.connector import paged

        return paged.run(args)
    from kvedit.bench.connector import run

    return run.run(args)


def _route(args) -> int:
    arms = [a for a in args.arms.split(",") if a]
    bad = sorted(set(arms) - set(ARMS))
    if bad:   # before anything loads
        raise SystemExit(f"kvedit bench route: unknown arms {bad}; expected some of {ARMS}")
    from kvedit.bench.connector import route

    return route.run(args, arms)

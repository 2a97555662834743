"""`kvedit bench repair`'s arguments; light, so `kvedit bench` lists it without loading
torch or vLLM (the run: run.py)."""
from __future__ import annotations

import argparse


def register(bsub) -> None:
    p = bsub.add_parser("repair", help="TTFT of a question with repair vs without (repair cost)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--model", default="smollm2",
                   help="smollm2, qwen2.5-coder-1.5b, tiny or a model dir (default %(default)s)")
    p.add_argument("--dtype", default=None,
                   help="vLLM dtype (default: bfloat16 where the CPU has bf16 arithmetic or on "
                        "a GPU, else float32)")
    p.add_argument("--context", type=int, default=2048,
                   help="context tokens, whole chunks (default %(default)s)")
    p.add_argument("--question", type=int, default=32, help="question tokens (default %(default)s)")
    p.add_argument("--ratio", type=float, default=0.5, help="KeyDiff's ratio (default %(default)s)")
    p.add_argument("--restore", type=float, default=1.0,
                   help="Repair.restore: the share of the budget the question re-selects "
                        "(default %(default)s)")
    p.add_argument("--per-head", action=argparse.BooleanOptionalAction, default=True,
                   help="KeyDiff and Repair per (layer, KV head) (default on: the best "
                        "measured in kvedit eval)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l1-size-gb", type=float, default=4.0)
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the vLLM we start, repeatable")
    p.set_defaults(func=_main)


def _main(args) -> int:
    from kvedit.bench.repair import run

    return run.main(args)

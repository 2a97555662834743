"""`kvedit demo`: drop half of each request's KV; see decode get faster and what answers lose.

With no arguments: build SmolLM2-135M-Instruct if needed (`kvedit model smollm2`), start a
kvedit server and a vLLM (CPU) with the connector, its KV capacity set so decode is
memory-bound, then run the same real-text prompts twice: baseline (prefill -> decode) and
dropped (prefill capturing the question's queries -> modify(SnapKV 0.5, keeping the
prompt's header) -> decode). Each prompt hides facts in filler text
and asks for one of them (the generators of `kvedit eval`: a pass key, a key among
distractors). Prints throughput and accuracy side by side, writes results.json,
decode_throughput.png and accuracy.png into runs/demo-<time>/, and stops every process it
started (also on Ctrl-C or an error).
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from kvedit.harness.vocab import Workload, blocks, policy_key, resolve_model, steps_of, wave_bound

# 6 prompts of 1024 context tokens (+ the question), 64 output tokens each: 9 blocks of 128
# per unedited request, 5 dropped; the capacity (30 blocks) decodes 3 unedited requests at
# once (2 waves) and all 6 dropped ones (1 wave): bound 2.0.
DEFAULTS = dict(num_prompts=6, prompt_len=1024, max_tokens=64)
DEMO_TASKS = ("passkey", "multikey")
CHUNK = 128  # the server chunk we start: the question stays in the un-edited suffix


def register(sub) -> None:
    p = sub.add_parser("demo", help="token-dropping demo: decode throughput and accuracy, "
                                    "baseline vs dropped", description=__doc__.splitlines()[0])
    g = p.add_argument_group("engines (default: start a kvedit server and a vLLM here)")
    g.add_argument("--server-url", help="existing kvedit server ZMQ url (tcp://host:port)")
    g.add_argument("--server-http-url", help="its HTTP url (http://host:port)")
    g.add_argument("--vllm-url", help="existing vLLM with the kvedit connector (http://host:port)")
    g.add_argument("--model", default="smollm2",
                   help="smollm2 (default), qwen2.5-coder-1.5b (built on first use), tiny, or a "
                        "model dir (its tokenizer builds the prompts; with --vllm-url it must "
                        "be the model that vLLM serves)")
    g.add_argument("--served-model-name", default=None,
                   help="name vLLM serves the model as (default: smollm2, tiny-qwen3, dir name)")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--kv-tokens", type=int, default=None,
                   help="KV capacity of the vLLM we start, in tokens (default: what the "
                        "dropped batch needs at once, so the unedited decode is "
                        "KV-memory-bound; 0: vLLM's own default)")
    g.add_argument("--l1-gb", type=float, default=1.0, help="kvedit server memory we start")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the vLLM we start, repeatable; on a GPU e.g. "
                        "--vllm-arg=--load-format --vllm-arg=dummy (random weights at any "
                        "size: the throughput chart means something, the accuracy does not)")
    w = p.add_argument_group("workload")
    w.add_argument("--policy", default="snapkv",
                   help="a name of kvedit.edits.POLICIES (default %(default)s)")
    w.add_argument("--ratio", type=float, default=0.5, help="fraction of the context KV to drop")
    w.add_argument("--tasks", default=",".join(DEMO_TASKS),
                   help="kvedit eval tasks the prompts cycle through (default %(default)s)")
    w.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"])
    w.add_argument("--prompt-len", type=int, default=DEFAULTS["prompt_len"],
                   help="context tokens before each question (default %(default)s)")
    w.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"],
                   help="tokens each request decodes (ignore_eos, so both arms decode alike)")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output dir (default: runs/demo-<time>)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=_main)


def _main(args) -> int:
    # SIGTERM unwinds like Ctrl-C, so the processes we started are stopped.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        summary, out = run_demo(args)
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"\nwrote {out / 'results.json'}, {out / 'decode_throughput.png'} and "
          f"{out / 'accuracy.png'}")
    return 0


def prompts(model_dir: Path, tasks, n: int, length: int, seed: int):
    """n hidden-fact samples of `length` context tokens, cycling tasks and needle depths."""
    from kvedit.harness.eval.tasks import DEPTHS, build
    from kvedit.harness.eval.tokenizer import load

    tok = load(model_dir)
    return tok, [build(tok, tasks[i % len(tasks)], length, DEPTHS[i % len(DEPTHS)], i, seed)
                 for i in range(n)]


def _model(args) -> tuple[Path, str]:
    model_dir, served = resolve_model(args.model)
    return model_dir, args.served_model_name or served


def run_demo(args) -> tuple[dict, Path]:
    """The whole demo; returns (summary, output dir)."""
    import kvedit
    from kvedit.harness.eval.policyspec import header_sink
    from kvedit.harness.eval.runner import query_window
    from kvedit.harness.eval.tasks import TASKS
    from kvedit.harness.experiment import engines, run_arm, warm_up
    from kvedit.harness.vocab import policy as named_policy

    try:
        policy_key(args.policy)
    except ValueError as e:
        raise SystemExit(f"--policy: {e}") from None
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        raise SystemExit(f"--tasks {args.tasks!r}: expected some of {sorted(TASKS)}")
    if args.vllm_url and not args.server_url:
        raise ValueError("an existing vLLM (--vllm-url) needs the kvedit server its connector "
                         "uses (--server-url and --server-http-url)")
    # Validate sizes before building or starting anything.
    Workload(args.num_prompts, args.prompt_len, args.max_tokens, args.ratio, args.seed).validate()
    model_dir, served = _model(args)
    tok, samples = prompts(model_dir, tasks, args.num_prompts, args.prompt_len, args.seed)
    # As in `kvedit eval`: a policy with a `sink` keeps the prompts' header (template +
    # instruction), the way a user protects a system prompt.
    policy = named_policy(args.policy, ratio=args.ratio, granularity="token",
                          sink=header_sink(samples, True))
    token_ids = [s.prompt_ids for s in samples]
    full = round(sum(map(len, token_ids)) / len(token_ids))
    w = Workload(args.num_prompts, full, args.max_tokens, args.ratio, args.seed)
    kv_tokens, bound = (None, None) if args.vllm_url else capacity(token_ids, args)
    out = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    with engines(server_url=args.server_url, server_http_url=args.server_http_url,
                 vllm_url=args.vllm_url, model=str(model_dir), served_model_name=served,
                 dtype=args.dtype, kv_tokens=kv_tokens, l1_size_gb=args.l1_gb, chunk_size=CHUNK,
                 max_model_len=max(map(len, token_ids)) + w.max_tokens + 256,
                 vllm_args=args.vllm_arg) as eng:
        ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=120)
        completion = kvedit.openai_completion(eng.vllm_url, eng.model)
        try:
            print(f"{w.num_prompts} prompts of {args.prompt_len} context tokens hiding "
                  f"{'/'.join(tasks)} facts, {w.max_tokens} output tokens each, policy {policy}")
            warm_up(ctx, completion, 4 * ctx.chunk_size)  # DropMiddle needs >= 3 chunks
            common = dict(max_tokens=w.max_tokens, progress=progress, vllm_url=eng.vllm_url)
            print("baseline: prefill -> decode")
            base = run_arm(ctx, completion, token_ids, label="baseline", **common)
            print(f"dropped: prefill -> modify({type(policy).__name__} {args.ratio}) -> decode")
            # A query-aware policy scores with the queries of each prompt's question (the
            # un-editable tail), captured by the connector during the prefill.
            windows = ([query_window(smp, ctx.chunk_size) for smp in samples]
                       if policy.needs_queries else None)
            drop = run_arm(ctx, completion, token_ids, fn=policy, label="dropped",
                           windows=windows, **common)
        finally:
            kvedit.close(ctx)
    answers = {arm["label"]: _answers(samples, arm, tok) for arm in (base, drop)}
    summary = _summary(w, policy, kv_tokens, bound, base, drop)
    summary["prompt_context_tokens"] = args.prompt_len
    summary["sink"] = getattr(policy, "sink", None)  # the header kept whole, if it has one
    summary["accuracy"] = {k: _acc(v) for k, v in answers.items()}
    print("\n" + table(summary))
    (out / "results.json").write_text(json.dumps(
        {"summary": summary, "answers": answers, "baseline": base, "dropped": drop}, indent=2))
    chart(summary, out / "decode_throughput.png")
    accuracy_chart(summary, out / "accuracy.png")
    return summary, out


def capacity(token_ids, args) -> tuple[int | None, float | None]:
    """(KV capacity in tokens, decode gain bound). Default: exactly the blocks the dropped
    batch needs at once, so every dropped request decodes together while the unedited ones
    drain in waves. Requests decode the same number of tokens, so the bound is baseline waves
    over dropped waves, in whole vLLM blocks."""
    from kvedit.harness.experiment import block_size

    bs, n = block_size(), len(token_ids)
    extra = 1 + args.max_tokens  # the prefill's token, then the decode
    base = max(blocks(len(t) + extra, bs) for t in token_ids)
    kept = [len(t) - int(args.ratio * (len(t) // CHUNK * CHUNK)) for t in token_ids]
    drop = max(blocks(k + extra, bs) for k in kept)
    if args.kv_tokens == 0:
        return None, None
    cap = n * drop if args.kv_tokens is None else args.kv_tokens // bs
    if cap < base:
        raise SystemExit(f"--kv-tokens {args.kv_tokens} cannot hold one request of "
                         f"{base * bs} tokens ({base} blocks of {bs})")
    return cap * bs, wave_bound(n, cap, base, drop)


def _answers(samples, arm: dict, tok) -> list[dict]:
    """Each prompt's answer (the first tokens the task asks for) and whether it is right."""
    outputs = arm.get("outputs")
    if outputs is None:
        raise RuntimeError("run_arm did not return the generated tokens ('outputs')")
    rows = []
    for s, ids in zip(samples, outputs):
        text = tok.decode(ids[: s.max_tokens])
        rows.append({"task": s.task, "depth": s.depth, "expected": list(s.answers),
                     "answer": text, "ok": s.correct(text)})
    return rows


def _acc(rows: list[dict]) -> dict:
    from kvedit.harness.eval.stats import accuracy

    return accuracy(r["ok"] for r in rows).to_dict()


def _summary(w, policy, kv_tokens, bound, base, drop) -> dict:
    b, d = base["decode"]["output_tput"], drop["decode"]["output_tput"]
    e2e_b = base["prefill"]["duration"] + base["decode"]["duration"]
    e2e_d = drop["prefill"]["duration"] + drop["modify"]["duration"] + drop["decode"]["duration"]
    return {
        "num_prompts": w.num_prompts, "prompt_len": w.prompt_len, "max_tokens": w.max_tokens,
        "policy": type(policy).__name__, "ratio": w.ratio, "kv_capacity_tokens": kv_tokens,
        "decode_gain_bound": bound,
        "prefill_tput": {"baseline": base["prefill"]["input_tput"],
                         "dropped": drop["prefill"]["input_tput"]},
        "modify_s": drop["modify"]["duration"],
        "decode_prompt_tokens": {"baseline": base["decode_prompt_tokens"],
                                 "dropped": drop["decode_prompt_tokens"]},
        "decode_tput": {"baseline": b, "dropped": d},
        "decode_gain": d / b if b else None,
        "end_to_end_s": {"baseline": e2e_b, "dropped": e2e_d},
        "end_to_end_gain": e2e_b / e2e_d if e2e_d else None,
        "decode_tokens_per_step": {"baseline": _per_step(base), "dropped": _per_step(drop)},
        "preemptions": {"baseline": (base["engine"] or {}).get("preemptions"),
                        "dropped": (drop["engine"] or {}).get("preemptions")},
    }


def _per_step(arm: dict) -> float | None:
    """Decode tokens per vLLM engine step: how many requests decode at once on average."""
    return steps_of(arm["decode"].get("engine"))["tokens_per_step"]


def table(s: dict) -> str:
    def n(x, unit=""):
        return "-" if x is None else f"{x:,.1f}{unit}"

    rows = [("", "baseline", "dropped", "gain"),
            ("prefill throughput (tok/s)", n(s["prefill_tput"]["baseline"]),
             n(s["prefill_tput"]["dropped"]), ""),
            ("modify (s)", "-", f"{s['modify_s']:.2f}", ""),
            ("decode prompt tokens", f"{s['decode_prompt_tokens']['baseline']:,}",
             f"{s['decode_prompt_tokens']['dropped']:,}", ""),
            ("decode throughput (tok/s)", n(s["decode_tput"]["baseline"]),
             n(s["decode_tput"]["dropped"]), f"{s['decode_gain']:.2f}x"),
            ("decode tokens per engine step", n(s["decode_tokens_per_step"]["baseline"]),
             n(s["decode_tokens_per_step"]["dropped"]), _ratio(s["decode_tokens_per_step"])),
            ("end to end (s)", f"{s['end_to_end_s']['baseline']:.1f}",
             f"{s['end_to_end_s']['dropped']:.1f}", f"{s['end_to_end_gain']:.2f}x")]
    if s["decode_gain_bound"]:
        rows.append(("decode gain bound (KV capacity)", "", "", f"{s['decode_gain_bound']:.2f}x"))
    if s.get("accuracy"):
        a, b = s["accuracy"]["baseline"], s["accuracy"]["dropped"]
        rows.append(("answers right (hidden facts)", f"{a['correct']}/{a['n']}",
                     f"{b['correct']}/{b['n']}",
                     f"{b['accuracy'] / a['accuracy']:.2f}x" if a["accuracy"] else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                       for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _ratio(pair: dict) -> str:
    b, d = pair["baseline"], pair["dropped"]
    return f"{d / b:.2f}x" if b and d else ""


def chart(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    vals = [s["decode_tput"]["baseline"], s["decode_tput"]["dropped"]]
    fig, ax = plt.subplots(figsize=(5.5, 4), dpi=120)
    bars = ax.bar(["baseline", f"{s['policy']} {s['ratio']:g}"], vals,
                  color=["#8c8c8c", "#2a7ab9"], width=0.55)
    ax.bar_label(bars, labels=[f"{v:,.0f} tok/s" for v in vals], padding=3)
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_ylim(0, max(vals) * 1.25)
    bound = f", bound {s['decode_gain_bound']:.2f}x" if s["decode_gain_bound"] else ""
    steps = s["decode_tokens_per_step"]
    per_step = (f"\ndecode tokens per engine step {steps['baseline']:.1f} -> "
                f"{steps['dropped']:.1f}"
                if steps["baseline"] and steps["dropped"] else "")
    ax.set_title(f"decode {s['decode_gain']:.2f}x faster{bound}\n{s['num_prompts']} prompts x "
                 f"{s['prompt_len']} tokens, {s['max_tokens']} output tokens{per_step}",
                 fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def accuracy_chart(s: dict, path: Path) -> None:
    """Answers right out of N, baseline vs dropped, with 95% Wilson intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = [s["accuracy"]["baseline"], s["accuracy"]["dropped"]]
    vals = [x["accuracy"] for x in a]
    # max(0, ...): at 0/N or N/N the Wilson bound can land a rounding step past the value,
    # and matplotlib refuses a negative error bar (seen with random weights on the GPU).
    err = [[max(0.0, v - x["ci"][0]) for v, x in zip(vals, a)],
           [max(0.0, x["ci"][1] - v) for v, x in zip(vals, a)]]
    fig, ax = plt.subplots(figsize=(5.5, 4), dpi=120)
    bars = ax.bar(["baseline", f"{s['policy']} {s['ratio']:g}"], vals, yerr=err, capsize=6,
                  color=["#8c8c8c", "#2a7ab9"], width=0.55)
    ax.bar_label(bars, labels=[f"{x['correct']}/{x['n']}" for x in a], padding=3,
                 label_type="center", color="white")
    ax.set_ylabel("accuracy (hidden facts answered)")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"answers: {a[0]['correct']}/{a[0]['n']} -> {a[1]['correct']}/{a[1]['n']} "
                 f"with {s['ratio']:g} of the context KV dropped\ndecode "
                 f"{s['decode_gain']:.2f}x faster; 95% Wilson intervals", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

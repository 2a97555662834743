"""`kvedit bench repair`'s run (what it measures: the package docstring): one engine pair,
a warm-up round, then the rounds; the JSON of their medians."""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
import uuid

import kvedit
from kvedit.edits import KeyDiff, Repair
from kvedit.harness.eval.sizing import engine_dtype
from kvedit.harness.experiment import engines
from kvedit.harness.vocab import greedy, resolve_model
from kvedit.sdk.loop import run_sync
from kvedit.vllm.transfer.copier_stats import load_lines


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 8000) for _ in range(n)]


class Loads:
    """The connector's loads (vLLM's log, one line per load with stats_interval_s 0) since
    the last reading: how long loading chunks into vLLM's blocks took a request."""

    def __init__(self, log_path):
        self.path, self.seen = log_path, 0

    def since(self) -> tuple[float, float]:
        """(milliseconds, MB) of the loads logged since the last call."""
        lines = load_lines(self.path.read_text()) if self.path else []
        new, self.seen = lines[self.seen:], len(lines)
        return sum(x["total_ms"] for x in new), sum(x["mb"] for x in new)


def _round(ctx, post, rng, args, k: int, loads: Loads) -> dict:
    """One round (module docstring): the two arms on one compressed cache."""
    salt = f"bench-repair-{uuid.uuid4().hex[:8]}"
    first = kvedit.BatchedStream([kvedit.create_request(
        ctx, post, _ids(rng, args.context) + _ids(rng, args.question), salt)], progress=False)
    ledger = kvedit.Originals(1 << 40)
    first.prefill(greedy(1))
    first.modify(KeyDiff(args.ratio, granularity="token", per_head=args.per_head),
                 originals=ledger)
    src = first.streams[0]
    context = src.prompt[:len(src.prompt) - args.question - 1]

    def ask():
        s = kvedit.create_request(ctx, post, context + _ids(rng, args.question), src.cache_salt)
        ledger.share(src, s)
        return kvedit.BatchedStream([s], progress=False)

    out: dict = {}

    def plain():
        b = ask()
        loads.since()
        out["no_repair_ttft_s"] = b.decode(greedy(1)).ttft[0]
        out["no_repair_load_ms"], out["no_repair_load_mb"] = loads.since()
        b.release()

    def repaired():
        b = ask()
        loads.since()
        t0 = time.perf_counter()
        m = b.repair(Repair(restore=args.restore, per_head=args.per_head), originals=ledger,
                     sampling_params=greedy(1), first_token=True)
        total = time.perf_counter() - t0
        out["capture_load_ms"], out["capture_load_mb"] = loads.since()
        dec = b.decode(greedy(1))
        out.update(repair_first_token_s=m.ttft[0], repair_s=total,
                   repaired_first_token_s=total + dec.ttft[0], capture_s=m.capture_s,
                   reselect_s=m.retrieve_s + m.fn_s + m.store_s, reselect_fn_s=m.fn_s,
                   decode_ttft_s=dec.ttft[0], capture_cached_tokens=m.cached_tokens,
                   kept_tokens=m.tokens_after)
        b.release()

    for arm in ((plain, repaired) if k % 2 == 0 else (repaired, plain)):
        arm()
    first.release()
    run_sync(ledger.arelease())
    base = out["no_repair_ttft_s"]
    out["ttft_vs_no_repair"] = out["repair_first_token_s"] / base
    out["repaired_ttft_vs_no_repair"] = out["repaired_first_token_s"] / base
    return out


def main(args) -> int:
    """Run the bench (the module docstring); print its JSON."""
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.context % 256 or args.context <= 0 or args.question <= 0 or args.rounds <= 0:
        raise SystemExit("--context must be whole chunks of 256 tokens; --question and "
                         "--rounds positive")
    model_dir, served = resolve_model(args.model)
    dtype = args.dtype or engine_dtype()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    longest = args.context + 4 * args.question + 256
    # one request at a time, and the prefix cache's blocks of the round before: a small
    # pool (a 1.5B model in float32 leaves little of a shared 24 GiB box)
    with engines(model=str(model_dir), served_model_name=served, dtype=dtype,
                 kv_tokens=4 * longest, max_model_len=longest,
                 l1_size_gb=args.l1_size_gb, vllm_args=args.vllm_arg, log=log,
                 connector_config={"stats_interval_s": 0}) as eng:
        with kvedit.connect(eng.url, eng.http_url, eng.model, timeout=180) as ctx:
            post = kvedit.openai_completion(eng.vllm_url, eng.model)
            loads = Loads(eng.log_path)
            _round(ctx, post, rng, args, 1, loads)   # warm-up: first-call costs of every path
            rounds = []
            for k in range(args.rounds):
                rounds.append(_round(ctx, post, rng, args, k, loads))
                r = rounds[-1]
                log(f"round {k + 1}/{args.rounds}: TTFT no repair {r['no_repair_ttft_s']:.3f} s,"
                    f" repair first token {r['repair_first_token_s']:.3f} s "
                    f"({r['ttft_vs_no_repair']:.2f}x), first token on the repaired cache "
                    f"{r['repaired_first_token_s']:.3f} s ({r['repaired_ttft_vs_no_repair']:.2f}x)")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {"bench": "repair", "model": args.model, "dtype": dtype,
           "context_tokens": args.context, "question_tokens": args.question,
           "policy": f"KeyDiff({args.ratio}) repaired by Repair(restore={args.restore})"
                     + (", per head" if args.per_head else ""),
           "repair": med, "rounds": rounds,
           "targets": {"repair.ttft_vs_no_repair": "<= 1.3"},
           "notes": "medians over rounds; ttft_vs_no_repair: the capture pass's answer token "
                    "(first_token=True) vs the question on the compressed cache; "
                    "repaired_ttft_vs_no_repair: the first token decoded on the repaired "
                    "cache (first_token=False).",
           "elapsed_s": time.perf_counter() - t0}
    print(json.dumps(out, indent=2))
    return 0

"""The accuracy part of `kvedit bench long` (without KV pressure): long-generation tasks (kvedit.harness.eval.longgen)
with and without a per-stream KV budget, on `kvedit eval`'s model (SmolLM2).

Arms, each on fresh streams of the same samples (greedy, stopping at EOS or max_tokens):
- none: prefill, then one decode of the whole count;
- rounds: the budgeted driver's decode rounds of K tokens with no edit (budget unlimited):
  what re-sending the sequence every K tokens alone changes (bf16: a round recomputes the
  tail chunk, so greedy decoding may take another branch), apart from what a budget drops;
- one per policy: `BatchedStream.run(..., HostBudget(B, K, policy), ...)` (the budgeted
  driver edits each stream whenever the next round would make it hold more than B tokens);
- engine_<policy> (with `bench long --in-engine`): the same budget kept inside vLLM
  (`run` given an `EngineBudget`: one request per stream, compacted in place). Count samples
  only: a recall question is a second turn, which one vLLM request cannot take, and
  re-sending the whole sequence would prefill it with full attention (recorded as skipped).
Recall samples then get their question appended (`Stream.append`) and decode the answer; in
the budgeted arms that last round holds at most B + question + answer tokens.
Accuracy per arm and task with a 95% Wilson interval (kvedit.harness.eval.stats): count: the
whole expected sequence produced (and the mean fraction produced before the first slip);
recall: the code restated. The engine's KV capacity is not limited here (accuracy, not
speed: that is the tiny-model part of bench long).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import kvedit
from kvedit.harness.eval import longgen
from kvedit.harness.eval.stats import accuracy
from kvedit.harness.eval.tokenizer import load
from kvedit.harness.experiment import block_size, engines
from kvedit.harness.models import MODELS, cached, default_dir
from kvedit.harness.vocab import greedy as _greedy
from kvedit.harness.vocab import policy

ARMS = ("none", "rounds", "streaming", "keynorm", "engine_streaming", "engine_keynorm")
ENGINE = "engine_"
UNLIMITED = 10**9  # the rounds arm's budget: never reached, so never an edit


@dataclass
class AccuracyConfig:
    samples: int = 8          # per task
    numbers: int = 200        # how many numbers each count has (~5 tokens each)
    note_tokens: int = 512    # recall: filler tokens around the code
    every: int = 64           # K
    budget: int = 512         # B
    chunk_size: int = 128
    arms: tuple[str, ...] = ARMS
    tasks: tuple[str, ...] = ("count", "recall")
    seed: int = 0


def cached_model(name: str = "smollm2") -> tuple[Path | None, str]:
    """The directory of `kvedit model NAME` when it has been built, else (None, why); a
    model directory as it is. Never builds: the bench does not download models."""
    if name not in MODELS:
        path = Path(name)
        return (path, "") if (path / "config.json").is_file() else \
            (None, f"--accuracy-model {name!r}: not {' or '.join(MODELS)} and not a model "
                   "directory (no config.json)")
    spec = MODELS[name]
    path = cached(spec)
    if path is not None:
        return path, ""
    return None, (f"{name} is not built at {default_dir(spec)}: run `kvedit model {name}` "
                  f"(downloads ~{spec.download_mb} MB once) or pass --accuracy-model none")


def _run_arm(ctx, completion, samples, arm: str, cfg: AccuracyConfig, tok) -> dict:
    salt = f"longacc-{arm}-{uuid.uuid4().hex[:8]}"
    batch = kvedit.BatchedStream(progress=False)
    streams = [batch.add(kvedit.create_request(ctx, completion, s.prompt_ids, cache_salt=salt,
                                               name=f"{s.task}-{s.index}")) for s in samples]
    most = max(s.max_tokens for s in samples)
    t0 = time.perf_counter()
    engine = arm.startswith(ENGINE)
    if arm == "none":
        batch.prefill(_greedy(1))
        batch.decode(_greedy(most))
    elif engine:
        batch.run(_greedy(1), kvedit.EngineBudget.from_policy(
            policy(arm[len(ENGINE):]), cfg.budget, cfg.every), _greedy(most))
    else:
        budget = UNLIMITED if arm == "rounds" else cfg.budget
        m = batch.run(_greedy(1), kvedit.HostBudget(
            budget, cfg.every, policy("streaming" if arm == "rounds" else arm)), _greedy(most))
        if arm == "rounds" and m.edit_rounds:
            raise RuntimeError(f"the rounds arm edited {m.edit_rounds} times; it must not")
    counted = {id(st): len(st.output_token_ids) for st in streams}
    # KV a request made the engine hold: the prefill holds the whole prompt (a recall prompt
    # can exceed B; the driver edits it before the first decode round), decode rounds <= B
    prefill_held = max(st.generations[0].prompt_tokens + 1 for st in streams)
    held = max((g.prompt_tokens + len(g.token_ids) for st in streams
                for g in st.generations[1:]), default=0)
    asking = [(st, s) for st, s in zip(streams, samples) if s.question_ids and not engine]
    if asking:
        for st, s in asking:
            st.append(s.question_ids)
        kvedit.BatchedStream([st for st, _ in asking], progress=False).decode(
            _greedy(max(s.answer_tokens for _, s in asking)))
    wall = time.perf_counter() - t0
    records = []
    for st, s in zip(streams, samples):
        n = counted[id(st)]
        text = tok.decode(st.output_token_ids[:n])
        score = s.score_count(text)
        rec = {"task": s.task, "index": s.index, "arm": arm, "generated": n,
               "count_fraction": score.fraction, "count_complete": score.complete}
        if not score.complete:
            rec["slip"] = _around_slip(text, score.produced)
        if s.question_ids and engine:
            rec.update(depth=s.depth, ok=None, skipped="a second turn (docstring)")
        elif s.question_ids:
            answer = tok.decode(st.output_token_ids[n:])
            rec.update(depth=s.depth, answer=answer, ok=s.recalled(answer))
        else:
            rec["ok"] = s.correct(text)
        records.append(rec)
    batch.release()
    return {"wall_s": wall, "max_prefill_tokens": prefill_held,
            "max_decode_request_tokens": held, "records": records}


def _around_slip(text: str, produced: int) -> str:
    """The generated text around the first number that broke the count."""
    import re

    found = list(re.finditer(r"\d+", text))
    at = found[produced].start() if produced < len(found) else len(text)
    return text[max(0, at - 40):at + 40]


def _summary(records, arm: str) -> dict:
    out = {}
    for task in sorted({r["task"] for r in records}):
        rs = [r for r in records if r["task"] == task and r["ok"] is not None]
        if not rs:
            out[task] = {"skipped": "no sample of this task runs in this arm"}
            continue
        acc = accuracy(r["ok"] for r in rs).to_dict()
        acc["mean_count_fraction"] = sum(r["count_fraction"] for r in rs) / len(rs)
        out[task] = acc
    return out


def run(cfg: AccuracyConfig, model_dir: Path, log) -> dict:
    """Start a kvedit server and a vLLM on model_dir, run every arm, return the JSON part."""
    tok = load(model_dir)
    samples = [s for task in cfg.tasks
               for s in longgen.samples(model_dir, task, cfg.samples, how_many=cfg.numbers,
                                        note_tokens=cfg.note_tokens, seed=cfg.seed)]
    longest = max(len(s.prompt_ids) + s.max_tokens + len(s.question_ids) + s.answer_tokens
                  for s in samples)
    t0 = time.perf_counter()
    arms = {}
    conn = {"in_engine": True} if any(a.startswith(ENGINE) for a in cfg.arms) else None
    with engines(model=str(model_dir), served_model_name=model_dir.name, dtype="bfloat16",
                 max_model_len=longest + block_size(), chunk_size=cfg.chunk_size,
                 log=log, connector_config=conn) as eng:
        ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=120)
        completion = kvedit.openai_completion(eng.vllm_url, eng.model)
        try:
            for arm in cfg.arms:
                log(f"accuracy arm {arm}: {len(samples)} samples ...")
                r = _run_arm(ctx, completion, samples, arm, cfg, tok)
                r["accuracy"] = _summary(r["records"], arm)
                log(f"  {arm}: {r['accuracy']} ({r['wall_s']:.0f} s)")
                arms[arm] = r
        finally:
            kvedit.close(ctx)
    return {"model": model_dir.name, "config": asdict(cfg), "arms": arms,
            "elapsed_s": time.perf_counter() - t0}


def from_args(args, log) -> dict:
    """The accuracy arms as the options ask, or why they did not run."""
    if args.accuracy_model == "none":
        return {"skipped": "--accuracy-model none"}
    model_dir, why = cached_model(args.accuracy_model)
    if model_dir is None:
        log(f"accuracy: skipped ({why})")
        return {"skipped": why}
    default = "none,rounds,streaming,keynorm" + (
        ",engine_streaming,engine_keynorm" if getattr(args, "in_engine", False) else "")
    arms = tuple(x.strip() for x in (args.accuracy_arms or default).split(",") if x.strip())
    bad = [x for x in arms if x not in ARMS]
    if bad or not arms:
        raise SystemExit(f"--accuracy-arms: unknown {bad}; expected some of {ARMS}")
    default_tasks = "count,recall" + (",restate" if "qwen" in args.accuracy_model else "")
    tasks = tuple(x.strip() for x in (args.accuracy_tasks or default_tasks).split(",")
                  if x.strip())
    if not tasks or any(t not in longgen.TASKS for t in tasks):
        raise SystemExit(f"--accuracy-tasks: got {tasks}; expected some of {longgen.TASKS}")
    cfg = AccuracyConfig(samples=args.accuracy_samples, numbers=args.accuracy_numbers,
                         every=args.accuracy_every, budget=args.accuracy_budget,
                         chunk_size=args.chunk_size, arms=arms, seed=args.seed, tasks=tasks,
                         note_tokens=args.accuracy_note_tokens)
    return run(cfg, model_dir, log)

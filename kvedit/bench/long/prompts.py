"""The streams' prompts of `kvedit bench long`: random token ids for the tiny model, or the
long-generation tasks (kvedit.harness.eval.longgen) of a real model, and how each arm's
outputs are scored against them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvedit.harness.eval import longgen
from kvedit.harness.eval.stats import accuracy
from kvedit.harness.eval.tokenizer import load
from kvedit.harness.models import MODELS, cached, default_dir
from kvedit.harness.vocab import TINY_SERVED, random_prompts


@dataclass
class Prompts:
    ids: list[list[int]]
    samples: list | None       # the tasks' samples (scored), None for random tokens
    model_dir: str | None      # None: the tiny model
    served: str                # the name vLLM serves it as


def model_dir(model: str | None) -> str | None:
    """--model as a directory: a built `kvedit model` name, or the directory given."""
    if model is None or model not in MODELS:
        if model is not None and not (Path(model) / "config.json").is_file():
            raise SystemExit(f"--model {model}: not a built model name ({', '.join(MODELS)}) "
                             "and not a model directory (no config.json)")
        return model
    path = cached(MODELS[model])
    if path is None:
        raise SystemExit(f"--model {model}: not built at {default_dir(MODELS[model])}; run "
                         f"`kvedit model {model}` first")
    return str(path)


def make(args) -> Prompts:
    """The run's prompts: args.tasks' samples for a real --model, else random tokens."""
    mdir = model_dir(args.model)
    served = Path(mdir).name if mdir else TINY_SERVED
    if not args.tasks:
        return Prompts(random_prompts(args.streams, args.prompt_len, args.seed), None, mdir,
                       served)
    if mdir is None:
        raise SystemExit("--tasks needs a real --model (the tiny model's weights are random)")
    samples = task_samples(args, mdir, args.streams)
    return Prompts([s.prompt_ids for s in samples], samples, mdir, served)


def task_samples(args, mdir: str, n: int) -> list:
    """n long-generation samples (tasks cycled over the streams, seeded), checked to fit."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in longgen.TASKS or t == "recall"]
    if bad or not tasks:
        raise SystemExit(f"--tasks: got {tasks}; expected some of count, restate (recall's "
                         "second turn does not fit one request per stream)")
    per = -(-n // len(tasks))
    pool = {t: longgen.samples(mdir, t, per, how_many=args.task_numbers,
                               note_tokens=args.prompt_len, seed=args.seed) for t in tasks}
    samples = [pool[tasks[i % len(tasks)]][i // len(tasks)] for i in range(n)]
    need = max(s.max_tokens for s in samples)
    if args.max_tokens < need:
        raise SystemExit(f"--max-tokens {args.max_tokens} is shorter than the tasks' "
                         f"answers ({need} tokens at --task-numbers {args.task_numbers})")
    return samples


def score(arm_outputs: dict, samples: list, mdir: str) -> dict:
    """Each arm's answers: per task, correct of n with a 95% Wilson interval."""
    tok = load(mdir)
    out = {}
    for arm, outputs in arm_outputs.items():
        ok = [(s.task, s.correct(tok.decode(ids))) for s, ids in zip(samples, outputs)]
        out[arm] = {t: accuracy(c for task, c in ok if task == t).to_dict()
                    for t in sorted({t for t, _ in ok})}
    return out

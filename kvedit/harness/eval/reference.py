"""`kvedit eval --reference kvpress`: the eval's prompts through kvpress, side by side.

kvedit's policies re-implement kvpress's presses; this arm runs kvpress itself on the same
token ids (context, question tails, greedy answers of the same length) with the same model
in transformers (bfloat16 on a GPU, as vLLM runs it there; float32 on the CPU), so each
shared method's accuracy can be read beside kvedit's. kvpress 0.5.5 pins transformers < 5.3
and vLLM's environment has a newer one, so kvpress runs apart, driven through a subprocess
that reads and writes JSON (`kvpress_worker.py`; never pickle), in one of two places:
- a site directory (`--reference-site DIR` or $KVEDIT_KVPRESS_SITE): kvpress and a
  transformers it accepts installed with `pip install --target DIR --no-deps` (SITE_WHEELS),
  put first on PYTHONPATH of this interpreter, whose torch (CUDA or not) it uses. For a
  machine without an index (a GPU host): the wheels are carried there;
- else its own virtual environment under the kvedit cache directory, created on first use
  with the pip command printed (`ensure_env`; CPU torch).

Pairs (kvedit policy: kvpress press, as configured here):
- SnapKV: SnapKVPress (kernel 5, its observation window the question text, as kvedit's
  SnapKV observes the question: kvpress's default window of 64 would be 9 question rows
  and 55 rows of the context's end, docs/eval.md) and TOVA: TOVAPress, each compressing the
  context together with the question text (kvpress's query-aware setting), at the ratio
  that drops as many tokens as the eval drops of the context;
- KeyDiff: KeyDiffPress; KeyNorm: KnormPress; LeverageScore: LeveragePress;
  RandomDrop: RandomPress;
- StreamingLLM: StreamingLLMPress, KVzip: KVzipPress and ExpectedAttention:
  ExpectedAttentionPress, with `n_sink` = the eval's header sink (the same rule kvedit's
  policies get);
- a head-adaptive budget (`budget=layer`): AdaKVPress around the scorer's press; KVzip's
  `budget=global` is KVzipPress itself, `budget=layer` KVzipPress(layerwise=True)
  (`pairing` says which options pair with what);
- AdaKV: AdaKVPress(SnapKVPress) with the question, kvpress-only.
kvpress keeps different tokens per KV head (equal counts per layer; KVzipPress and AdaKV
rank across heads, so counts differ per head) and keeps the original positions (masked
keys; no re-rotation); kvedit stores unequal counts with null-key pads
(kvedit.edits.budgets). Differences are discussed in docs/eval.md. The worker shares one
prefill between the presses of a sample (kvpress_shared.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KVPRESS_VERSION = "0.5.5"
TORCH_VERSION = "2.13.0"
WORKER = Path(__file__).with_name("kvpress_worker.py")
SITE_ENV = "KVEDIT_KVPRESS_SITE"
# What a site directory needs beside an interpreter that has torch, numpy, pandas, accelerate,
# peft, requests, pyarrow, fsspec, xxhash, huggingface-hub >= 1.3, safetensors, regex, tqdm,
# pyyaml, typer and jinja2 (the GPU image has these): kvpress imports datasets, cachetools and
# fire at import time; transformers 5.2 (the newest kvpress 0.5.5 accepts) checks at import
# that tokenizers is <= 0.23.0.
SITE_WHEELS = ("kvpress==0.5.5", "transformers==5.2.0", "tokenizers==0.22.2",
               "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "fire==0.6.0",
               "termcolor==3.3.0", "cachetools==5.5.2")

# kvedit policy class -> (press, kwargs, question in the compressed context)
PRESSES = {
    "SnapKV": ("SnapKVPress", {"window_size": "question"}, True),
    "TOVA": ("TOVAPress", {}, True),
    "KeyDiff": ("KeyDiffPress", {}, False),
    "KeyNorm": ("KnormPress", {}, False),
    "LeverageScore": ("LeveragePress", {}, False),
    "RandomDrop": ("RandomPress", {}, False),
    "StreamingLLM": ("StreamingLLMPress", {"n_sink": "sink"}, False),
    "KVzip": ("KVzipPress", {"n_sink": "sink"}, False),
    "ExpectedAttention": ("ExpectedAttentionPress", {"n_sink": "sink"}, False),
}
EXTRA = {"AdaKV": ("AdaKVPress", {"inner": "SnapKVPress", "window_size": "question"}, True)}


def env_dir() -> Path:
    from kvedit.harness.cache import cache_root

    return cache_root() / f"kvpress-{KVPRESS_VERSION}-venv"


def pip_command(target: Path) -> list[list[str]]:
    return [[sys.executable, "-m", "venv", str(target)],
            [str(target / "bin" / "pip"), "install", "--quiet", f"torch=={TORCH_VERSION}",
             f"kvpress=={KVPRESS_VERSION}"]]


PROBE = f"import kvpress, importlib.metadata as m; assert m.version('kvpress') == " \
        f"{KVPRESS_VERSION!r}, m.version('kvpress')"


def _works(python: Path) -> bool:
    try:
        return subprocess.run([str(python), "-c", PROBE], capture_output=True,
                              timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(frozen=True)
class Runtime:
    """Where the kvpress worker runs: its interpreter and what its environment adds."""
    python: Path
    env: dict
    where: str   # for the log and the JSON


def site_env(site: Path) -> dict:
    """The worker's environment additions for a site directory: it goes first on the path,
    so its transformers shadows the interpreter's own."""
    return {"PYTHONPATH": str(site)}


def check_site(site: Path) -> None:
    """kvpress imports from `site` with this interpreter, or a ValueError that says what is
    missing and which wheels the directory needs."""
    if not site.is_dir():
        raise ValueError(f"kvpress site directory {site} does not exist: make it with "
                         f"`pip install --target {site} --no-deps {' '.join(SITE_WHEELS)}`")
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **site_env(site)})
    if run.returncode:
        raise ValueError(f"kvpress {KVPRESS_VERSION} does not import from {site} with "
                         f"{sys.executable}:\n{run.stderr.strip()[-1500:]}\nthe directory "
                         f"needs (pip install --target {site} --no-deps ...): "
                         f"{' '.join(SITE_WHEELS)}")


def runtime(site: str | None, log=print) -> Runtime:
    """The site directory if one is given (argument, else $KVEDIT_KVPRESS_SITE), checked;
    else kvpress's own venv (built on first use)."""
    site = site or os.environ.get(SITE_ENV)
    if site:
        path = Path(site).expanduser().resolve()
        check_site(path)
        return Runtime(Path(sys.executable), site_env(path), f"site {path}")
    python = ensure_env(log)
    return Runtime(python, {}, f"venv {python.parent.parent}")


def ensure_env(log=print) -> Path:
    """kvpress's interpreter: the environment under the kvedit cache, created if missing.
    Built in place (a virtual environment cannot be moved) and marked complete at the end;
    one without the mark, or where kvpress does not import, is built again."""
    import fcntl

    target = env_dir()
    python, done = target / "bin" / "python", target / "kvedit-complete"
    if done.exists() and _works(python):
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then reuse it
        if done.exists() and _works(python):
            return python
        return _build(target, python, done, log)


def _build(target: Path, python: Path, done: Path, log) -> Path:
    import shutil

    log(f"kvpress {KVPRESS_VERSION} pins transformers < 5.3 (vLLM's environment has a newer "
        f"one): creating its own environment in {target} (a few minutes, ~1.5 GB):")
    shutil.rmtree(target, ignore_errors=True)
    for cmd in pip_command(target):
        log("  $ " + " ".join(cmd))
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"creating kvpress's environment failed ({' '.join(cmd)}):\n"
                               f"{run.stderr[-2000:]}")
    if not _works(python):
        raise RuntimeError(f"{target}: kvpress {KVPRESS_VERSION} does not import there; "
                           f"remove the directory and run again")
    done.write_text(f"kvpress=={KVPRESS_VERSION} torch=={TORCH_VERSION}\n")
    return python


def pairing(spec: str, sink: int | None) -> tuple[str, dict, bool] | None:
    """(press, kwargs, question in context) of a kvedit --policies entry or class name, or
    None where kvpress has no press configured alike. Presses select per KV head, so
    `per_head` and `positions` pair with the same press; `budget="layer"` is AdaKVPress
    around the scorer's press (its alpha_safeguard 0.2 is kvedit's `alpha` default); KVzip's
    `budget="global"` (and, as before, KVzip per token) is KVzipPress, `"layer"` KVzipPress
    with `layerwise`; any other option configures the policy unlike the press."""
    from kvedit.edits import POLICIES
    from kvedit.harness.eval.policyspec import parse_spec

    name, opts = parse_spec(spec) if spec in POLICIES or ":" in spec else (None, {})
    cls = POLICIES[name].__name__ if name else spec
    if cls not in {**PRESSES, **EXTRA}:
        return None
    press, kwargs, question = {**PRESSES, **EXTRA}[cls]
    kwargs = {k: (sink or 4) if v == "sink" else v for k, v in kwargs.items()}
    per_head, budget = opts.pop("per_head", False), opts.pop("budget", "uniform")
    opts.pop("positions", None)
    if opts and set(opts) != {"alpha"} or opts.get("alpha", 0.2) != 0.2:
        return None
    if cls == "KVzip":
        if budget == "layer":
            return press, {**kwargs, "layerwise": True}, question
        return None if per_head and budget == "uniform" else (press, kwargs, question)
    if budget == "layer":
        return "AdaKVPress", {"inner": press, **kwargs}, question
    return None if budget == "global" else (press, kwargs, question)


def arms(policies: list[str], ratios: list[float], sink: int | None) -> list[dict]:
    """The worker's arms: the unedited baseline, then every press with a kvedit peer (and
    AdaKV(SnapKV), kvpress-only) at every ratio; `policies` are --policies entries (or class
    names). Policies that pair with the same press share its arm (`policies`: their labels;
    `policy`: the first)."""
    from kvedit.edits import POLICIES
    from kvedit.harness.eval.policyspec import label

    out = [{"press": None, "ratio": 0.0, "policy": None, "policies": [None],
            "question_in_context": False}]
    seen: dict[str, dict] = {}
    named = [(p, pairing(p, sink)) for p in policies] + [
        (name, pairing(name, sink)) for name in EXTRA]
    for spec, paired in named:
        if paired is None:
            continue
        press, kw, question = paired
        tag = label(spec) if ":" in spec or spec in POLICIES else spec
        for r in ratios:
            key = json.dumps([press, kw, r, question], sort_keys=True)
            if key in seen:
                seen[key]["policies"].append(tag)
                continue
            seen[key] = {"press": press, "kwargs": kw, "ratio": r, "policy": tag,
                         "policies": [tag], "question_in_context": question}
            out.append(seen[key])
    return out


def _split(tail: list[int], closing: list[int]) -> int:
    """Where the question text ends in a tail (the chat template's closing starts)."""
    for i in range(len(tail) - len(closing) + 1):
        if tail[i:i + len(closing)] == closing:
            return i
    return len(tail)


def job(samples, tok, model_dir: Path, arm_list: list[dict], *, threads: int = 1,
        deadline: float | None = None, alone: bool = False) -> dict:
    """The worker's input. `deadline`: epoch seconds after which it starts no sample that
    would end past it (judged by its samples so far); `alone`: every press on its own
    prefill through kvpress's pipeline (else one prefill shared, kvpress_shared.py)."""
    closing = tok.encode(tok.after_user)
    return {"model_dir": str(model_dir), "threads": threads, "deadline": deadline,
            "alone": alone, "arms": arm_list, "samples": [
        {"id": i, "context": s.prompt_ids[:s.length],
         "split": _split(list(s.questions[0].tail), closing),
         "questions": [list(q.tail) for q in s.questions[:1]], "max_tokens": s.max_tokens}
        for i, s in enumerate(samples)]}


def run_workers(python: Path, payload: dict, workers: int, log=print,
                env_extra: dict | None = None) -> list[dict]:
    """Split the samples over `workers` processes (`payload["threads"]` threads each), feed
    each its JSON, collect their JSON lines (their stderr is their progress, logged when
    they end)."""
    from concurrent.futures import ThreadPoolExecutor

    samples = payload["samples"]
    parts = [samples[k::workers] for k in range(workers) if samples[k::workers]]
    env = {**os.environ, "OMP_NUM_THREADS": str(payload.get("threads") or 1),
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
           **(env_extra or {})}

    def one(part: list[dict]) -> str:
        p = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out, err = p.communicate(json.dumps({**payload, "samples": part}))
        if p.returncode:
            raise RuntimeError(f"the kvpress worker failed (exit {p.returncode}):\n"
                               f"{err[-3000:]}")
        if err.strip():
            log(err.strip().splitlines()[-1])
        return out

    with ThreadPoolExecutor(len(parts)) as pool:
        outs = list(pool.map(one, parts))
    return [json.loads(x) for out in outs for x in out.splitlines() if x.startswith("{")]


def run_reference(cfg, model_dir: Path, samples, tok, sink: int | None, *, log=print,
                  workers: int | None = None,
                  deadline: float | None = None) -> tuple[dict, list[dict]]:
    """The kvpress arm: (accuracy per press and ratio with 95% Wilson intervals on
    `samples`, every answer as a record). On a GPU (the site route with a CUDA torch) one
    worker runs bfloat16 there; on the CPU two single-threaded workers run float32.
    `deadline` (epoch seconds): no sample starts that would end past it."""
    from kvedit.harness.eval.report import summarize

    ratios = cfg.reference_ratios or cfg.ratios
    arm_list = arms(list(cfg.policies), ratios, sink)
    rt = runtime(getattr(cfg, "reference_site", None), log)
    gpu = bool(rt.env) and _cuda()
    workers = workers or (1 if gpu else max(1, min(2, os.cpu_count() or 1)))
    threads = max(1, (os.cpu_count() or 1) // workers) if gpu else 1
    log(f"kvpress: {len(samples)} samples x {len(arm_list)} arms in {workers} process(es) "
        f"({rt.where}, {'CUDA bfloat16' if gpu else 'CPU float32'})")
    lines = run_workers(rt.python, job(samples, tok, model_dir, arm_list, threads=threads,
                                       deadline=deadline), workers, log, rt.env)
    by_arm: dict[tuple, list[dict]] = {}
    for line in lines:
        s, a = samples[line["id"]], arm_list[line["arm"]]
        text = line["answers"][0]
        for policy in a["policies"]:   # one record per kvedit policy the press pairs with
            by_arm.setdefault((line["arm"], policy), []).append(
                {"seed": s.seed, "task": s.task, "length": s.length, "depth": s.depth,
                 "index": s.index, "press": a["press"], "policy": policy,
                 "ratio": a["ratio"], "ok": s.correct(text), "answer": list(s.answers),
                 "output": text})
    base, rows = summarize(by_arm.get((0, None), []), [
        {"policy": p, "ratio": a["ratio"], "press": a["press"],
         "records": by_arm.get((i, p), [])}
        for i, a in enumerate(arm_list) if i > 0 for p in a["policies"]])
    keep = ("policy", "press", "ratio", "accuracy", "ci", "correct", "n", "by_task")
    done = len({line["id"] for line in lines})
    return {"kvpress": KVPRESS_VERSION, "precision": "bfloat16" if gpu else "float32",
            "runtime": f"transformers, {'CUDA' if gpu else 'CPU'} ({rt.where})",
            "samples_done": done, "samples": len(samples),
            "baseline": {k: base[k] for k in ("accuracy", "ci", "correct", "n", "by_task")},
            "results": [{k: r[k] for k in keep} for r in rows]}, \
        [r for recs in by_arm.values() for r in recs]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

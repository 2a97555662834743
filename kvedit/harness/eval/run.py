"""`kvedit eval` orchestration: engines up, suite generated, accuracy cells, gain arms, report."""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class EvalConfig:
    model: str = "smollm2"
    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [512])
    samples: int = 5
    policies: list[str] = field(default_factory=list)
    ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    granularity: str = "token"
    seeds: list[int] = field(default_factory=lambda: [0])  # one suite per seed, one run
    gain: bool = True
    gain_prompts: int | None = None
    gain_each: bool = False  # one gain arm per cell, not per kept size
    progress: bool = True
    chunk_size: int = 128
    # Every policy with a `sink` option keeps the prompt's header (template opening +
    # instruction) whole, as a user protects a system prompt: `sink = header tokens`, the
    # same for every such policy and ratio (header_sink). False: each policy's own default.
    keep_header: bool = True
    # Every further question of multi-question samples is asked of the same edited cache
    # (the reuse suite, runner.py).
    reuse: bool = True
    # "kvpress": the same samples through kvpress's presses in transformers (reference.py).
    reference: str | None = None
    reference_ratios: list[float] | None = None  # None: the eval's ratios
    per_head: bool | None = None    # None: each policy's default (kvedit.edits.base)
    positions: str | None = None    # None: each policy's default ("compact" / "logical")

    @property
    def seed(self) -> int:
        """The first seed (the decode-gain workload's)."""
        return self.seeds[0]


def parse_spec(spec: str) -> tuple[str, dict]:
    """A --policies entry: a registry name, optionally with dataclass options
    (`snapkv:per_head=off:positions=compact`) -> (name, options)."""
    from dataclasses import fields

    from kvedit.edits import POLICIES

    name, *opts = spec.split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    known = {f.name: f for f in fields(POLICIES[name])}
    out: dict = {}
    for opt in opts:
        key, eq, text = opt.partition("=")
        if not eq or key not in known or key in ("ratio", "granularity"):
            raise ValueError(f"{spec!r}: {opt!r} is not option=value of {POLICIES[name].__name__}"
                             f" (options: {sorted(set(known) - {'ratio', 'granularity'})})")
        out[key] = _value(text)
    return name, out


def _value(text: str):
    low = text.lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def label(spec: str) -> str:
    """How results name a --policies entry: the class name and its options."""
    from kvedit.edits import POLICIES

    name, opts = parse_spec(spec)
    return POLICIES[name].__name__ + "".join(f":{k}={v}" for k, v in opts.items())


def sink_policies() -> list[str]:
    """Registry names of the policies that have a `sink` option (keep the first n tokens)."""
    from dataclasses import fields

    from kvedit.edits import POLICIES

    return [k for k, cls in POLICIES.items() if any(f.name == "sink" for f in fields(cls))]


def header_sink(samples, keep_header: bool) -> int | None:
    """The `sink` the eval gives policies that have one: the header's token count, which
    every sample of a suite shares (one template, one instruction); None: policy defaults."""
    if not keep_header:
        return None
    sizes = {s.header for s in samples}
    if len(sizes) != 1 or not min(sizes):
        raise ValueError(f"the samples' header lengths differ or are unknown ({sorted(sizes)}): "
                         "one sink cannot protect them all")
    return sizes.pop()


def make_policy(name: str, ratio: float, granularity: str, sink: int | None = None, *,
                per_head: bool | None = None, positions: str | None = None):
    """POLICIES[name] at `ratio` (`name` may carry options, parse_spec); `sink` (the header,
    see header_sink) to those that have one; `per_head` and `positions` override the
    policy's defaults when given; the name's own options override all."""
    from kvedit.harness.vocab import policy

    name, opts = parse_spec(name)
    kw: dict = {}
    if per_head is not None:
        kw["per_head"] = per_head
    if positions is not None:
        kw["positions"] = positions
    return policy(name, ratio=ratio, granularity=granularity, sink=sink, **{**kw, **opts})


def needs_queries(policies: list[str]) -> bool:
    """Some policy scores from the prompt's captured queries: the prefills must capture
    them."""
    from kvedit.edits import POLICIES

    classes = [POLICIES[parse_spec(n)[0]] for n in policies]
    return any(c.needs_queries and not c.needs_reconstruction for c in classes)


def needs_reconstruction(policies: list[str]) -> bool:
    """Some policy scores from KVzip's reconstruction pass: run it once per sample."""
    from kvedit.edits import POLICIES

    return any(POLICIES[parse_spec(n)[0]].needs_reconstruction for n in policies)


def query_aware(policy_label: str) -> bool:
    """Whether the policy (a result's label, `label`) scores with the question's queries."""
    from kvedit.edits import POLICIES

    name = policy_label.split(":")[0]
    cls = next(c for c in POLICIES.values() if c.__name__ == name)
    return cls.needs_queries and not cls.needs_reconstruction


def reconstruction_for(tok):
    """KVzip's pass for the eval's prompts: the paper's repeat prompt closed by the chat
    template's end of user turn and assistant opening, repeating the context from after the
    template's opening (as kvpress)."""
    from kvedit.harness.eval.runner import Reconstruction
    from kvedit.sdk.kvzip import REPEAT_PROMPT

    return Reconstruction(tok.encode(REPEAT_PROMPT + tok.after_user),
                          len(tok.encode(tok.before_user)))


def run_eval(cfg: EvalConfig, out: Path, *, log=print, engines_kw: dict | None = None) -> dict:
    """The whole eval; writes results.json, samples.jsonl and the charts into `out` and
    returns the JSON result. `engines_kw` overrides kvedit.harness.experiment.engines
    arguments (tests pass the session's server and vLLM)."""
    from kvedit.harness.vocab import resolve_model
    from kvedit.harness.eval.tokenizer import load

    t0 = time.perf_counter()
    engines_kw = dict(engines_kw or {})
    model_dir, served = resolve_model(cfg.model)
    tok = load(model_dir)
    run = _Run(cfg, model_dir, tok, log, t0)
    run.engines_kw(engines_kw.get("served_model_name", served), engines_kw)
    with ExitStack() as stack:
        if "server_url" not in run.kw:
            from kvedit.launch.server import start_server

            gb = run.server_gb()
            log(f"starting kvedit server (L1 {gb:g} GB, chunk {cfg.chunk_size}) ...")
            server = stack.enter_context(start_server(gb, chunk_size=cfg.chunk_size))
            run.kw.update(server_url=server.url, server_http_url=server.http_url)
        run.accuracy()
        if cfg.gain:
            run.gain()
    if cfg.reference:
        run.reference()
    return run.write(out)


class _Run:
    """One eval's state, phase by phase: accuracy cells, gain arms, reference, report."""

    def __init__(self, cfg: EvalConfig, model_dir: Path, tok, log, t0: float):
        from kvedit.harness.eval.tasks import suite

        self.cfg, self.model_dir, self.tok, self.log, self.t0 = cfg, model_dir, tok, log, t0
        self.samples = [s for seed in cfg.seeds
                        for s in suite(tok, cfg.tasks, cfg.lengths, cfg.samples, seed=seed)]
        self.sink = header_sink(self.samples, cfg.keep_header)
        self.tails = [len(s.prompt_ids) - s.length for s in self.samples]
        if max(self.tails) >= cfg.chunk_size:
            raise ValueError(f"a question takes {max(self.tails)} tokens, more than a chunk "
                             f"({cfg.chunk_size}): it would be editable")
        self.timings: dict = {}
        self.rows: list[dict] = []
        self.base_records: list[dict] = []
        self.reference_result = self.reference_records = None

    def server_gb(self) -> float:
        """L1 for the server eval starts: every sample's original chunks (held for the whole
        run) and captured queries (the question's; KVzip's pass: ~the context's rows), one
        cell's edited chunks, with KVzip the pass's own chunks (the repeat and the second
        copy of the context, stored before they are deleted: were they not counted, LRU
        would evict the pass's queries under them), with room to spare; at least 2 GB."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        layers, heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads")
        qheads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // qheads
        kv_token = 2 * layers * (heads or qheads) * head_dim * 2          # bf16 K and V
        q_row = layers * qheads * head_dim * 2
        context = sum(s.length for s in self.samples)
        rows, copies = sum(self.tails), 2
        if needs_reconstruction(self.cfg.policies):
            rows, copies = rows + context, 3
        need = copies * context * kv_token + rows * q_row
        return max(2.0, round(1.5 * need / 1e9 + 0.5))

    def policy(self, name: str, ratio: float):
        return make_policy(name, ratio, self.cfg.granularity, self.sink,
                           per_head=self.cfg.per_head, positions=self.cfg.positions)

    def engines_kw(self, served: str, overrides: dict) -> None:
        from kvedit.harness.eval.gain import GainConfig
        from kvedit.harness.experiment import block_size

        cfg = self.cfg
        self.gcfg = GainConfig(seed=cfg.seed)
        if cfg.gain_prompts:
            self.gcfg.num_prompts = cfg.gain_prompts
        self.gcfg.validate()
        self.bs = block_size()
        longest = max(len(s.prompt_ids) for s in self.samples) + max(
            s.max_tokens for s in self.samples)
        if needs_reconstruction(cfg.policies):  # context + repeat prompt + context
            longest = max(longest, 2 * max(cfg.lengths)
                          + len(reconstruction_for(self.tok).repeat_ids))
        self.kw = dict(model=str(self.model_dir), served_model_name=served, dtype="bfloat16",
                       max_model_len=longest + self.bs, chunk_size=cfg.chunk_size, log=self.log)
        self.kw.update(overrides)

    def accuracy(self) -> None:
        from tqdm.auto import tqdm

        from kvedit.harness.eval.runner import AccuracyRun, Cell
        from kvedit.harness.experiment import engines

        cfg, log = self.cfg, self.log
        cells = [Cell(p, r) for p in cfg.policies for r in cfg.ratios]
        log(f"{len(self.samples)} samples ({', '.join(cfg.tasks)} at {cfg.lengths} tokens, "
            f"seeds {cfg.seeds}), {len(cells)} policy x ratio cells, model {self.model_dir}")
        with engines(**self.kw) as eng:
            self.timings["start_s"] = time.perf_counter() - self.t0
            with _session(eng) as (ctx, completion):
                odd = sorted({n for n in cfg.lengths if n % ctx.chunk_size})
                if odd:
                    raise ValueError(f"lengths {odd} are not whole chunks of the server's "
                                     f"{ctx.chunk_size} tokens: part of a question would be "
                                     "editable")
                zipped = needs_reconstruction(cfg.policies)
                acc = AccuracyRun(ctx, completion, self.samples, self.tok.decode,
                                  progress=False, capture=needs_queries(cfg.policies),
                                  reconstruction=reconstruction_for(self.tok) if zipped
                                  else None, reuse=cfg.reuse)
                log("accuracy: prefill every sample once" + (", run KVzip's reconstruction "
                    "pass" if zipped else "") + ", decode the baseline")
                self.base_records, self.timings["baseline"] = acc.baseline()
                bar = tqdm(cells, desc="accuracy (policy x ratio)", disable=not cfg.progress)
                for c in bar:
                    bar.set_postfix_str(c.label)
                    recs, info = acc.cell(self.policy(c.policy, c.ratio), c)
                    self.rows.append({"policy": label(c.policy), "ratio": c.ratio,
                                      "records": recs, **info})
                acc.close()
        self.timings["accuracy_s"] = time.perf_counter() - self.t0 - self.timings["start_s"]
        self.cells = cells

    def gain(self) -> None:
        from kvedit.harness.experiment import engines

        t1 = time.perf_counter()
        gcfg, bs = self.gcfg, self.bs
        gkw = {**self.kw, "kv_tokens": gcfg.kv_blocks * bs,
               "max_model_len": gcfg.prompt_len + gcfg.max_tokens + bs}
        if "vllm_url" in gkw:
            raise ValueError("the decode-gain arms start their own KV-bound vLLM: "
                             "run with gain=False against an existing vLLM")
        with engines(**gkw) as eng, _session(eng) as (ctx, completion):
            _gains(ctx, completion, eng, gcfg, bs, self.cells, self.rows, self)
        self.timings["gain_s"] = time.perf_counter() - t1

    def reference(self) -> None:
        from kvedit.harness.eval.reference import run_reference

        t1 = time.perf_counter()
        self.reference_result, self.reference_records = run_reference(
            self.cfg, self.model_dir, self.samples, self.tok, self.sink, log=self.log)
        self.timings["reference_s"] = time.perf_counter() - t1

    def result(self) -> dict:
        from kvedit.harness.eval import report

        cfg, rows = self.cfg, self.rows
        base, results = report.summarize(self.base_records, rows)
        seeds = report.by_seed(self.base_records, rows, cfg.seeds)
        reuse = report.reuse(self.base_records, rows, query_aware) if cfg.reuse else None
        reference = self.reference_result
        if reference is not None:
            reference["side_by_side"] = report.side_by_side(results, reference)
        self.timings["total_s"] = time.perf_counter() - self.t0
        for row in results:
            row.pop("gain_baseline", None)
        return {
            "model": cfg.model, "model_dir": str(self.model_dir),
            "config": {**asdict(cfg), "gain_workload": asdict(self.gcfg) if cfg.gain else None,
                       "samples_total": len(self.samples),
                       "header_sink": ({"tokens": self.sink, "policies": [
                           label(k) for k in cfg.policies
                           if parse_spec(k)[0] in sink_policies()]}
                           if self.sink is not None else None),
                       "query_window": ("the prompt's un-editable tail (question + answer "
                                        f"prime), {min(self.tails)}-{max(self.tails)} tokens"
                                        if needs_queries(cfg.policies) else None)},
            "baseline": base, "results": results,
            "pooled": report.compact(base, results),
            "seeds": seeds, "reuse": reuse, "reference": reference,
            "kvzip_cost": report.kvzip_cost(self.timings.get("baseline", {})),
            "gain_baseline": rows and rows[0].get("gain_baseline"),
            "acceptance": report.acceptance(base, results, seeds, reuse, reference),
            "timings": self.timings,
            "notes": ("accuracy: greedy; a sample is correct when every expected number is in "
                      "the answer. baseline/results: pooled over the seeds (seeds: each on "
                      "its own); reuse: every question of the multi-question samples, asked "
                      "of one edited cache. kept_fraction: context tokens that survive the "
                      "edit (stored or recomputed); query-aware policies (SnapKV, TOVA) score "
                      "with the queries vLLM captured for the prompt's tail (the question), "
                      "KVzip with those of its reconstruction pass; decode_gain: wall-clock "
                      "decode throughput vs the unedited batch, step_gain: decode tokens per "
                      "vLLM engine step (contention-free)."),
        }

    def write(self, out: Path) -> dict:
        from kvedit.harness.eval import report

        result = self.result()
        base, results = result["baseline"], result["results"]
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))
        _jsonl(out / "samples.jsonl",
               self.base_records + [r for row in self.rows for r in row["records"]])
        charts = report.charts(base, results, out, f"{self.model_dir.name}, "
                               f"{len(self.samples)} samples ({', '.join(self.cfg.tasks)}; "
                               f"{'/'.join(map(str, self.cfg.lengths))} tokens; seeds "
                               f"{','.join(map(str, self.cfg.seeds))})")
        if result["reference"] is not None:
            _jsonl(out / "kvpress_samples.jsonl", self.reference_records)
            charts.append(report.side_by_side_chart(result["reference"]["side_by_side"],
                                                    out / "kvedit_vs_kvpress.png"))
        (out / "table.md").write_text(report.markdown(base, results))
        self.log("\n" + report.table(base, results))
        self.log(f"\nacceptance: {json.dumps(result['acceptance'])}")
        self.log(f"wrote {out / 'results.json'}, {out / 'samples.jsonl'}, "
                 + ", ".join(str(p) for p in charts)
                 + f" in {result['timings']['total_s']:.0f} s")
        return result


def _jsonl(path: Path, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _class(key: str) -> str:
    from kvedit.edits import POLICIES

    return POLICIES[key].__name__


@contextmanager
def _session(eng):
    import kvedit

    ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=180)
    completion = kvedit.openai_completion(eng.vllm_url, eng.model)
    try:
        yield ctx, completion
    finally:
        kvedit.close(ctx)


def _kept(policy, tokens: int) -> int:
    """Tokens `policy` keeps of `tokens` (from its units; no KV needed)."""
    units = policy.units(tokens, None)
    return tokens - policy.num_drop(units) * units.size


def _gains(ctx, completion, eng, gcfg, bs, cells, rows, run: _Run) -> None:
    from tqdm.auto import tqdm

    from kvedit.harness.eval.gain import GainRun

    cfg = run.cfg
    run.log(f"decode gain: {gcfg.num_prompts} prompts x {gcfg.prompt_len} tokens, "
            f"{gcfg.max_tokens} output tokens, KV capacity {gcfg.kv_blocks} blocks")
    policies = [run.policy(c.policy, c.ratio) for c in cells]
    # One arm per kept size (or per cell): the first cell of each group runs it.
    group = [i if cfg.gain_each else _kept(p, gcfg.prompt_len) for i, p in enumerate(policies)]
    first = {k: i for i, k in reversed(list(enumerate(group)))}
    capture = any(policies[i].needs_queries for i in first.values())
    g = GainRun(ctx, completion, eng.vllm_url, gcfg, bs, progress=False, capture=capture)
    try:
        g.prefill()
        g.arm()  # baseline, first
        arms = {}
        for k, i in tqdm(sorted(first.items(), key=lambda kv: kv[1]), desc="decode gain",
                         disable=not cfg.progress):
            arms[k] = (cells[i].label, g.arm(policies[i]))
        g.arm()  # baseline, last
        ref = g.reference()
        for row, k in zip(rows, group):
            label, arm = arms[k]
            row.update(GainRun.gains(arm, ref), gain_arm=label)
        rows[0]["gain_baseline"] = ref
    finally:
        g.close()

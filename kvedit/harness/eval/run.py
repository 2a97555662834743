"""`kvedit eval` orchestration: engines up, suite generated, accuracy cells, gain arms, report.
The phases live in their own modules: how large the run is (sizing.py), the accuracy cells
(cells.py) and what the run leaves (result.py); this one runs them in order.

The accuracy phase runs the samples in groups (schedule.py: rounds over task x length x
seed), each group whole before the next: prefill, baseline, the no-op edit, every policy x
ratio. results.json is rewritten after every cell (`"partial": true` until the end) and every
answer appended to samples.jsonl as it comes, so a run that is killed, or stopped by its
`deadline_s`, leaves the figures of what finished, with their counts.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvedit.harness.eval import result as results_file
from kvedit.harness.eval.cells import Accuracy, session
from kvedit.harness.eval.policyspec import header_sink, make_policy
from kvedit.harness.eval.schedule import Deadline
from kvedit.harness.eval.sizing import Sizing


@dataclass
class EvalConfig:
    model: str = "smollm2"
    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [512])
    samples: int = 5
    # The first `sample_offset` samples of every task x length x seed are skipped: a run cut
    # short (a deadline, the box) is finished by a second run over the rest, then pooled.
    sample_offset: int = 0
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
    # A PYTHONPATH directory holding kvpress and a transformers it accepts, run with this
    # interpreter (None: $KVEDIT_KVPRESS_SITE, else kvpress's own venv; reference.py).
    reference_site: str | None = None
    # With deadline_s: the part of it the kvpress arm gets (it runs after the accuracy phase).
    reference_share: float = 0.3
    per_head: bool | None = None    # None: each policy's default (kvedit.edits.base)
    positions: str | None = None    # None: each policy's default ("compact" / "logical")
    # Seconds from the start after which no group, cell or arm starts (schedule.Deadline).
    deadline_s: float | None = None
    # Samples per group (schedule.rounds); None: every sample in one group, or one round
    # (one sample of every task x length x seed) when deadline_s is set.
    group_size: int | None = None
    noop: bool = True        # the no-op edit's cell (its answers against the baseline's)
    in_flight: int | None = None   # requests at once per batch; None: 16 on CPU, 64 on a GPU
    # Streams edited at once (BatchedStream's modify_concurrency); None: 2 on CPU, 4 on a GPU.
    modify_concurrency: int | None = None
    # Cells of a group run at once (AccuracyRun.cells): their requests share the engine's
    # batches. None: 1 on CPU (two cores gain nothing), 4 on a GPU.
    cells_at_once: int | None = None
    # Where policies run their edit (DropPolicy.edit_device): "auto" = CUDA when this
    # process sees one, else where the KV is (the host).
    edit_device: str = "auto"

    @property
    def seed(self) -> int:
        """The first seed (the decode-gain workload's)."""
        return self.seeds[0]


def run_eval(cfg: EvalConfig, out: Path, *, log=print, engines_kw: dict | None = None) -> dict:
    """The whole eval; writes results.json, samples.jsonl and the charts into `out` and
    returns the JSON result. `engines_kw` overrides kvedit.harness.experiment.engines
    arguments (tests pass the session's server and vLLM)."""
    from kvedit.harness.eval.tokenizer import load
    from kvedit.harness.vocab import resolve_model

    t0 = time.perf_counter()
    engines_kw = dict(engines_kw or {})
    model_dir, served = resolve_model(cfg.model)
    run = EvalRun(cfg, model_dir, load(model_dir), log, t0, out,
                  engine_here="vllm_url" not in engines_kw)
    kw = run.sizing.engines(engines_kw.get("served_model_name", served), engines_kw)
    with ExitStack() as stack:
        if "server_url" not in kw:
            from kvedit.launch.server import start_server

            gb = run.sizing.server_gb()
            log(f"starting kvedit server (L1 {gb:g} GB, chunk {cfg.chunk_size}) ...")
            server = stack.enter_context(start_server(gb, chunk_size=cfg.chunk_size))
            kw.update(server_url=server.url, server_http_url=server.http_url)
        run.acc.run(out)
        if cfg.gain:
            run.gain()
    if cfg.reference:
        run.reference()
    return run.write()


class EvalRun:
    """One eval, phase by phase: the suite and its sizes (`sizing`), the accuracy cells
    (`acc`), the gain arms, the kvpress reference, and what it leaves (result.py)."""

    def __init__(self, cfg: EvalConfig, model_dir: Path, tok, log, t0: float, out: Path, *,
                 engine_here: bool = True):
        from kvedit.harness.eval.gain import GainConfig
        from kvedit.harness.eval.tasks import suite

        self.cfg, self.model_dir, self.tok, self.log, self.t0 = cfg, model_dir, tok, log, t0
        self.out = out
        self.samples = [s for seed in cfg.seeds
                        for s in suite(tok, cfg.tasks, cfg.lengths, cfg.samples, seed=seed)
                        if s.index >= cfg.sample_offset]
        self.sink = header_sink(self.samples, cfg.keep_header)
        self.tails = [len(s.prompt_ids) - s.length for s in self.samples]
        if max(self.tails) >= cfg.chunk_size:
            raise ValueError(f"a question takes {max(self.tails)} tokens, more than a chunk "
                             f"({cfg.chunk_size}): it would be editable")
        # engine_here: this run starts its vLLM (not --vllm-url's), whose host memory counts
        self.sizing = Sizing(cfg, model_dir, tok, self.samples, log, engine_here=engine_here)
        # The accuracy phase's deadline: the run's, less the kvpress arm's share.
        share = cfg.reference_share if cfg.reference else 0.0
        self.deadline = Deadline(None if cfg.deadline_s is None
                                 else cfg.deadline_s * (1 - share))
        self.timings: dict = {}
        self.acc = Accuracy(cfg, self.sizing, tok, self.deadline, self.policy, self.checkpoint,
                            log, t0, self.timings)
        self.gcfg = GainConfig(seed=cfg.seed)
        if cfg.gain_prompts:
            self.gcfg.num_prompts = cfg.gain_prompts
        self.gcfg.validate()
        self.gains: dict | None = None
        self.reference_result = self.reference_records = None

    def policy(self, name: str, ratio: float):
        pol = make_policy(name, ratio, self.cfg.granularity, self.sink,
                          per_head=self.cfg.per_head, positions=self.cfg.positions)
        if self.sizing.edit_device is not None:
            pol.edit_device = self.sizing.edit_device
        return pol

    def gain(self) -> None:
        from kvedit.harness.experiment import engines

        if self.deadline.stopped or not self.deadline.allows(GAIN_GUESS_S, "the gain arms"):
            self.log("deadline: skipping the decode-gain arms")
            return
        t1 = time.perf_counter()
        gcfg, bs = self.gcfg, self.sizing.bs
        gkw = {**self.sizing.kw, "kv_tokens": gcfg.kv_blocks * bs,
               "max_model_len": gcfg.prompt_len + gcfg.max_tokens + bs}
        if "vllm_url" in gkw:
            raise ValueError("the decode-gain arms start their own KV-bound vLLM: "
                             "run with gain=False against an existing vLLM")
        with engines(**gkw) as eng, session(eng) as (ctx, completion):
            self.gains = _gains(ctx, completion, eng, self)
        self.timings["gain_s"] = time.perf_counter() - t1

    def reference(self) -> None:
        from kvedit.harness.eval.reference import run_reference

        acc = self.acc
        done = [s for g in self.sizing.groups[:acc.groups_done + acc.groups_cut] for s in g]
        if not done:
            self.log("kvpress: no group finished, nothing to compare")
            return
        deadline = None
        if self.cfg.deadline_s is not None:
            deadline = time.time() + self.cfg.deadline_s - (time.perf_counter() - self.t0)
        t1 = time.perf_counter()
        self.reference_result, self.reference_records = run_reference(
            self.cfg, self.model_dir, done, self.tok, self.sink, log=self.log,
            deadline=deadline)
        self.timings["reference_s"] = time.perf_counter() - t1

    def result(self, final: bool = True) -> dict:
        return results_file.build(self, time.perf_counter() - self.t0, final)

    def checkpoint(self) -> None:
        """results.json for what finished so far (`partial`: true)."""
        results_file.write_json(self.out / "results.json", self.result(final=False))

    def write(self) -> dict:
        result = self.result()
        results_file.write(self, result, self.out, self.log)
        return result


# With a deadline, the gain arms start only this far from it: they start their own vLLM.
GAIN_GUESS_S = 300.0


def _kept(policy, tokens: int) -> int:
    """Tokens `policy` keeps of `tokens` (from its units; no KV needed)."""
    units = policy.units(tokens, None)
    return tokens - policy.num_drop(units) * units.size


def _gains(ctx, completion, eng, run: EvalRun) -> dict:
    """{cell index: gain fields, "baseline": the baseline arms' reference}."""
    from tqdm.auto import tqdm

    from kvedit.harness.eval.gain import GainRun

    cfg, gcfg, cells = run.cfg, run.gcfg, run.acc.cells
    run.log(f"decode gain: {gcfg.num_prompts} prompts x {gcfg.prompt_len} tokens, "
            f"{gcfg.max_tokens} output tokens, KV capacity {gcfg.kv_blocks} blocks")
    policies = [run.policy(c.policy, c.ratio) for c in cells]
    # One arm per kept size (or per cell): the first cell of each group runs it.
    group = [i if cfg.gain_each else _kept(p, gcfg.prompt_len) for i, p in enumerate(policies)]
    first = {k: i for i, k in reversed(list(enumerate(group)))}
    capture = any(policies[i].needs_queries for i in first.values())
    g = GainRun(ctx, completion, eng.vllm_url, gcfg, run.sizing.bs, progress=False,
                capture=capture)
    try:
        g.prefill()
        g.arm()  # baseline, first
        arms = {}
        for k, i in tqdm(sorted(first.items(), key=lambda kv: kv[1]), desc="decode gain",
                         disable=not cfg.progress):
            arms[k] = (cells[i].label, g.arm(policies[i]))
        g.arm()  # baseline, last
        ref = g.reference()
        out: dict = {i: {**GainRun.gains(arms[k][1], ref), "gain_arm": arms[k][0]}
                     for i, k in enumerate(group)}
        out["baseline"] = ref
        return out
    finally:
        g.close()

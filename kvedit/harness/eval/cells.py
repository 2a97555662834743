"""The accuracy phase: engines up, then group by group the prefill, the baseline, the no-op
edit and every policy x ratio cell (in waves of `Sizing.at_once`), as far as the deadline
lets each start. It owns what the answers become as they come: each cell's tally, the
baseline's records, samples.jsonl, and the timings of each group and cell."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

from kvedit.harness.eval.policyspec import label, needs_queries, needs_reconstruction, \
    reconstruction_for
from kvedit.harness.eval.schedule import Deadline, mean
from kvedit.harness.eval.tally import Tally

READ_TIMEOUT_S = 3600.0  # the eval's completion client: seconds without a streamed byte


@contextmanager
def session(eng):
    """(SDK context, completion call) on the engines `eng`."""
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


def info_s(info: dict | None) -> float | None:
    return None if not info else info.get("seconds")


class Accuracy:
    """The accuracy phase's state (module docstring). `policy(name, ratio)` builds a cell's
    policy; `checkpoint()` is called after every cell and group (results.json)."""

    def __init__(self, cfg, sizing, tok, deadline: Deadline, policy, checkpoint, log, t0,
                 timings: dict):
        from kvedit.harness.eval.runner import Cell

        self.cfg, self.sizing, self.tok, self.deadline = cfg, sizing, tok, deadline
        self.policy, self.checkpoint, self.log, self.t0 = policy, checkpoint, log, t0
        self.cells = [Cell(p, r) for p in cfg.policies for r in cfg.ratios]
        self.tallies = {c.label: Tally(label(c.policy), c.ratio) for c in self.cells}
        # The no-op edit's cell and its control's (runner.NoOp, runner.Reload), by label.
        self.noop_tallies: dict[str, Tally] = {}
        self.base_records: list[dict] = []
        self.base_info: dict = {}
        self.base_info_last: dict | None = None
        self.groups_done = 0   # groups that ran every cell
        self.groups_cut = 0    # a group the deadline cut after its baseline (0 or 1)
        self.timings = timings   # the run's: this phase adds start_s, accuracy_s, groups
        self._samples_file = None

    def run(self, out) -> None:
        """Every group through the engines of `sizing.kw`; answers to out/samples.jsonl."""
        from kvedit.harness.experiment import engines

        cfg, groups = self.cfg, self.sizing.groups
        self.log(f"{len(self.sizing.samples)} samples ({', '.join(cfg.tasks)} at "
                 f"{cfg.lengths} tokens, seeds {cfg.seeds}) in {len(groups)} group(s), "
                 f"{len(self.cells)} policy x ratio cells"
                 f"{' + the no-op edit and its control' if cfg.noop else ''}, "
                 f"model {self.sizing.model_dir}"
                 + (f", deadline {self.deadline.seconds:.0f} s" if self.deadline.seconds
                    else ""))
        out.mkdir(parents=True, exist_ok=True)
        self._samples_file = open(out / "samples.jsonl", "w")
        try:
            with engines(**self.sizing.kw) as eng:
                self.timings["start_s"] = time.perf_counter() - self.t0
                with session(eng) as (ctx, completion):
                    odd = sorted({n for n in cfg.lengths if n % ctx.chunk_size})
                    if odd:
                        raise ValueError(f"lengths {odd} are not whole chunks of the server's "
                                         f"{ctx.chunk_size} tokens: part of a question would "
                                         "be editable")
                    for k, group in enumerate(groups):
                        if not self._guarded(eng, ctx, completion, k, group):
                            break
        finally:
            self._samples_file.close()
        self.timings["accuracy_s"] = time.perf_counter() - self.t0 - self.timings["start_s"]

    def rows(self, gains: dict | None) -> list[dict]:
        """Every cell with answers so far, as report.summarize reads them (+ gains)."""
        out = []
        for i, c in enumerate(self.cells):
            t = self.tallies[c.label]
            if t.groups:
                out.append({**t.row(), **((gains or {}).get(i) or {})})
        return out

    def _guarded(self, eng, ctx, completion, k: int, group: list) -> bool:
        """`_group`, and if it fails because vLLM stopped serving, an error that says so (with
        the first error of vLLM's log) rather than the streams' many HTTP failures."""
        from kvedit.launch.vllm import engine_down

        try:
            return self._group(ctx, completion, k, group)
        except Exception as e:
            down = engine_down(eng.vllm_url, eng.log_path)
            if down is None:
                raise
            raise RuntimeError(
                f"group {k + 1}/{len(self.sizing.groups)}: {down}. A worker the kernel's OOM "
                f"killer ended leaves no error of its own there (`dmesg` names it); a smaller "
                f"--group-size asks less of the machine. The answers so far are in "
                f"samples.jsonl and results.json.") from e

    def _group(self, ctx, completion, k: int, group: list) -> bool:
        """Run one group whole (as far as the deadline lets cells start); False: stop."""
        from kvedit.harness.eval.runner import AccuracyRun, Cell, NoOp, Reload

        cfg, log, n = self.cfg, self.log, len(self.sizing.groups)
        prev = self.timings.get("groups", [])
        expected = prev[-1]["seconds"] * len(group) / prev[-1]["samples"] if prev else None
        if not self.deadline.allows(expected, f"group {k + 1}/{n}"):
            log(f"deadline: {self.deadline.stopped}")
            return False
        t0 = time.perf_counter()
        zipped = needs_reconstruction(cfg.policies)
        rows = self.sizing.context_rows
        acc = AccuracyRun(ctx, completion, group, self.tok.decode, progress=False,
                          capture=needs_queries(cfg.policies),
                          reconstruction=reconstruction_for(self.tok) if zipped else None,
                          context_rows=rows or None, reuse=cfg.reuse,
                          in_flight=self.sizing.in_flight,
                          modify_concurrency=self.sizing.modify_concurrency)
        log(f"group {k + 1}/{n} ({len(group)} samples): prefill" +
            (", KVzip's reconstruction pass" if zipped else "") +
            (", the context pass" if rows else "") + ", baseline")
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

        last, times, at_once = (prev[-1]["cells_s"] if prev else []), [], self.sizing.at_once
        bar = tqdm(total=len(todo), desc=f"group {k + 1} (policy x ratio)",
                   disable=not self.cfg.progress)
        for w0 in range(0, len(todo), at_once):
            wave = todo[w0:w0 + at_once]
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

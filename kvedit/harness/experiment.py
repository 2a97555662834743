"""The token-dropping experiment shared by `kvedit demo` and `kvedit bench dropping`.

Same prompts, same vLLM, two arms: baseline (prefill → decode) and dropped
(prefill → modify(policy) → decode), optionally pipelined with `BatchedStream.run`. Each arm
uses its own cache salt, so neither reuses the other's KV (in vLLM's prefix cache or in the
kvedit server) and both really prefill. When we start vLLM ourselves its KV capacity is set
so decoding is KV-memory-bound: that is where dropping half the KV pays, because about twice
as many requests fit at once.
"""
from __future__ import annotations

import random
import re
import time
import urllib.request
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

FILL = 0.55  # engine KV capacity as a fraction of all requests' full length (the anchor's)
TOKEN_RANGE = (100, 8192)  # below every real vocab size, above the tiny model's specials


@dataclass
class Workload:
    """N prompts of P random token ids, O output tokens each, drop ratio r."""
    num_prompts: int = 8
    prompt_len: int = 2048
    max_tokens: int = 768
    ratio: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_prompts", "prompt_len", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"ratio must be in [0, 1), got {self.ratio}")

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(*TOKEN_RANGE) for _ in range(self.prompt_len)]
                for _ in range(self.num_prompts)]

    def capacity(self, fill: float = FILL) -> int:
        """KV tokens that make decode memory-bound: fill · N · (P + O)."""
        return int(fill * self.num_prompts * (self.prompt_len + self.max_tokens))

    def bound(self, capacity: int) -> float:
        """Most the decode can gain: how many more requests fit at once."""
        n, p, o = self.num_prompts, self.prompt_len, self.max_tokens
        return min(n, capacity / (p * (1 - self.ratio) + o)) / min(n, capacity / (p + o))


@dataclass
class Engines:
    """Where the kvedit server and vLLM are (started by us or given)."""
    url: str
    http_url: str | None
    vllm_url: str
    model: str              # served model name
    kv_tokens: int | None   # KV capacity we set, None for a vLLM we did not start
    log_path: Path | None = None  # vLLM's log when we started it (in-engine stats lines)
    pids: tuple[int, ...] = ()    # vLLM's process group, the kvedit server: their CPU time


def block_size() -> int:
    """vLLM's KV block size: 128 on the CPU build, 16 on GPUs."""
    from kvedit.launch.vllm import _is_cpu_build

    return 128 if _is_cpu_build() else 16


@contextmanager
def engines(*, server_url: str | None = None, server_http_url: str | None = None,
            vllm_url: str | None = None, model: str | None = None,
            served_model_name: str = "tiny-qwen3", dtype: str = "bfloat16",
            kv_tokens: int | None = None, max_model_len: int = 4096, chunk_size: int = 256,
            l1_size_gb: float = 1.0, vllm_args: tuple[str, ...] | list[str] = (), log=print,
            connector_config: dict | None = None):
    """Yield Engines, starting a kvedit server and/or vLLM when no URL is given; everything
    started here is stopped on exit, also on error or Ctrl-C. `vllm_args` go to the vLLM we
    start as they are (e.g. `--load-format dummy` for random weights at any size on a GPU);
    `connector_config`: more kv_connector_extra_config keys (e.g. {"in_engine": True})."""
    if vllm_url and not server_url:
        raise ValueError("an existing vLLM (--vllm-url) needs the kvedit server its connector "
                         "uses (--server-url and --server-http-url)")
    with ExitStack() as stack:
        if server_url:
            url, http_url = server_url, server_http_url
        else:
            from kvedit.launch.server import start_server

            log(f"starting kvedit server (L1 {l1_size_gb} GB, chunk {chunk_size}) ...")
            server = stack.enter_context(start_server(l1_size_gb, chunk_size=chunk_size))
            url, http_url = server.url, server.http_url
        if vllm_url:
            yield Engines(url, http_url, vllm_url.rstrip("/"), served_model_name, None)
            return
        from kvedit.launch.vllm import start_vllm
        from kvedit.harness.tiny_model import default_tiny_model

        model_dir = model or str(default_tiny_model())
        extra = []
        if kv_tokens:
            bs = block_size()
            blocks = -(-kv_tokens // bs)
            # +1: vLLM keeps one block aside (its null block), so `blocks` remain usable.
            extra = ["--block-size", str(bs), "--num-gpu-blocks-override", str(blocks + 1)]
            max_model_len = min(max_model_len, blocks * bs)  # vLLM refuses a longer one
        log(f"starting vLLM ({model_dir}, {dtype}, KV capacity "
            f"{kv_tokens or 'default'} tokens) ...")
        vp = stack.enter_context(start_vllm(
            model_dir, server=(url, http_url), served_model_name=served_model_name, dtype=dtype,
            max_model_len=max_model_len, chunk_size=chunk_size,
            extra_args=[*extra, *vllm_args], connector_config=connector_config))
        groups = (vp.pid,) + ((server.proc.pid,) if not server_url else ())
        yield Engines(url, http_url, vp.base_url, served_model_name, kv_tokens, vp.log_path,
                      groups)


# vLLM counters read around each phase. Engine steps make a CPU-contention-free measure:
# the bound is about how many requests one step decodes, so tokens per step is what it limits.
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "steps": "vllm:iteration_tokens_total_count",
    "step_tokens": "vllm:iteration_tokens_total_sum",
    "generated": "vllm:generation_tokens_total",
    "prompt_computed": 'vllm:prompt_tokens_by_source_total{source="local_compute"}',
}


def vllm_counters(vllm_url: str) -> dict[str, float] | None:
    """The COUNTERS from vLLM's /metrics, summed over engines (None if unreadable)."""
    try:
        with urllib.request.urlopen(f"{vllm_url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for key, name in COUNTERS.items():
        metric, _, label = name.partition("{")
        pattern = rf"^{re.escape(metric)}\{{([^}}]*)\}}\s+([0-9.eE+-]+)$"
        out[key] = sum(float(v) for labels, v in re.findall(pattern, text, re.M)
                       if not label or label.rstrip("}") in labels)
    return out


def cpu_seconds(groups: tuple[int, ...]) -> float:
    """User + system CPU seconds of every live process whose process group or id is in
    `groups`, plus this
    process's own: the work an arm costs, which unlike wall time does not grow when other
    programs share the cores (spinning threads aside)."""
    import os
    import resource

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups or int(entry.name) in groups:  # pgrp; utime, stime
            total += (int(fields[11]) + int(fields[12])) / tick
    me = resource.getrusage(resource.RUSAGE_SELF)
    return total + me.ru_utime + me.ru_stime


def _delta(before, after) -> dict[str, float] | None:
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}


def sampling(max_tokens: int) -> dict:
    # Greedy and ignore_eos: both arms decode exactly max_tokens tokens per prompt.
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def run_arm(ctx, completion, prompts, *, max_tokens: int, fn=None, pipelined: bool = False,
            progress: bool = True, label: str = "arm", vllm_url: str | None = None,
            windows: list[int] | None = None) -> dict:
    """One arm on fresh streams: prefill → [modify(fn)] → decode, or run() when pipelined.
    windows: per prompt, how many last prompt tokens' queries the prefill captures (for a fn
    that scores with captured queries, e.g. SnapKV; None: no capture).
    Returns the phases' metrics, total seconds, vLLM's counters over the arm ("engine") and
    over the decode phase (["decode"]["engine"]), and each prompt's generated token ids
    ("outputs", in prompt order: what quality checks score)."""
    import kvedit

    salt = f"{label}-{uuid.uuid4().hex[:8]}"  # fresh: no cache hit from another arm
    batch = kvedit.BatchedStream(progress=progress)
    for i, p in enumerate(prompts):
        batch.add(kvedit.create_request(ctx, completion, p, cache_salt=salt,
                                        capture_queries=windows[i] if windows else 0))
    snap = (lambda: vllm_counters(vllm_url)) if vllm_url else (lambda: None)
    out: dict = {"label": label, "pipelined": pipelined}
    start = snap()
    t0 = time.perf_counter()
    if pipelined:
        run = batch.run(sampling(1), fn, sampling(max_tokens))
        out.update({name: m.to_dict() for name, m in run.parts.items()})
        out["run"] = run.to_dict()
    else:
        out["prefill"] = batch.prefill(sampling(1)).to_dict()
        if fn is not None:
            out["modify"] = batch.modify(fn).to_dict()
        before = snap()
        out["decode"] = batch.decode(sampling(max_tokens)).to_dict()
        out["decode"]["engine"] = _delta(before, snap())
    out["total_s"] = time.perf_counter() - t0
    out["engine"] = _delta(start, snap())
    out["decode_prompt_tokens"] = sum(g.prompt_tokens for s in batch for g in s.generations[-1:])
    # Per prompt, in prompt order: all it generated (the prefill's token, then the decode's).
    out["outputs"] = [list(s.output_token_ids) for s in batch]
    return out


def warm_up(ctx, completion, prompt_len: int, progress: bool = False) -> None:
    """One short request through every phase, so the first arm pays no first-call costs."""
    from kvedit.edits import DropMiddle

    run_arm(ctx, completion, [list(range(TOKEN_RANGE[0], TOKEN_RANGE[0] + prompt_len))],
            max_tokens=4, fn=DropMiddle(0.5), progress=progress, label="warmup")


def config_dict(workload: Workload, **extra) -> dict:
    return {**asdict(workload), **extra}

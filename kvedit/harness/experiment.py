"""The token-dropping experiment shared by `kvedit demo` and `kvedit bench dropping`.

Same prompts, same vLLM, two arms: baseline (prefill → decode) and dropped
(prefill → modify(policy) → decode), optionally pipelined with `BatchedStream.run`. Each arm
uses its own cache salt, so neither reuses the other's KV (in vLLM's prefix cache or in the
kvedit server) and both really prefill. When we start vLLM ourselves its KV capacity is set
so decoding is KV-memory-bound: that is where dropping half the KV pays, because about twice
as many requests fit at once.
"""
from __future__ import annotations

import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvedit.harness.vocab import (TINY_SERVED, TOKEN_RANGE, Workload, counter_delta,
                                  fixed_length, vllm_counters)

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
    from kvedit.launch.vllm import is_cpu_build

    return 128 if is_cpu_build() else 16


@contextmanager
def engines(*, server_url: str | None = None, server_http_url: str | None = None,
            vllm_url: str | None = None, model: str | None = None,
            served_model_name: str = TINY_SERVED, dtype: str = "bfloat16",
            kv_tokens: int | None = None, max_model_len: int = 4096, chunk_size: int = 256,
            l1_size_gb: float = 1.0, vllm_args: tuple[str, ...] | list[str] = (), log=print,
            connector_config: dict | None = None, vllm_env: dict | None = None):
    """Yield Engines, starting a kvedit server and/or vLLM when no URL is given; everything
    started here is stopped on exit, also on error or Ctrl-C. `vllm_args` go to the vLLM we
    start as they are (e.g. `--load-format dummy` for random weights at any size on a GPU),
    `vllm_env` into its environment;
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
        extra, max_model_len = kv_pool_args(kv_tokens, max_model_len)
        log(f"starting vLLM ({model_dir}, {dtype}, KV capacity "
            f"{kv_tokens or 'default'} tokens) ...")
        vp = stack.enter_context(start_vllm(
            model_dir, server=(url, http_url), served_model_name=served_model_name, dtype=dtype,
            max_model_len=max_model_len, chunk_size=chunk_size,
            extra_args=[*extra, *vllm_args], connector_config=connector_config, env=vllm_env))
        groups = (vp.pid,) + ((server.proc.pid,) if not server_url else ())
        yield Engines(url, http_url, vp.base_url, served_model_name, kv_tokens, vp.log_path,
                      groups)


def kv_pool_args(kv_tokens: int | None, max_model_len: int) -> tuple[list[str], int]:
    """vLLM arguments that make its KV pool hold `kv_tokens` (whole blocks), and the
    max_model_len it then accepts."""
    if not kv_tokens:
        return [], max_model_len
    bs = block_size()
    blocks = -(-kv_tokens // bs)
    # +1: vLLM keeps one block aside (its null block), so `blocks` remain usable.
    extra = ["--block-size", str(bs), "--num-gpu-blocks-override", str(blocks + 1)]
    return extra, min(max_model_len, blocks * bs)  # vLLM refuses a longer one


@contextmanager
def plain_vllm(*, model: str | None = None, served_model_name: str = TINY_SERVED,
               dtype: str = "bfloat16", kv_tokens: int | None = None,
               max_model_len: int = 4096, vllm_args: tuple[str, ...] | list[str] = (),
               log=print):
    """Yield Engines for a vLLM started without the kvedit connector (and no kvedit server):
    the same build, model and KV pool as `engines` gives, for arms that measure plain vLLM."""
    from kvedit.harness.tiny_model import default_tiny_model
    from kvedit.launch.vllm import start_vllm

    model_dir = model or str(default_tiny_model())
    extra, max_model_len = kv_pool_args(kv_tokens, max_model_len)
    log(f"starting plain vLLM, no connector ({model_dir}, {dtype}, KV capacity "
        f"{kv_tokens or 'default'} tokens) ...")
    with start_vllm(model_dir, server=None, served_model_name=served_model_name, dtype=dtype,
                    max_model_len=max_model_len, extra_args=[*extra, *vllm_args]) as vp:
        yield Engines("", None, vp.base_url, served_model_name, kv_tokens, vp.log_path,
                      (vp.pid,))


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
        run = batch.run(fixed_length(1), fn, fixed_length(max_tokens))
        out.update({name: m.to_dict() for name, m in run.parts.items()})
        out["run"] = run.to_dict()
    else:
        out["prefill"] = batch.prefill(fixed_length(1)).to_dict()
        if fn is not None:
            out["modify"] = batch.modify(fn).to_dict()
        before = snap()
        out["decode"] = batch.decode(fixed_length(max_tokens)).to_dict()
        out["decode"]["engine"] = counter_delta(before, snap())
    out["total_s"] = time.perf_counter() - t0
    out["engine"] = counter_delta(start, snap())
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

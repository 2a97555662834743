"""In-engine budgets on CUDA vLLM (0.26, V1 runner: VLLM_USE_V2_MODEL_RUNNER=0): the compaction
runs on the GPU and the continuation is checked against the host path's after the same edit.

Skips without a GPU or without CUDA vLLM (CI has neither). The tiny Qwen3 in bf16
(FlashAttention needs a 16-bit dtype): the kept keys are re-rotated on the GPU here and on
the host by the host path, in float32 both, so tokens should agree; logprobs are compared
with a bf16 tolerance.
"""
from __future__ import annotations

import re
import uuid

import pytest

from kvedit.engine_budget import EngineBudget
from kvedit.edits import KeyNorm, StreamingLLM
from tests.gpu.test_gpu_e2e import _cuda_vllm_reason as _reason

CHUNK = 256
MODEL = "tiny-qwen3"


pytestmark = pytest.mark.skipif(_reason() is not None, reason=_reason() or "")


@pytest.fixture(scope="module")
def kv_server():
    """A server of this module's own: the session's has "tiny-qwen3" registered in float32 by
    the connector tests (a bf16 registration there is a layout_conflict)."""
    from kvedit.launch.server import start_server

    server = start_server(2.0, chunk_size=CHUNK, shm=True, eviction="LRU", lazy=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model, kv_server):
    from kvedit.launch.vllm import start_vllm

    with start_vllm(tiny_model, server=kv_server, served_model_name=MODEL, dtype="bfloat16",
                    kv_cache_gib=2, max_model_len=4096, chunk_size=CHUNK,
                    env={"VLLM_USE_V2_MODEL_RUNNER": "0"},
                    connector_config={"in_engine": True, "stats_interval_s": 0}) as vp:
        yield vp


@pytest.mark.parametrize("policy,name,args", [
    (StreamingLLM(0.5, sink=4, granularity="token"), "streaming_llm", {"sink": 4}),
    (KeyNorm(0.5, granularity="token"), "key_norm", {}),
])
def test_gpu_compaction_continues_as_the_host_path(engine, kv_server, policy, name, args):
    from tests.engine.test_in_engine import greedy, host_path, prompt_of

    prompt = prompt_of(2 * CHUNK, seed=len(name))
    host, host_lp = host_path(engine, kv_server, prompt, policy, 60)
    eng, eng_lp = greedy(engine, prompt, 61, EngineBudget(CHUNK + 64, 64, name, args,
                                                          protect=0))  # as the host policy
    same = next((i for i, (a, b) in enumerate(zip(eng, host)) if a != b), len(eng))
    print(f"{name}: {same} of 61 tokens equal; first logprobs "
          f"{[round(x - y, 4) for x, y in zip(eng_lp[1:6], host_lp[1:6])]}")
    assert same >= 20
    assert max(abs(x - y) for x, y in zip(eng_lp[1:same], host_lp[1:same])) < 0.1
    plain, _ = greedy(engine, prompt, 61)
    assert plain != eng


def test_gpu_budgets_release_blocks_and_leak_none(engine):
    import json
    import urllib.request

    from tests.engine.test_in_engine import greedy, prompt_of

    for per_head, positions in ((False, "compact"), (True, "logical"), (True, "compact")):
        out, _ = greedy(engine, prompt_of(300, seed=9), 400,
                        EngineBudget(256, 32, "key_norm", per_head=per_head,
                                     positions=positions), salt=uuid.uuid4().hex)
        assert len(out) == 400
    greedy(engine, [101, 102, 103], 1)
    lines = re.findall(r"kvedit: in-engine stats (\{.*\})", engine.log_path.read_text())
    stats = json.loads(lines[-1])
    # each: at the first decode (300 > 256), then every 32 of its 399 computed tokens
    assert stats["compactions"] >= 3 * 12
    assert stats["blocks_released"] > 0
    with urllib.request.urlopen(engine.base_url + "/metrics") as r:
        usage = [line for line in r.read().decode().splitlines()
                 if line.startswith("vllm:kv_cache_usage_perc{")]
    assert float(usage[0].rsplit(" ", 1)[1]) == 0.0

"""DropMiddle with RoPE re-rotation through the SDK on a real vLLM (tiny Qwen3, float32).

The strongest check of re-rotation is against the engine itself: layer-0 keys depend only
on the token and (through RoPE) its position, so after dropping, our re-rotated layer-0 keys
must equal the ones vLLM computes when it prefills the shortened prompt directly.
Tolerance: 1e-3 · max|K| (float32 engine; vLLM's cos/sin cache rounds angles of up to
~2,000 rad in float32).
"""
from __future__ import annotations

import re
import urllib.request
import uuid

import httpx
import pytest
import torch

from kvedit.edits import POLICIES, DropMiddle
from kvedit.keys import request_keys
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context_pass import capture_context
from kvedit.sdk.openai import openai_completion
from kvedit.sdk.queries import as_tensor
from kvedit.sdk.stream import create_request
from kvedit.vllm.capture.support import capture_unavailable
from tests.fixtures_vllm import GREEDY

C = 256


def external_hits(vp) -> float:
    with urllib.request.urlopen(vp.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$",
                           text, re.M).group(1))


def stored(ctx, keys) -> list[torch.Tensor]:
    assert ctx.client.lookup(ctx.model, keys, wait_timeout=30) == len(keys)
    with ctx.client.retrieve(ctx.model, keys) as got:
        return [t.clone() for t in got.tensors]


def test_drop_middle_rerotated_runs_through_vllm(ctx, vllm_server):
    post = openai_completion(vllm_server.base_url, vllm_server.model)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(10, 8000, (8 * C + 40,), generator=g).tolist()
    batch = BatchedStream([create_request(ctx, post, prompt, cache_salt=uuid.uuid4().hex)],
                          progress=False)
    batch.prefill(GREEDY)
    s = batch.streams[0]
    original = torch.cat(stored(ctx, s.keys[:8]), dim=2)  # [2, L, 8C, D] as vLLM computed it

    m = batch.modify(DropMiddle(0.5))  # re-rotates with the layout the connector registered
    assert (m.tokens_before, m.tokens_after) == (8 * C, 4 * C)
    assert s.tokens == prompt[:2 * C] + prompt[6 * C:8 * C]  # first and last chunks, in order
    edited = torch.cat(stored(ctx, s.keys), dim=2)
    kept = torch.cat([torch.arange(2 * C), torch.arange(6 * C, 8 * C)])
    assert torch.equal(edited[1], original[1][:, kept])  # values untouched
    assert torch.equal(edited[0, :, :2 * C], original[0, :, :2 * C])  # unmoved keys untouched

    # vLLM prefills the shortened prompt itself: its layer-0 keys are the reference.
    ref_salt = uuid.uuid4().hex
    BatchedStream([create_request(ctx, post, s.tokens, cache_salt=ref_salt)],
                  progress=False).prefill(GREEDY)
    ref = torch.cat(stored(ctx, request_keys(ctx.model, ctx.layout, s.tokens, ref_salt)), dim=2)
    scale = ref[0, 0].abs().max()
    assert (edited[0, 0] - ref[0, 0]).abs().max() / scale < 1e-3
    # Without re-rotation the moved keys would be far off.
    assert (original[0, 0][kept] - ref[0, 0]).abs().max() / scale > 0.1

    httpx.post(f"{vllm_server.base_url}/reset_prefix_cache", timeout=30).raise_for_status()
    hits = external_hits(vllm_server)
    batch.decode({**GREEDY, "max_tokens": 8})
    gen = s.generations[-1]
    assert gen.prompt_tokens == 4 * C + 40 + 1  # about half of the original 8C + 41
    assert external_hits(vllm_server) - hits >= 4 * C  # all edited chunks came from kvedit
    assert gen.cached_tokens >= 4 * C
    assert len(gen.token_ids) == 8


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_what_it_chooses_on_vllms_kv(ctx, vllm_server, name):
    """Each policy through the SDK on the KV vLLM computed: the stream keeps exactly the
    tokens the policy picks from that KV (so the score saw the registered layout and the real
    keys), and vLLM decodes the shortened prompt from kvedit's chunks."""
    post = openai_completion(vllm_server.base_url, vllm_server.model)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(10, 8000, (8 * C + 40,), generator=g).tolist()
    policy = POLICIES[name](0.5)
    window = 32 if policy.needs_queries else 0  # SnapKV/TOVA score with captured queries
    if window:   # capture supports vLLM 0.26 to 0.33: skip (and say why) on another
        version = httpx.get(f"{vllm_server.base_url}/version", timeout=10).json()["version"]
        why = capture_unavailable("auto", version)
        if why:
            pytest.skip(f"{name} scores with captured queries: {why}")
    # Expected Attention scores with the context's own queries: the prefill captures
    # nothing, the context pass captures the region's last rows (kvedit.sdk.context_pass)
    from_context = policy.queries_from == "context"
    batch = BatchedStream([create_request(ctx, post, prompt, cache_salt=uuid.uuid4().hex,
                                          capture_queries=0 if from_context else window)],
                          progress=False)
    batch.prefill(GREEDY)
    if from_context:
        capture_context(batch.streams, rows=window)
    s = batch.streams[0]
    original = torch.cat(stored(ctx, s.keys[:8]), dim=2)
    extra = {}
    if window:  # the same queries the SDK will hand the policy, read from the server
        raw = ctx.client.fetch_queries(ctx.model, s.queries.key)
        assert raw is not None, "vLLM stored no captured queries for the prefill"
        extra = {"queries": as_tensor(raw, s.queries, ctx.layout),
                 "query_start": s.queries.start}
    expect = policy.keep_indices(original, ctx.layout, **extra)
    assert len(expect) == 4 * C  # 8 chunks, half kept
    batch.modify(policy)
    assert s.tokens == [prompt[i] for i in expect.tolist()]
    httpx.post(f"{vllm_server.base_url}/reset_prefix_cache", timeout=30).raise_for_status()
    batch.decode({**GREEDY, "max_tokens": 4})
    gen = s.generations[-1]
    assert gen.prompt_tokens == 4 * C + 40 + 1 and gen.cached_tokens >= 4 * C

"""A head-adaptive edit through the real vLLM (SmolLM2, float32): the heads keep different
numbers of tokens, stored in the slots of the largest with null keys in front of the others'
(kvedit.edits.budgets), and vLLM decodes on it as if each head attended to its kept tokens
alone: what kvpress's masked attention computes.

Reference: transformers on the same model in float32 with the region's keys at their
original positions and, per (layer, KV head), every key the edit did not keep masked out of
the softmax (a per-head attention mask); the region's last tokens, which vLLM recomputes
from their ids, recomputed here over the same masked cache. The null keys come from the
context's own queries (`kvedit.sdk.context_pass`).
"""
from __future__ import annotations

import math
import uuid

import pytest
import torch

from kvedit.edits import KeyNorm
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.context_pass import capture_context
from kvedit.sdk.openai import openai_completion
from kvedit.sdk.stream import create_request
from tests.engine.test_per_head_vllm import distinct_tokens
from tests.fixtures_vllm import CHUNK, GREEDY, extra_connector_config

C = CHUNK
N_OUT = 6


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_model, kv_server):
    """SmolLM2 in float32 (the reference's precision). Real weights: the tiny model's random
    ones give no head a half-space of queries, so it would store no null key at all."""
    from kvedit.launch.vllm import start_vllm

    with start_vllm(smollm2_model, server=kv_server, served_model_name="smollm2-f32",
                    dtype="float32", kv_cache_gib=1, max_model_len=2048, chunk_size=CHUNK,
                    dev_mode=True, connector_config=extra_connector_config()) as vp:
        yield vp


@pytest.fixture(scope="module")
def ctx(smollm2_f32, kv_server):
    with connect(kv_server.url, kv_server.http_url, smollm2_f32.model, timeout=60) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def post(smollm2_f32):
    return openai_completion(smollm2_f32.base_url, smollm2_f32.model)


class Recording:
    """The policy as the edit fn, remembering each head's kept tokens (-1: a pad)."""

    def __init__(self, policy):
        self.policy, self.idx = policy, None
        self.needs_queries = policy.needs_queries

    def __call__(self, kv, tokens, layout=None, queries=None, query_start=None):
        self.idx = self.policy.keep_indices(kv, layout, queries=queries,
                                            query_start=query_start)
        return self.policy(kv, tokens, layout, queries, query_start)


def masked_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa with the module's per-KV-head mask of its first keys (`module.drop`, True =
    masked) and the causal rule."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    drop = getattr(module, "drop", None)
    if drop is not None:
        hq, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
        group = hq // drop.shape[0]
        hidden = torch.zeros(hq, q_len, k_len, dtype=torch.bool)
        hidden[..., :drop.shape[1]] = drop.repeat_interleave(group, 0)[:, None, :]
        rows = torch.arange(k_len - q_len, k_len)[:, None]
        hidden |= torch.arange(k_len)[None, :] > rows                    # causal
        attention_mask = torch.zeros(1, hq, q_len, k_len).masked_fill(hidden, -math.inf)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def reference(model_dir, prompt, region, kept, tail, n_out):
    """Greedy tokens and logprobs of transformers over the region's first region - tail keys
    masked per (layer, head) to `kept` [L, H, S] (-1 pads), then the region's last `tail`
    tokens and the rest of `prompt`, at their original positions."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    AttentionInterface.register("kvedit_masked", masked_attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="kvedit_masked").eval()
    first = region - tail
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prompt[:first]]), past_key_values=cache, use_cache=True)
    for layer, attn in enumerate(a.self_attn for a in model.model.layers):
        keep = torch.zeros(kept.shape[1], first, dtype=torch.bool)
        for h in range(kept.shape[1]):
            row = kept[layer, h]
            keep[h, row[(row >= 0) & (row < first)]] = True
        attn.drop = ~keep
    feed, tokens, lps, position = prompt[first:], [], [], first
    with torch.no_grad():
        for _ in range(n_out):
            p = torch.arange(position, position + len(feed))[None]
            logits = model(torch.tensor([feed]), past_key_values=cache, position_ids=p).logits
            logp = logits[0, -1].log_softmax(-1)
            t = int(logp.argmax())
            tokens.append(t)
            lps.append(float(logp[t]))
            position += len(feed)
            feed = [t]
    return tokens, lps


def test_a_head_adaptive_edit_decodes_as_each_heads_kept_tokens_alone(ctx, post,
                                                                      smollm2_model):
    prompt = distinct_tokens(2 * C + 40, 7)
    s = create_request(ctx, post, prompt, f"ad-{uuid.uuid4().hex[:8]}")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    capture_context(batch, rows=128)
    fn = Recording(KeyNorm(0.6, granularity="token", per_head=True, budget="layer"))
    batch.modify(fn)
    idx = fn.idx
    S = idx.shape[-1]
    L, H = idx.shape[:2]
    # the allocation's entries, or more where a head found no null key (its queries share
    # no half-space) and keeps real tokens in its pads
    assert int((idx >= 0).sum()) >= L * H * (2 * C - math.floor(0.6 * 2 * C))
    assert bool((idx < 0).any()), "some head should keep fewer tokens than the slots"
    tail = S % C
    assert len(s.tokens) == S - tail
    first = s.output_token_ids[0]
    batch.decode({**GREEDY, "max_tokens": N_OUT})
    want, want_lp = reference(smollm2_model, prompt + [first], 2 * C, idx, tail, N_OUT)
    assert s.output_token_ids[1:] == want
    torch.testing.assert_close(torch.tensor(s.logprobs[-N_OUT:]), torch.tensor(want_lp),
                               atol=2e-3, rtol=0)

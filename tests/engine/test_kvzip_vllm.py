"""KVzip's reconstruction pass through the real vLLM (tiny Qwen3, float32, kvedit connector
with query capture): the pass loads the context from the kvedit server and computes only the
repeated part, whose queries reach the edit fn; KVzip's scores from them equal transformers'
attention over the same prompt.

References: transformers' q_proj -> q_norm -> RoPE of the pass prompt (tests/hf_reference.py)
and its eager attention weights; vLLM's own prompt-cache report (`cached_tokens`) for what
was loaded rather than computed.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from kvedit.edits import KVzip
from kvedit.edits.attention import check_window
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.kvzip import ReconstructError, pass_prompt, reconstruct
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """Takes the queries; keeps the first chunk."""
    needs_queries = True

    def __init__(self):
        self.got = None

    def __call__(self, kv, tokens, queries=None, query_start=None, layout=None):
        self.got = (queries.clone(), query_start, kv.clone())
        return kv[:, :, :C].clone(), tokens[:C]


def prefilled(ctx, post, n: int, seed: int, name: str):
    s = create_request(ctx, post, tokens(n, seed), f"kvzip-{uuid.uuid4().hex[:8]}", name=name)
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    return s, batch


def test_the_pass_loads_the_context_and_captures_the_repeated_part(ctx, post, hf_queries):
    s, batch = prefilled(ctx, post, 2 * C + 20, 1, "zip")
    repeat = tokens(6, 2)
    full, window = pass_prompt(s, repeat, start=10)
    assert full == s.prompt[:2 * C] + repeat + s.prompt[10:2 * C] and window == 6 + 2 * C - 10
    m = reconstruct(batch, repeat, start=10)
    assert m.input_tokens == len(full)
    assert m.cached_tokens == 2 * C  # the region came from the kvedit server, not computed
    extra = ctx.keys_for(full, s.cache_salt)[2:]
    assert ctx.client.lookup(ctx.model, extra) == 0  # the pass's own chunks are gone
    fn = Recorder()
    batch.modify(fn)
    q, start, _ = fn.got
    assert start == 2 * C and q.shape[1] == window
    torch.testing.assert_close(q, hf_queries(full)[:, 2 * C:], atol=1e-4, rtol=1e-4)
    assert s.queries is None  # the edit used them up
    assert batch.decode({**GREEDY, "max_tokens": 2}).output_tokens == 2


def test_a_pass_whose_prompt_is_cached_still_computes_its_window(ctx, post, hf_queries):
    """The same pass prompt already sent once without capture: vLLM's prefix cache and the
    kvedit server hold every full chunk of it, yet the capturing pass loads only the
    context and computes the window (else its queries would not exist)."""
    s, batch = prefilled(ctx, post, 2 * C, 3, "cached-pass")
    repeat = tokens(7, 4)
    full, window = pass_prompt(s, repeat)
    plain = create_request(ctx, post, full, s.cache_salt)
    BatchedStream([plain], progress=False).prefill(GREEDY)
    assert ctx.client.lookup(ctx.model, ctx.keys_for(full, s.cache_salt),
                             wait_timeout=30) == len(full) // C
    for _ in range(2):  # twice: the second finds even more of it cached
        m = reconstruct(batch, repeat)
        assert m.cached_tokens == 2 * C
    fn = Recorder()
    batch.modify(fn)
    torch.testing.assert_close(fn.got[0], hf_queries(full)[:, 2 * C:], atol=1e-4, rtol=1e-4)


def test_kvzip_scores_from_vllms_queries_equal_transformers_attention(ctx, post, tiny_model):
    from transformers import AutoModelForCausalLM

    s, batch = prefilled(ctx, post, C + 3, 5, "scores")
    repeat = tokens(5, 6)
    full, _ = pass_prompt(s, repeat)
    reconstruct(batch, repeat)
    fn = Recorder()
    batch.modify(fn)
    q, start, kv = fn.got
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        att = model(torch.tensor([full]), output_attentions=True).attentions
    rows = torch.stack([a[0] for a in att])[:, :, C:, :C]         # [L, Hq, W, C]
    rows = rows / rows.sum(-1, keepdim=True)
    n, hq = rows.shape[:2]
    g = hq // ctx.layout.num_kv_heads
    ref = rows.view(n, hq // g, g, -1, C).amax(dim=(2, 3))
    w = check_window("KVzip", kv, q, start, ctx.layout.head_dim)
    got = KVzip(0.5, granularity="token", per_head=True, sink=0).token_scores(kv, ctx.layout, w)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-5)


def test_a_region_past_the_capture_bound_is_refused_naming_the_stream(ctx, post):
    """Refused before anything is sent (the stream's chunks need not even exist yet)."""
    s = create_request(ctx, post, tokens(16 * C + 10, 7), f"kvzip-{uuid.uuid4().hex[:8]}",
                       name="too-long")
    with pytest.raises(ReconstructError, match=r"too-long.*4102 query rows.*bound 4096"):
        reconstruct(BatchedStream([s], progress=False), tokens(6, 8))
    assert s.queries is None and s.tokens == s.prompt_token_ids
    # skipping a prefix of the region brings the window under the bound
    assert pass_prompt(s, tokens(6, 8), start=16)[1] == 6 + 16 * C - 16 <= 4096

"""A policy fed the queries vLLM captured scores tokens as the same policy computed from
transformers' attention weights for the window (the issue's test), end to end: the session's
tiny Qwen3 vLLM (float32, kvedit connector with query capture) prefills, the SDK hands the
edit the stored KV and the captured queries, and SnapKV's / TOVA's scores are compared with
the aggregation of transformers' eager `output_attentions` over the same rows and columns.

Tolerance: vLLM and transformers compute the same float32 math with other kernels and
summation orders (keys and queries agree to ~1e-5); the scores are sums of L*Hq*W
softmax weights, compared to rtol 1e-3 (atol 1e-4 per unit of mass).
"""
from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F

from kvedit.edits import TOVA, SnapKV
from kvedit.edits.attention import check_window
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.openai import openai_completion
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256  # the kv_server fixture's chunk size


@pytest.fixture(scope="module")
def hf_attention(tiny_model):
    """attention(tokens) -> [L, Hq, P, P] eager float32 weights of transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()

    def attention(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_attentions=True)
        return torch.stack([a[0] for a in out.attentions])

    return attention


class Scorer:
    """An edit fn that records the policy's token scores from what the SDK hands it, then
    applies the policy (so the stream really is edited and decodes after)."""
    needs_queries = True

    def __init__(self, policy):
        self.policy, self.got = policy, {}

    def __call__(self, kv, tokens, layout=None, queries=None, query_start=None):
        w = check_window("test", kv, queries, query_start, layout.head_dim)
        self.got[len(tokens)] = (self.policy.token_scores(kv, layout, w), query_start,
                                 queries.shape[1])
        return self.policy(kv, tokens, layout=layout, queries=queries, query_start=query_start)


def reference(attn: torch.Tensor, T: int, start: int, rows: int, kernel: int,
              first_layer: int) -> torch.Tensor:
    """The policy's scores from transformers' weights: rows start.., columns of the T edited
    tokens renormalised, summed over rows, heads and layers first_layer.., pooled, window
    kept."""
    w = attn[first_layer:, :, start:start + rows, :T]
    s = (w / w.sum(-1, keepdim=True)).sum(dim=(0, 1, 2))
    if kernel > 1:
        s = F.avg_pool1d(s[None, None], kernel, stride=1, padding=kernel // 2,
                         count_include_pad=False)[0, 0]
    s[start:T] = float("inf")
    return s


@pytest.mark.parametrize("policy,window", [(SnapKV(0.5, granularity="token", span=1), 40),
                                           (SnapKV(0.5, granularity="token", span=1,
                                                   from_layer=0), 120),
                                           (TOVA(0.5, granularity="token", span=1), 16)],
                         ids=["snapkv-window-after-kv", "snapkv-window-straddles", "tova"])
def test_captured_queries_score_like_transformers_attention(ctx, vllm_server, hf_attention,
                                                            policy, window):
    g = torch.Generator().manual_seed(window)
    prompt = torch.randint(10, 8000, (2 * C + 60,), generator=g).tolist()
    post = openai_completion(vllm_server.base_url, vllm_server.model)
    s = create_request(ctx, post, prompt, f"polq-{uuid.uuid4().hex[:8]}",
                       capture_queries=window)
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    fn = Scorer(policy)
    batch.modify(fn)
    T = 2 * C
    scores, start, rows = fn.got[T]
    P = len(prompt)
    assert (start, rows) == (P - window, window)
    attn = hf_attention(prompt)
    first = policy.layers(attn.shape[0]).start
    if isinstance(policy, TOVA):
        ref = reference(attn, T, P - 1, 1, 1, first)
    else:
        ref = reference(attn, T, start, rows, policy.kernel, first)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(scores))  # the same window tokens kept
    mass = float((attn.shape[0] - first) * attn.shape[1]
                 * (1 if isinstance(policy, TOVA) else rows))
    torch.testing.assert_close(scores[finite], ref[finite], rtol=1e-3, atol=1e-4 * mass / T)
    # The edit really happened on the stream; decode runs on the smaller cache.
    assert len(s.tokens) + len(s.suffix) < P
    assert batch.decode({**GREEDY, "max_tokens": 2}).output_tokens == 2

"""Expected Attention's scores against a loop over keys that follows the definition.

References (synthetic tensors): pre-RoPE queries drawn around a mean, rotated to their
positions by an explicit cos/sin loop (what vLLM captures); each query then rotated to the
first position after the context, and per key the expected logit written as the mean logit
plus half the variance of the logits over those queries (E[exp(x)] of a Gaussian x), softmax
over the keys after the sink, averaged over the query heads of the KV head's group, times
the value's norm. kvpress's formula in matrix form is what the policy computes.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvedit.edits import ExpectedAttention
from kvedit.edits.attention import check_window
from kvedit.edits.rope import inv_freq, mean_rotation, rotate_keys
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD = 2, 2, 3, 8
ROPE = RopeParams(theta=10000.0)
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=4, rope=ROPE)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rotate(x: torch.Tensor, pos: int) -> torch.Tensor:
    """One head vector [HD] (float64) rotated to `pos`, rotate-half style, by hand."""
    f = inv_freq(ROPE, HD).double()
    c, s = torch.cos(pos * f), torch.sin(pos * f)
    a, b = x[: HD // 2], x[HD // 2:]
    return torch.cat([a * c - b * s, b * c + a * s])


def captured(pre: torch.Tensor, start: int) -> torch.Tensor:
    """[L, W, Hq*HD] post-RoPE rows from pre-RoPE [L, W, Hq, HD]; row w at start + w."""
    out = torch.empty_like(pre, dtype=torch.float64)
    for l in range(pre.shape[0]):
        for w in range(pre.shape[1]):
            for h in range(pre.shape[2]):
                out[l, w, h] = rotate(pre[l, w, h].double(), start + w)
    return out.reshape(pre.shape[0], pre.shape[1], -1).float()


def loop_scores(kv, pre, T, sink, covariance=True, vnorm=True):
    """[L, HKV, T] float64 per the module docstring; sinks +inf."""
    out = torch.full((L, HKV, T), math.inf, dtype=torch.float64)
    for l in range(L):
        for kvh in range(HKV):
            acc = torch.zeros(T - sink, dtype=torch.float64)
            for g in range(GROUP):
                h = kvh * GROUP + g
                qs = torch.stack([rotate(q.double(), T) for q in pre[l, :, h]])   # at T
                keys = kv[0, l, sink:].double().view(T - sink, HKV, HD)[:, kvh]
                logits = keys @ qs.T / math.sqrt(HD)                               # [t, n]
                e = logits.mean(1) + (logits.var(1, unbiased=False) / 2 if covariance else 0)
                acc += e.softmax(0)
            acc /= GROUP
            if vnorm:
                acc *= kv[1, l, sink:].double().view(T - sink, HKV, HD)[:, kvh].norm(dim=-1)
            out[l, kvh, sink:] = acc
    return out


@pytest.mark.parametrize("covariance,vnorm", [(True, True), (False, True), (True, False)])
def test_scores_are_the_expected_attention_of_the_context_queries(covariance, vnorm):
    T, W, sink = 20, 9, 2
    kv = rand(2, L, T, HKV * HD, seed=1)
    pre = rand(L, W, HKV * GROUP, HD, seed=2) + rand(L, 1, HKV * GROUP, HD, seed=3) * 2
    start = T - W  # the context's last W rows
    w = check_window("ExpectedAttention", kv, captured(pre, start), start, HD)
    pol = ExpectedAttention(0.5, granularity="token", per_head=True, sink=sink, n_future=1,
                            covariance=covariance, vnorm=vnorm)
    got = pol.head_scores(kv, LAYOUT, w)
    torch.testing.assert_close(got, loop_scores(kv, pre, T, sink, covariance, vnorm).float(),
                               rtol=1e-4, atol=1e-6)


def test_rows_after_the_context_are_never_used_and_none_inside_is_refused():
    T, W = 16, 6
    kv = rand(2, L, T, HKV * HD, seed=4)
    pre = rand(L, W + 4, HKV * GROUP, HD, seed=5)
    pol = ExpectedAttention(0.5, granularity="token", sink=1)
    ctx = check_window("EA", kv, captured(pre[:, :W], T - W), T - W, HD)
    more = check_window("EA", kv, captured(pre, T - W), T - W, HD)  # + 4 question rows
    units = pol.units(T, LAYOUT)
    torch.testing.assert_close(pol.score_window(kv, units, LAYOUT, more),
                               pol.score_window(kv, units, LAYOUT, ctx))
    question = check_window("EA", kv, captured(pre[:, :4], T), T, HD)  # the question alone
    with pytest.raises(ValueError, match="queries of the context itself"):
        pol.keep_indices(kv, LAYOUT, queries=question.queries, query_start=T)


def test_one_decision_per_token_weights_every_layer_and_head_alike():
    T, W, sink = 24, 8, 3
    kv = rand(2, L, T, HKV * HD, seed=6)
    kv[1, 0] *= 100.0  # layer 0's values are large: by magnitude it would decide alone
    pre = rand(L, W, HKV * GROUP, HD, seed=7)
    w = check_window("EA", kv, captured(pre, T - W), T - W, HD)
    per = ExpectedAttention(0.5, granularity="token", per_head=True, sink=sink).head_scores(
        kv, LAYOUT, w)
    flat = ExpectedAttention(0.5, granularity="token", sink=sink)
    got = flat.score_window(kv, flat.units(T, LAYOUT), LAYOUT, w)
    part = per[..., sink:] / per[..., sink:].sum(-1, keepdim=True)
    torch.testing.assert_close(got[sink:], part.mean(dim=(0, 1)))
    assert torch.isinf(got[:sink]).all()
    kept = flat.keep_indices(kv, LAYOUT, queries=w.queries, query_start=w.start)
    assert len(kept) == T - T // 2 and set(range(sink)) <= set(kept.tolist())


def test_mean_rotation_of_one_position_is_that_rotation():
    x = rand(3, HD, seed=8)
    for pos in (0, 5, 1234):
        R = mean_rotation(ROPE, HD, pos, 1)
        want = rotate_keys(x.clone().view(1, 3, HD).transpose(0, 1).reshape(3, 1, HD),
                           torch.tensor([pos]), ROPE, HD).view(3, HD)
        torch.testing.assert_close(x @ R.T, want, rtol=1e-5, atol=1e-5)
    many = mean_rotation(ROPE, HD, 10, 4)
    torch.testing.assert_close(many, sum(mean_rotation(ROPE, HD, p, 1) for p in range(10, 14)) / 4)

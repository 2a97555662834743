"""Per-(layer, KV head) selection in the policies (`per_head=True`), exact-count `select`, and
per-head RoPE shifts, on synthetic tensors.

References: each head's own ranking computed here by a loop (argsort of that head's key
norms, cosines, attention), and `rotate_keys` with one shift per call for each head.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvedit.edits import (POLICIES, KeyDiff, KeyNorm, SnapKV, StreamingLLM, TOVA,
                          rotate_keys)
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD, C = 3, 2, 2, 8, 4
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=C, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def loop_top(scores_lht: torch.Tensor, keep: int) -> torch.Tensor:
    """Per row: the `keep` best tokens (ties to the earlier), sorted; by a Python loop."""
    out = torch.empty(*scores_lht.shape[:2], keep, dtype=torch.long)
    for layer in range(scores_lht.shape[0]):
        for h in range(scores_lht.shape[1]):
            row = scores_lht[layer, h].tolist()
            order = sorted(range(len(row)), key=lambda t: (-row[t], t))
            out[layer, h] = torch.tensor(sorted(order[:keep]))
    return out


def test_key_norm_per_head_keeps_each_heads_own_low_norm_keys():
    T = 12
    kv = rand(2, L, T, HKV * HD, seed=1)
    idx = KeyNorm(0.5, granularity="token", per_head=True).keep_indices(kv, LAYOUT)
    assert idx.shape == (L, HKV, 6) and idx.dtype == torch.long
    norms = kv[0].view(L, T, HKV, HD).norm(dim=-1).permute(0, 2, 1)  # [L, H, T]
    assert torch.equal(idx, loop_top(-norms, 6))
    assert not all(torch.equal(idx[0, 0], idx[la, h]) for la in range(L) for h in range(HKV)), \
        "random keys should make at least two heads keep different tokens"
    # the folded (one decision per token) selection is the mean over heads, as before
    flat = KeyNorm(0.5, granularity="token").keep_indices(kv, LAYOUT)
    assert torch.equal(flat, loop_top(-norms.mean(dim=(0, 1))[None, None], 6)[0, 0])


def test_key_diff_per_head_matches_each_heads_cosines():
    T = 10
    kv = rand(2, L, T, HKV * HD, seed=2)
    idx = KeyDiff(0.3, granularity="token", per_head=True).keep_indices(kv, LAYOUT)
    k = torch.nn.functional.normalize(kv[0].view(L, T, HKV, HD), dim=-1)
    anchor = torch.nn.functional.normalize(k.mean(dim=1, keepdim=True), dim=-1)
    cos = (k * anchor).sum(-1).permute(0, 2, 1)
    assert torch.equal(idx, loop_top(-cos, T - 3))


def test_protected_tokens_are_in_every_head_and_rows_are_sorted():
    T = 16
    kv = rand(2, L, T, HKV * HD, seed=3)
    idx = KeyNorm(0.75, granularity="token", per_head=True, protect_last=3).keep_indices(
        kv, LAYOUT)
    assert idx.shape == (L, HKV, 4)
    for row in idx.reshape(-1, 4):
        assert row.tolist() == sorted(row.tolist())
        assert {13, 14, 15} <= set(row.tolist())
    # a positional policy keeps the same tokens in every head
    sl = StreamingLLM(0.5, sink=2, granularity="token", per_head=True).keep_indices(kv, LAYOUT)
    assert (sl == sl[0, 0]).all() and sl[0, 0].tolist() == [0, 1, 10, 11, 12, 13, 14, 15]


def test_chunk_units_per_head_keep_an_equal_count():
    T = 4 * C + 2  # 5 units, the last one short
    kv = rand(2, L, T, HKV * HD, seed=4)
    idx = KeyNorm(0.4, per_head=True).keep_indices(kv, LAYOUT)  # drop 2 units of C
    assert idx.shape == (L, HKV, T - 2 * C)
    for row in idx.reshape(-1, idx.shape[-1]).tolist():
        whole = [u for u in range(5) if all(t in row for t in range(u * C, min(T, u * C + C)))]
        assert len(whole) >= 2  # whole units kept; only the lowest-ranked may be cut short


def test_select_keeps_an_exact_count_and_agrees_with_keep_indices():
    T = 20
    kv = rand(2, L, T, HKV * HD, seed=5)
    pol = KeyNorm(0.5, granularity="token")
    assert torch.equal(pol.select(kv, 10, LAYOUT), pol.keep_indices(kv, LAYOUT))
    ph = KeyNorm(0.5, granularity="token", per_head=True)
    assert torch.equal(ph.select(kv, 10, LAYOUT), ph.keep_indices(kv, LAYOUT))
    assert ph.select(kv, 7, LAYOUT).shape == (L, HKV, 7)
    assert torch.equal(ph.select(kv, T, LAYOUT)[1, 1], torch.arange(T))
    # chunk units: the kept tokens are whole units but for the lowest-ranked one
    chunked = KeyNorm(per_head=True).select(kv, 9, LAYOUT)
    assert chunked.shape == (L, HKV, 9)
    with pytest.raises(ValueError, match=r"keep must be in \[1, 20\]"):
        pol.select(kv, 0, LAYOUT)


def naive_head_attention(kv, queries, start):
    """[L, HKV, T]: per layer and KV head, softmax attention summed over rows and its group."""
    T = kv.shape[2]
    out = torch.zeros(kv.shape[1], HKV, T, dtype=torch.float64)
    for layer in range(kv.shape[1]):
        k = kv[0, layer].double().view(T, HKV, HD)
        q = queries[layer].double().view(queries.shape[1], HKV * GROUP, HD)
        for h in range(HKV * GROUP):
            for r in range(q.shape[0]):
                seen = min(T, start + r + 1)
                out[layer, h // GROUP, :seen] += (k[:seen, h // GROUP] @ q[r, h]
                                                  / math.sqrt(HD)).softmax(0)
    return out.float()


def test_snapkv_per_head_ranks_by_each_heads_attention():
    T, W = 14, 4
    kv, q = rand(2, L, T, HKV * HD, seed=6), rand(L, W, HKV * GROUP * HD, seed=7) * 2
    pol = SnapKV(0.5, granularity="token", per_head=True, kernel=1, span=1, keep_window=False)
    idx = pol.keep_indices(kv, LAYOUT, queries=q, query_start=T)
    assert torch.equal(idx, loop_top(naive_head_attention(kv, q, T), 7))
    # the window's own tokens (rows inside the T) are kept in every head
    inside = SnapKV(0.5, granularity="token", per_head=True, span=1).keep_indices(
        kv, LAYOUT, queries=q, query_start=T - 2)
    for row in inside.reshape(-1, 7).tolist():
        assert {12, 13} <= set(row)
    assert TOVA(0.5, granularity="token", per_head=True).keep_indices(
        kv, LAYOUT, queries=q, query_start=T).shape == (L, HKV, 7)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_selects_per_head_with_equal_counts(name):
    T = 6 * C
    kv = rand(2, L, T, HKV * HD, seed=8)
    pol = POLICIES[name](0.5, granularity="token", per_head=True)
    # the context's own rows for a policy that scores with them, else the question's after it
    start = T - 3 if pol.queries_from == "context" else T
    kw = {"queries": rand(L, 3, HKV * GROUP * HD, seed=9), "query_start": start} \
        if pol.needs_queries else {}
    idx = pol.keep_indices(kv, LAYOUT, **kw)
    assert idx.shape == (L, HKV, T // 2)
    assert (idx.diff(dim=-1) > 0).all()  # sorted, no duplicates




def test_per_head_rotation_equals_one_rotation_per_head():
    T = 9
    keys = rand(L, T, HKV * HD, seed=10)
    delta = torch.randint(-50, 50, (L, T, HKV), generator=torch.Generator().manual_seed(1))
    got = rotate_keys(keys.clone(), delta, LAYOUT.rope, HD)
    want = keys.clone().view(L, T, HKV, HD)
    for layer in range(L):
        for h in range(HKV):
            part = want[layer, :, h].clone()
            rotate_keys(part, delta[layer, :, h], LAYOUT.rope, HD)
            want[layer, :, h] = part
    torch.testing.assert_close(got, want.view(L, T, HKV * HD), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="per-head delta must have shape"):
        rotate_keys(keys.clone(), delta[:, :, :1], LAYOUT.rope, HD)

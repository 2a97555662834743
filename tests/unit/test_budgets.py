"""Head-adaptive budgets: the counts (AdaKV inside a layer's total, one global ranking, the
safeguard), the ragged selection, the null keys, and the edit stored in uniform slots.

References: sorting by hand (Python lists) for the counts and the selection; for the edit,
attention of later queries over the padded, shifted KV against attention over each head's
kept tokens alone at their original positions (what kvpress's masked attention computes).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvedit.edits import KeyDiff, SnapKV
from kvedit.edits.budgets import (NULL_MARGIN, head_counts, null_keys, ragged_indices,
                                  selection)
from kvedit.edits.rope import rotate_keys
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD, C = 3, 2, 2, 8, 4
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=C, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def by_hand(scores, keep, budget, alpha):
    L_, H_, T = scores.shape
    safe = int(alpha * keep)
    entries = []
    for l in range(L_):
        for h in range(H_):
            best = sorted(range(T), key=lambda t: -scores[l, h, t].item())[:safe]
            for t in range(T):
                entries.append((math.inf if t in best else scores[l, h, t].item(), l, h, t))
    counts = torch.zeros(L_, H_, dtype=torch.long)
    groups = [[e for e in entries if e[1] == l] for l in range(L_)] if budget == "layer" \
        else [entries]
    per = H_ * keep if budget == "layer" else L_ * H_ * keep
    for g in groups:
        for _, l, h, _ in sorted(g, key=lambda e: -e[0])[:per]:
            counts[l, h] += 1
    return counts


@pytest.mark.parametrize("budget,alpha", [("layer", 0.2), ("global", 0.0), ("global", 0.5)])
def test_counts_share_the_total_and_keep_the_safeguard(budget, alpha):
    T, keep = 20, 6
    scores = rand(L, HKV, T, seed=1) * torch.tensor([1.0, 4.0])[None, :, None]
    got = head_counts(scores, keep, budget, alpha)
    assert torch.equal(got, by_hand(scores, keep, budget, alpha))
    if budget == "layer":
        assert (got.sum(1) == HKV * keep).all()
    assert got.sum() == L * HKV * keep and (got >= int(alpha * keep)).all()
    assert len(set(got.flatten().tolist())) > 1  # the budgets really differ
    assert (head_counts(scores, keep, "uniform", alpha) == keep).all()


def test_ragged_rows_are_each_heads_best_sorted_after_their_pads():
    T = 12
    scores = rand(L, HKV, T, seed=2)
    counts = torch.tensor([[3, 7], [5, 5], [1, 6]])
    idx = ragged_indices(scores, counts)
    assert idx.shape == (L, HKV, 7)
    for l in range(L):
        for h in range(HKV):
            n = int(counts[l, h])
            best = sorted(sorted(range(T), key=lambda t: -scores[l, h, t].item())[:n])
            assert idx[l, h].tolist() == [-1] * (7 - n) + best


def queries_with_a_direction(n, seed):
    """Queries whose group shares a direction (as a model's do: measured on Qwen2.5-1.5B,
    docs/eval.md), each head with its own offset, plus noise."""
    shared = rand(L, 1, HKV, 1, HD, seed=3) * 4
    own = rand(L, 1, HKV, GROUP, HD, seed=14)
    noise = rand(L, n, HKV, GROUP, HD, seed=seed)
    return (shared + own + noise).reshape(L, n, HKV * GROUP * HD)


def test_null_keys_silence_the_sample_and_others_like_it():
    W, n = 40, 400
    sample, later = queries_with_a_direction(W, 4), queries_with_a_direction(n, 5)
    keys, found = null_keys(sample, HKV, HD)
    assert found.all()
    for q, bound in ((sample, -NULL_MARGIN * 0.999), (later, -10.0)):
        x = q.view(L, -1, HKV, GROUP, HD)
        logits = torch.einsum("lwhgd,lhd->lwhg", x, keys) / math.sqrt(HD)
        assert logits.max() <= bound
    both = torch.cat([sample, -sample], dim=1)  # no half-space holds q and -q
    _, found = null_keys(both, HKV, HD, iters=50)
    assert not found.any()


def attend(q, k, v):
    return ((q @ k.T) / math.sqrt(HD)).softmax(-1) @ v


@pytest.mark.parametrize("budget", ["layer", "global"])
def test_padded_edit_attends_like_each_heads_kept_tokens(budget):
    T, W = 24, 16
    kv = rand(2, L, T, HKV * HD, seed=6)
    sample = queries_with_a_direction(W, 8)
    pol = KeyDiff(0.75, granularity="token", per_head=True, budget=budget)
    out, ids = pol(kv, list(range(100, 100 + T)), LAYOUT, queries=sample, query_start=T)
    idx = pol.keep_indices(kv, LAYOUT, queries=sample, query_start=T)
    S = idx.shape[-1]
    assert out.shape == (2, L, S, HKV * HD) and ids.shape == (L, HKV, S)
    assert (idx >= 0).sum() == L * HKV * (T - math.floor(0.75 * T))   # the entries chosen
    assert S > T - math.floor(0.75 * T)                                 # ... in more slots
    later = queries_with_a_direction(5, 9)  # queries at positions T..T+4
    shifted = later.clone()  # the same queries where vLLM puts them after the edit
    rotate_keys(shifted, torch.full((5,), S - T), LAYOUT.rope, HD)
    for l in range(L):
        for h in range(HKV):
            kept = idx[l, h][idx[l, h] >= 0]
            k0 = kv[0, l].view(T, HKV, HD)[kept, h]
            v0 = kv[1, l].view(T, HKV, HD)[kept, h]
            k1, v1 = out[0, l].view(S, HKV, HD)[:, h], out[1, l].view(S, HKV, HD)[:, h]
            for g in range(GROUP):
                qh = slice((h * GROUP + g) * HD, (h * GROUP + g + 1) * HD)
                torch.testing.assert_close(attend(shifted[l, :, qh], k1, v1),
                                           attend(later[l, :, qh], k0, v0),
                                           rtol=1e-4, atol=1e-5)
            assert ids[l, h, -len(kept):].tolist() == [100 + t for t in kept.tolist()]


def test_the_recomputed_tail_is_the_same_tokens_in_every_head():
    tails = []
    for T in range(30, 40):
        kv = rand(2, L, T, HKV * HD, seed=T)
        sample = queries_with_a_direction(8, 12)
        idx = KeyDiff(0.5, granularity="token", per_head=True, budget="layer").keep_indices(
            kv, LAYOUT, queries=sample, query_start=T)
        tail = idx.shape[-1] % C
        tails.append(tail)
        assert (idx[..., idx.shape[-1] - tail:] == torch.arange(T - tail, T)).all()
    assert any(tails)


def test_the_tail_is_kept_beside_the_sinks_in_a_head_that_keeps_few():
    """A head whose count was only the tail's, its sinks protected too, kept the sinks (ties
    go to the earlier token) and lost part of the tail, which vLLM recomputes from one token
    id for every head: the edit was refused (SnapKV per head, budget="layer", 0.75, a 2k
    multivalue prompt on Qwen2.5-1.5B). Now such a head keeps both."""
    T, keep = 40, 10
    scores = torch.stack([rand(L, T, seed=1) + 10, rand(L, T, seed=2) - 10], dim=1)
    scores[..., :2] = math.inf    # sinks, in every head
    idx, _ = selection(scores, keep, "layer", 0.2, queries_with_a_direction(8, 12), LAYOUT)
    S = idx.shape[-1]
    tail = S % C
    assert S == 18 and tail == 2   # the quiet head: 2 sinks + the tail of 2, the rest pads
    assert (idx[..., S - tail:] == torch.arange(T - tail, T)).all()
    for row in idx.reshape(-1, S).tolist():
        assert {0, 1} <= set(row)


def test_what_an_unequal_budget_refuses():
    with pytest.raises(ValueError, match="per_head=True"):
        KeyDiff(0.5, budget="layer")
    with pytest.raises(ValueError, match="logical"):
        KeyDiff(0.5, per_head=True, budget="layer", positions="compact")
    with pytest.raises(ValueError, match="budget must be one of"):
        KeyDiff(0.5, per_head=True, budget="heads")
    pol = KeyDiff(0.5, granularity="token", per_head=True, budget="layer")
    assert pol.needs_queries and pol.queries_from == "context"  # for its null keys
    assert not KeyDiff(0.5).needs_queries and SnapKV(0.5, per_head=True,
                                                     budget="layer").queries_from == "prompt"
    kv = rand(2, L, 16, HKV * HD, seed=13)
    with pytest.raises(ValueError, match="captured queries"):
        pol.keep_indices(kv, LAYOUT)
    with pytest.raises(ValueError, match="exact number of slots"):
        pol.select(kv, 8, LAYOUT)
    with pytest.raises(ValueError, match="exact number of slots"):
        pol.keeping(8)

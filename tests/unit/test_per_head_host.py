"""Per-head edits on the host path, without an engine: the policy's edit (each head's kept
keys gathered and moved to contiguous positions, the token ids per head, the partial last
chunk the same in every head) and the SDK's reading of per-head token ids (equal counts or a
refusal naming the heads, which id stands for a slot, the recomputed tail).

References: a loop over (layer, head) that gathers and re-rotates one head at a time with
the single-head `rerotate`, and hand-counted majorities.
"""
from __future__ import annotations

import pytest
import torch

from kvedit.edits import KeyDiff, KeyNorm, SnapKV, rerotate
from kvedit.layout import ModelLayout, RopeParams
from kvedit.sdk.head_tokens import as_head_tokens, check_tail, stand_ins

L, HKV, GROUP, HD, C = 3, 2, 2, 8, 4
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=C, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def loop_edit(kv, idx):
    """Each (layer, head) on its own: gather its kept tokens, re-rotate them to 0..T'-1."""
    T2 = idx.shape[-1]
    out = torch.empty(2, L, T2, HKV * HD)
    for layer in range(L):
        for h in range(HKV):
            cols = slice(h * HD, (h + 1) * HD)
            part = kv[:, layer:layer + 1, :, cols].index_select(2, idx[layer, h]).clone()
            one = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=HD, dtype="float32",
                              chunk_size=C, rope=LAYOUT.rope)
            rerotate(part, idx[layer, h], torch.arange(T2), one)
            out[:, layer, :, cols] = part[:, 0]
    return out


@pytest.mark.parametrize("policy", [
    KeyNorm(0.5, granularity="token", per_head=True, positions="compact"),
    KeyDiff(0.75, granularity="token", per_head=True, positions="compact")])
def test_per_head_edit_gathers_and_rerotates_each_head_on_its_own(policy):
    T = 18
    kv = rand(2, L, T, HKV * HD, seed=1)
    tokens = list(range(500, 500 + T))
    out, ids = policy(kv, tokens, LAYOUT)
    idx = ids - 500
    keep = T - int(policy.ratio * T)
    assert out.shape == (2, L, keep, HKV * HD) and ids.shape == (L, HKV, keep)
    torch.testing.assert_close(out, loop_edit(kv, idx), rtol=1e-5, atol=1e-5)
    # the slots past the last full chunk hold the prompt's last tokens in every head
    tail = keep % C
    if tail:
        assert (ids[..., keep - tail:] == torch.arange(500 + T - tail, 500 + T)).all()
    assert not all(torch.equal(idx[0, 0], idx[la, h]) for la in range(L) for h in range(HKV))


def test_query_aware_per_head_edit_keeps_its_window_and_the_tail_everywhere():
    T = 20
    kv, q = rand(2, L, T, HKV * HD, seed=2), rand(L, 3, HKV * GROUP * HD, seed=3)
    out, ids = SnapKV(0.5, granularity="token", per_head=True, span=1)(
        kv, list(range(T)), LAYOUT, queries=q, query_start=T)
    assert ids.shape == (L, HKV, 10)
    check_tail(ids, C)  # 10 = 2 chunks + 2: the last two slots agree in every head
    assert (ids[..., -2:] == torch.tensor([18, 19])).all()


def test_stand_ins_are_the_majority_token_of_each_slot_ties_to_the_smaller_id():
    ids = torch.tensor([[[5, 7, 9, 3], [5, 8, 9, 4]],
                        [[6, 8, 9, 4], [6, 7, 9, 3]],
                        [[5, 8, 9, 1], [1, 1, 9, 2]]])
    # slot 0: 5 x3; slot 1: 8 x3; slot 2: all 9; slot 3: 3 x2 and 4 x2 -> 3
    assert stand_ins(ids) == [5, 8, 9, 3]
    same = torch.arange(6).expand(L, HKV, 6)
    assert stand_ins(same) == list(range(6))


def test_heads_keeping_different_counts_are_refused_naming_them():
    rows = [[[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 2, 3]]]
    with pytest.raises(ValueError, match=r"keeps 2 tokens in layer 1, KV head 1 but 3 in "
                                         r"layer 0, KV head 0.*same number of tokens"):
        as_head_tokens(rows, L, HKV)
    assert as_head_tokens([1, 2, 3], L, HKV) is None  # one token list: not per head
    assert as_head_tokens(torch.tensor([1, 2]), L, HKV) is None
    with pytest.raises(ValueError, match=r"must be \[L=3, H_kv=2, T'\]"):
        as_head_tokens(torch.zeros(2, 2, 3, dtype=torch.long), L, HKV)
    with pytest.raises(ValueError, match="must be integers"):
        as_head_tokens(torch.zeros(L, HKV, 3), L, HKV)
    got = as_head_tokens([[[1, 2]] * HKV] * L, L, HKV)
    assert got.shape == (L, HKV, 2) and got.dtype == torch.int64


def test_a_tail_that_differs_between_heads_is_refused():
    ids = torch.arange(6).expand(L, HKV, 6).clone()
    check_tail(ids, C)
    ids[1, 0, 5] = 99
    with pytest.raises(ValueError, match=r"slot 5 holds different tokens.*protect_last >= 2"):
        check_tail(ids, C)
    check_tail(ids[..., :4], C)  # whole chunks only: nothing is recomputed


@pytest.mark.parametrize("per_head", [False, True])
def test_logical_positions_keep_every_distance_to_what_follows(per_head):
    """positions="logical": a query after the edited region (slot T' + j, where vLLM puts
    it) scores every kept key exactly as the same query at T + j scored it unedited."""
    from kvedit.edits.rope import rotate_keys

    T = 16
    kv = rand(2, L, T, HKV * HD, seed=5)
    out, ids = KeyNorm(0.5, granularity="token", per_head=per_head, positions="logical")(
        kv, list(range(T)), LAYOUT)
    keep = out.shape[2]
    idx = ids if per_head else torch.as_tensor(ids).expand(L, HKV, keep)
    q = rand(L, 1, HKV * HD, seed=6)
    for j in (0, 3):
        q_edit = rotate_keys(q.clone(), torch.tensor([keep + j]), LAYOUT.rope, HD)
        q_orig = rotate_keys(q.clone(), torch.tensor([T + j]), LAYOUT.rope, HD)
        for layer in range(L):
            for h in range(HKV):
                cols = slice(h * HD, (h + 1) * HD)
                got = out[0, layer, :, cols] @ q_edit[layer, 0, cols]
                want = kv[0, layer, idx[layer, h], cols] @ q_orig[layer, 0, cols]
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="positions must be one of"):
        KeyNorm(0.5, positions="absolute")
    # the default: logical with per-head selection, compact with one decision per token
    assert KeyNorm(0.5, per_head=True).where == "logical" and KeyNorm(0.5).where == "compact"

"""PromptAnchored, the decode-time budget policy: the prompt ranked once by its own last
window, generated tokens by redundancy and recency, the budget split between them.

What could go wrong and is checked here on synthetic tensors: the ranking must be SnapKV's
(the same scores as SnapKV with the prompt's window), must not change when later queries
would rank the prompt otherwise (the point of the policy: the fact the instruction asks for
survives compaction after compaction), the split and the protected newest tokens must hold
exactly, per-head selections must keep equal counts, and the ranks must follow the prompt
tokens through compactions (positions, not slots).
"""
from __future__ import annotations

import pytest
import torch

from kvedit.engine_budget import BudgetError, EngineBudget
from kvedit.edits import POLICIES, PromptAnchored, PromptRanks, SnapKV, from_spec, to_spec
from kvedit.edits.attention import Window
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD = 4, 2, 2, 8
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=4, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def prompt_with_needle(P=60, W=8, needle=20, seed=0):
    """kv [2, L, P, D] and window queries [L, W, Hq*D] whose every query points at the key of
    token `needle` (a strong match in every layer and head)."""
    kv = rand(2, L, P, HKV * HD, seed=seed) * 0.1
    q = rand(L, W, HKV * GROUP * HD, seed=seed + 1) * 0.1
    key = rand(L, 1, HKV * HD, seed=seed + 2)
    kv[0, :, needle] = key[:, 0] * 4
    for g in range(GROUP):  # each query head of a KV head's group looks at that head's key
        for h in range(HKV):
            qh = (h * GROUP + g) * HD
            q[:, :, qh:qh + HD] = key[:, :, h * HD:(h + 1) * HD] * 4
    return kv, q


def test_the_prompt_is_ranked_as_snapkv_with_its_own_window():
    kv, q = prompt_with_needle()
    pol = PromptAnchored(window=8)
    ranks = pol.rank_prompt(kv, LAYOUT, q)
    want = SnapKV(granularity="token", window=8).token_scores(kv, LAYOUT, Window(q, 60 - 8))
    torch.testing.assert_close(ranks.scores, want)
    assert ranks.resident == 60 and ranks.pos.tolist() == list(range(60))
    assert torch.isinf(ranks.scores[-8:]).all()  # the window (the instruction) is kept


def test_the_needle_survives_every_later_compaction():
    """Prompt 60 with the needle at 20; then compactions every 8 generated tokens at keep 24.
    The prompt keeps at least half of 24 (its ranking from prefill), the needle among them."""
    kv, q = prompt_with_needle()
    pol = PromptAnchored(window=8, protect_last=4, span=1, kernel=1)
    ranks = pol.rank_prompt(kv, LAYOUT, q)
    keep, resident = 24, kv
    logical = torch.arange(60)  # the logical position each slot holds
    for step in range(6):
        new = rand(2, L, 8, HKV * HD, seed=100 + step)
        resident = torch.cat([resident, new], dim=2)
        logical = torch.cat([logical, torch.arange(60 + 8 * step, 60 + 8 * (step + 1))])
        P = ranks.resident
        idx = pol.select(resident, keep, LAYOUT, prompt=ranks)
        assert idx.shape == (keep,) and torch.equal(idx, idx.sort().values)
        p_keep = int((idx < P).sum())
        assert ranks.resident == p_keep
        assert p_keep >= keep // 2 and p_keep <= P
        # the last 4 tokens always kept
        assert set(range(resident.shape[2] - 4, resident.shape[2])) <= set(idx.tolist())
        resident, logical = resident[:, :, idx], logical[idx]
        assert torch.equal(ranks.pos, logical[:p_keep])  # ranks follow positions
        assert 20 in logical.tolist(), f"the needle was dropped at compaction {step}"
    assert ranks.resident == keep // 2  # the prompt is down to its share


def test_split_gives_the_prompt_what_the_reply_leaves():
    pol = PromptAnchored(prompt_share=0.5)
    assert pol.split(100, 1, 50) == (49, 1)     # right after prefill: nearly all prompt
    assert pol.split(100, 30, 50) == (25, 25)   # share reached
    assert pol.split(10, 80, 50) == (10, 40)    # a short prompt is kept whole
    assert PromptAnchored(prompt_share=0.0).split(100, 80, 50) == (0, 50)


def test_generated_tokens_keep_the_later_copy_of_a_repeat():
    """Generated keys with exact repeats: the earlier copy of each repeated key goes first."""
    pol = PromptAnchored(protect_last=0)
    base = rand(2, L, 6, HKV * HD, seed=5)
    gen = torch.cat([base, base[:, :, :3]], dim=2)  # tokens 6, 7, 8 repeat tokens 0, 1, 2
    s = pol.generated_scores(gen, LAYOUT)
    assert s.shape == (9,)
    assert (s[:3].max() < s[3:].min()).item()
    # redundancy 0: recency alone (a recent window)
    r = PromptAnchored(redundancy=0).generated_scores(gen, LAYOUT)
    assert torch.equal(r.argsort(), torch.arange(9))


def test_redundancy_is_the_same_whatever_layers_go_at_once(monkeypatch):
    """The similarities are taken a few layers at a time (SIM_BYTES bounds the temporary):
    the scores must not depend on how many, per head or averaged."""
    from kvedit.edits import anchored

    gen = rand(2, L, 11, HKV * HD, seed=7)
    for per_head in (False, True):
        pol = PromptAnchored(protect_last=0, per_head=per_head)
        whole = pol.generated_scores(gen, LAYOUT)
        monkeypatch.setattr(anchored, "SIM_BYTES", HKV * 11 * 11 * 4 * 3)  # 3 layers, then 1
        parts = pol.generated_scores(gen, LAYOUT)
        monkeypatch.undo()
        # a reference by hand: each token's highest cosine similarity to a later key
        k = torch.nn.functional.normalize(gen[0].view(L, 11, HKV, HD), dim=-1)
        sim = torch.einsum("lihd,ljhd->lhij", k, k)
        sim = sim.masked_fill(~torch.ones(11, 11, dtype=torch.bool).triu(1), -1.0)
        red = sim.amax(-1)
        ref = torch.arange(11) / 11 - (red if per_head else red.mean(dim=(0, 1)))
        assert torch.allclose(whole, parts) and torch.allclose(whole, ref, atol=1e-6)


def test_per_head_keeps_equal_counts_and_tracks_each_head():
    kv, q = prompt_with_needle()
    pol = PromptAnchored(window=8, per_head=True, protect_last=4)
    ranks = pol.rank_prompt(kv, LAYOUT, q)
    assert ranks.scores.shape == (L, HKV, 60) and ranks.pos.shape == (L, HKV, 60)
    resident = torch.cat([kv, rand(2, L, 16, HKV * HD, seed=9)], dim=2)
    idx = pol.select(resident, 30, LAYOUT, prompt=ranks)
    assert idx.shape == (L, HKV, 30)
    p = (idx < 60).sum(-1)
    assert (p == p[0, 0]).all() and ranks.pos.shape == (L, HKV, int(p[0, 0]))
    assert (idx[..., -4:] == torch.arange(72, 76)).all()  # protected in every head
    assert (ranks.pos == 20).any(-1).all()  # the needle in every head


def test_a_one_off_edit_ranks_the_whole_kv_by_its_queries():
    kv, q = prompt_with_needle()
    pol = PromptAnchored(ratio=0.5, window=8, granularity="token")
    idx = pol.keep_indices(kv, LAYOUT, queries=q, query_start=52)
    assert len(idx) == 30 and 20 in idx.tolist()
    with pytest.raises(ValueError, match="PromptRanks"):
        pol.select(kv, 30, LAYOUT)


def test_the_budget_contract_carries_it_and_needs_no_protect_for_its_window():
    pol = PromptAnchored(window=64)
    b = EngineBudget.from_policy(pol, 1024, 32, queries=64)
    assert b.ranks_prompt and b.protect == 32  # the window is the prompt's: not protected
    assert b.policy == "prompt_anchored" and POLICIES[b.policy] is PromptAnchored
    assert isinstance(b.policy_object(), PromptAnchored)
    assert from_spec(to_spec(PromptAnchored(prompt_share=0.25))).prompt_share == 0.25
    with pytest.raises(BudgetError, match="queries"):
        EngineBudget.from_policy(pol, 1024, 32)  # it scores with queries: W needed
    assert not EngineBudget(768, 64, "snapkv", queries=32).ranks_prompt


def test_bad_settings_are_refused_with_the_field():
    with pytest.raises(ValueError, match="prompt_share"):
        PromptAnchored(prompt_share=1.5)
    with pytest.raises(ValueError, match="redundancy"):
        PromptAnchored(redundancy=-1)
    with pytest.raises(ValueError, match="keep must be in"):
        PromptAnchored().select(rand(2, L, 40, HKV * HD), 41, LAYOUT,
                                prompt=PromptRanks.fresh(torch.zeros(30)))
    with pytest.raises(ValueError, match="capture_queries"):
        PromptAnchored().keeping(10, {"prompt_tokens": 30})(rand(2, L, 40, HKV * HD),
                                                            list(range(40)), LAYOUT)


def test_host_edits_keep_the_ranking_in_the_streams_memo():
    """The host driver's way: `keeping(max_tokens, memo)` per edit. The first edit ranks the
    prompt by the captured queries (its region ends inside the prompt: the tail, the window's
    own tokens, stays in the stream's suffix); later edits need no queries, and the prompt
    part (kept tokens, then the tail) stays in front, the needle in it."""
    kv, q = prompt_with_needle(P=60, W=8)
    pol = PromptAnchored(window=8, protect_last=4, span=1, kernel=1)
    memo = {"prompt_tokens": 60}
    fit = pol.keeping(24, memo)
    assert fit.needs_queries
    region = kv[:, :, :56]                      # the last 4 prompt tokens are in the suffix
    out, toks = fit(region, list(range(56)), LAYOUT, queries=q, query_start=52)
    assert out.shape[2] == 24 and 20 in toks
    ranks = memo["ranks"]
    assert ranks.resident == 28 and ranks.pos[-4:].tolist() == [56, 57, 58, 59]
    fit2 = pol.keeping(24, memo)
    assert not fit2.needs_queries
    seq = toks + [56, 57, 58, 59] + list(range(100, 120))   # the tail, then the reply
    kv2 = torch.cat([out, kv[:, :, 56:], rand(2, L, 20, HKV * HD, seed=3)], dim=2)
    out2, toks2 = fit2(kv2, seq, LAYOUT)
    assert len(toks2) == 24 and 20 in toks2 and {56, 57, 58, 59} <= set(toks2)
    assert toks2[-4:] == [116, 117, 118, 119]    # the newest kept
    assert ranks.resident == memo["ranks"].resident == sum(t < 100 for t in toks2)


@pytest.mark.parametrize("per_head", [False, True])
def test_select_many_is_select_of_each_request(per_head, monkeypatch):
    """The compactions of one engine step run as one (`select_many`): each row must be what
    `select` picks for that request alone, and every request's ranking must follow, through
    several compactions in a row (with SIM_BYTES small enough to split the requests)."""
    from kvedit.edits import anchored

    N, P, keep = 3, 60, 30
    pol = PromptAnchored(window=8, protect_last=4, per_head=per_head)
    alone, together, prompts = [], [], []
    for i in range(N):
        kv, q = prompt_with_needle(needle=10 + 7 * i, seed=10 * i)
        prompts.append(kv)
        alone.append(pol.rank_prompt(kv, LAYOUT, q))
        together.append(pol.rank_prompt(kv, LAYOUT, q))
    monkeypatch.setattr(anchored, "SIM_BYTES", HKV * 16 * 16 * 4 * 5)  # 5 rows at a time
    resident = [torch.cat([p, rand(2, L, 16, HKV * HD, seed=50 + i)], dim=2)
                for i, p in enumerate(prompts)]
    for round_ in range(3):
        kv = torch.stack(resident, dim=2)                       # [2, L, N, T, D]
        got = pol.select_many(kv, keep, LAYOUT, together)
        for i in range(N):
            want = pol.select(resident[i], keep, LAYOUT, prompt=alone[i])
            assert torch.equal(got[i], want), (round_, i)
            assert torch.equal(together[i].pos, alone[i].pos)
            # the kept slots, then 8 more generated tokens
            idx = want if not per_head else want[0, 0]
            resident[i] = torch.cat([resident[i].index_select(2, idx),
                                     rand(2, L, 8, HKV * HD, seed=100 * round_ + i)], dim=2)
        if per_head:  # per-head rows differ: go on with the last round's slots alone
            break


def test_select_many_refuses_requests_whose_prompts_differ():
    kv, q = prompt_with_needle()
    pol = PromptAnchored(window=8)
    a, b = pol.rank_prompt(kv, LAYOUT, q), pol.rank_prompt(kv[:, :, :40], LAYOUT, q)
    both = torch.stack([kv, kv], dim=2)
    with pytest.raises(ValueError, match="same resident prompt"):
        pol.select_many(both, 30, LAYOUT, [a, b])

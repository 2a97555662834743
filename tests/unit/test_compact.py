"""In-engine compaction's data movement (kvedit.vllm.budget.compact) on a synthetic paged cache in
vLLM's CPU layout, and the budget contract (kvedit.engine_budget).

References: a per-token loop over the kept slots (per head), keys re-rotated with one
`rerotate` call per head; the request's other blocks and every other block untouched; a
compaction that leaves out the kept slots staying in place writes the bytes of one that
copies them all.
"""
from __future__ import annotations

import re

import pytest
import torch

from kvedit.engine_budget import BudgetError, EngineBudget
from kvedit.edits import KeyNorm, RandomDrop, StreamingLLM, rerotate
from kvedit.layout import ModelLayout, RopeParams
from kvedit.request_params import BUDGET_FIELD, RequestAsks, read_asks
from kvedit.vllm.budget import compact
from kvedit.vllm.paged import PagedKV

L, H, HD, BS = 3, 2, 16, 16
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype="float32",
                     chunk_size=BS, rope=RopeParams(theta=10000.0))


def paged_cache(nblocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(nblocks, H, BS, 2 * HD, generator=g) for _ in range(L)]
    return layers, PagedKV(layers, "cpu", HD, BS)


def test_gather_scatter_round_trip_touches_only_the_given_slots():
    layers, paged = paged_cache()
    before = [t.clone() for t in layers]
    kv = compact.gather(paged, [5, 2, 9], 40)           # 2.5 blocks of a request
    assert kv.shape == (2, L, 40, H * HD)
    compact.scatter(paged, [7, 3], kv[:, :, :20] * 0 + 1.5)
    for i, (t, b) in enumerate(zip(layers, before)):
        changed = (t != b).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert changed == [3, 7], f"layer {i}: blocks {changed} changed"
    assert (compact.gather(paged, [7, 3], 20) == 1.5).all()
    # a second gather of the untouched source reads what the first did
    assert torch.equal(compact.gather(paged, [5, 2, 9], 40), kv)


@pytest.mark.parametrize("positions", ["compact", "logical"])
def test_kept_kv_per_token_and_per_head_match_a_loop(positions):
    _, paged = paged_cache(seed=1)
    kv = compact.gather(paged, [0, 1, 2], 40)
    keep = torch.tensor([0, 1, 5, 9, 20, 33, 39])
    got = compact.kept_kv(kv, keep, LAYOUT, positions)
    want = kv.index_select(2, keep)
    if positions == "compact":
        rerotate(want, keep, torch.arange(len(keep)), LAYOUT)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    per_head = torch.stack([torch.stack([torch.randperm(40, generator=torch.Generator()
                                                        .manual_seed(10 * la + h))[:7].sort()
                                         .values for h in range(H)]) for la in range(L)])
    got = compact.kept_kv(kv, per_head, LAYOUT, positions)
    for la in range(L):
        for h in range(H):
            cols = slice(h * HD, (h + 1) * HD)
            one = kv[:, la:la + 1, :, cols].index_select(2, per_head[la, h]).clone()
            if positions == "compact":
                rerotate(one, per_head[la, h], torch.arange(7), rope=LAYOUT.rope, head_dim=HD)
            torch.testing.assert_close(got[:, la:la + 1, :, cols], one, rtol=1e-5, atol=1e-5)
    # from kept slot `start` on: the same bytes as the whole result's tail (what a compaction
    # writes when its leading kept slots stay where they are)
    for start in (1, 3):
        for k in (keep, per_head):
            torch.testing.assert_close(compact.kept_kv(kv, k, LAYOUT, positions, start),
                                       compact.kept_kv(kv, k, LAYOUT, positions)[:, :, start:],
                                       rtol=0, atol=0)
    assert not torch.equal(got[:, :, :, :HD], got[:, :, :, HD:])  # heads keep their own


@pytest.mark.parametrize("positions", ["compact", "logical"])
@pytest.mark.parametrize("case", ["in_place", "copied_block", "per_head"])
def test_slots_that_stay_in_place_are_left_out_with_the_same_bytes(positions, case):
    keep = torch.cat([torch.arange(21), torch.arange(30, 45)])   # 21 stay, 15 move down
    old, new = [4, 8, 1], [4, 8, 1][:3]
    if case == "copied_block":
        new = [4, 11, 1]          # the second kept block is a fresh copy: only 16 stay
    if case == "per_head":        # slot 20 moves in one head only
        keep = keep.expand(L, H, -1).clone()
        keep[1, 0, 20] = 25
    want = {"in_place": 21, "copied_block": 16, "per_head": 20}[case]
    assert compact.unmoved(keep, old, new, BS) == want
    results = []
    for start in (0, want):
        layers, paged = paged_cache(seed=5)
        if case == "per_head":
            kept = compact.kept_kv(compact.gather(paged, old, 48), keep, LAYOUT,
                                   positions)[:, :, start:]
        else:
            kept = compact.gather_kept(paged, old, keep, LAYOUT, positions, start)
        compact.scatter(paged, new, kept, start)
        results.append(layers)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_newest_tokens_are_protected_by_default():
    """protect defaults to `every` (at least `queries`, at most what a compaction keeps), on
    both sides of the wire; a content policy then cannot drop the newest tokens even when
    they score worst (here the newest keys have the largest norms, which KeyNorm drops
    first), while protect=0 lets it (what cut SmolLM2's counts: docs/in-engine.md)."""
    b = EngineBudget(512, 64, "key_norm")
    assert b.protect == 64 and EngineBudget.from_dict(b.to_dict()).protect == 64
    assert EngineBudget(512, 64, "snapkv", protect=None, queries=96).protect == 96
    assert EngineBudget(100, 64, "key_norm").protect == 36   # keep = 36
    assert EngineBudget.from_policy(KeyNorm(), 512, 64).protect == 64
    assert EngineBudget.from_policy(KeyNorm(protect_last=8), 512, 64).protect == 8
    assert EngineBudget.from_policy(KeyNorm(), 512, 64, protect=0).protect == 0
    T = 512
    kv = torch.ones(2, 2, T, 128)
    kv[0, :, -100:] *= 10                                    # the newest keys: largest norms
    for protect, newest_kept in ((None, True), (0, False)):
        pol = EngineBudget(T, 64, "key_norm", protect=protect).policy_object()
        idx = pol.select(kv, T - 64, LAYOUT)
        assert (T - 1 in idx.tolist()) is newest_kept
        if newest_kept:
            assert set(range(T - 64, T)) <= set(idx.tolist())


def test_budget_contract_round_trips_and_names_what_is_wrong():
    b = EngineBudget(768, 128, "key_norm", {"granularity": "chunk"}, protect=16,
                     positions="logical", per_head=True)
    assert EngineBudget.from_dict(b.to_dict()) == b
    assert read_asks(RequestAsks(budget=b).to_params()).budget == b
    assert read_asks({"other": 1}).budget is None and read_asks(None).budget is None
    pol = b.policy_object()
    assert isinstance(pol, KeyNorm) and pol.per_head and pol.protect_last == 16
    assert b.keep == 640
    assert EngineBudget.from_policy(StreamingLLM(sink=8, per_head=True), 512, 64).args == \
        {"granularity": "chunk", "sink": 8}
    assert EngineBudget.from_policy(RandomDrop(seed=3, granularity="token"), 512,
                                    64).policy == "random"
    cases = [
        ({"tokens": 100, "every": 100}, "leaves 0 tokens per compaction"),
        ({"tokens": 0}, r"tokens is 0; expected a positive integer"),
        ({"tokens": 256, "policy": "nope"}, r"policy is 'nope'; expected one of"),
        ({"tokens": 256, "policy": "snapkv"}, "scores with captured queries"),
        ({"tokens": 256, "positions": "rotated"}, "positions is 'rotated'"),
        ({"tokens": 256, "args": {"ratio": 0.5}}, "fields other than ratio"),
        ({"tokens": 256, "args": {"sink": -1}, "policy": "streaming_llm"}, "sink >= 0"),
        ({"tokens": 256, "policy": "leverage", "positions": "logical"}, "only positions"),
        ({"every": 8}, r"no 'tokens'"),
        ({"tokens": 256, "colour": 1}, r"unknown fields \['colour'\]"),
    ]
    for raw, msg in cases:
        with pytest.raises(BudgetError, match=msg):
            EngineBudget.from_dict(raw)
        asks = read_asks({BUDGET_FIELD: raw})   # the engine's reading: refused, with why
        assert asks.budget is None and re.search(msg, asks.budget_error)
        assert asks.budget_error.startswith("kv_transfer_params['kvedit_budget']: ")
    with pytest.raises(BudgetError, match="expected an object"):
        EngineBudget.from_dict(512)
    with pytest.raises(BudgetError, match="not one of"):
        EngineBudget.from_policy(object(), 512, 64)


@pytest.mark.parametrize("positions", ["compact", "logical"])
@pytest.mark.parametrize("per_head", [False, True])
def test_many_requests_at_once_build_what_each_builds_alone(positions, per_head):
    """One engine step's compactions as one (`gather_many`, `kept_kv_many`, scattered
    through `PagedKV.slots_many`) leave every block as one compaction after another does."""
    layers, paged = paged_cache(nblocks=16, seed=3)
    twin_layers = [t.clone() for t in layers]
    twin = PagedKV(twin_layers, "cpu", HD, BS)
    olds, news, n, keep_n = [[0, 1, 2], [5, 6, 7], [9, 10, 11]], [[12, 1], [13, 6], [14, 15]], 40, 20
    g = torch.Generator().manual_seed(4)
    if per_head:
        keep = torch.stack([torch.stack([torch.stack([torch.randperm(n, generator=g)[:keep_n].sort()
                                                      .values for _ in range(H)])
                                         for _ in range(L)]) for _ in olds])  # [N, L, H, k]
    else:
        keep = torch.stack([torch.randperm(n, generator=g)[:keep_n].sort().values for _ in olds])
    kv = compact.gather_many(paged, olds, n)
    assert kv.shape == (2, L, 3, n, H * HD)
    for i, old in enumerate(olds):
        assert torch.equal(kv[:, :, i], compact.gather(paged, old, n))
    data = compact.kept_kv_many(kv, keep, LAYOUT, positions)
    pos = torch.arange(keep_n)
    paged.scatter(paged.slots_many([(new, pos) for new in news]), data)
    for i, (old, new) in enumerate(zip(olds, news)):
        alone = compact.kept_kv(compact.gather(twin, old, n), keep[i], LAYOUT, positions)
        compact.scatter(twin, new, alone)
    for a, b in zip(layers, twin_layers):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

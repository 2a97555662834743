"""Dropping policies on synthetic KV: kept indices, ratio, order, first/last rules, errors."""
from __future__ import annotations

import pytest
import torch

from kvedit.edits import (DropMiddle, DropPolicy, KeyDiff, KeyNorm, LeverageScore, RandomDrop,
                          SnapKVProxy, StreamingLLM, UniformDrop, rerotate, rotate_keys)
from kvedit.edits.base import Units
from kvedit.layout import ModelLayout, RopeParams

L, H, HD, C = 2, 2, 8, 4
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype="float32", chunk_size=C,
                     rope=RopeParams(theta=10000.0))


def make_kv(T, seed=0):
    return torch.randn(2, L, T, H * HD, generator=torch.Generator().manual_seed(seed))


def chunks_of(idx):
    return sorted({i // C for i in idx.tolist()})


def test_drop_middle_chunks():
    kv = make_kv(10 * C)  # 10 chunks, drop 5: keep 0..1 and 7..9 (run centred, first/last kept)
    idx = DropMiddle(0.5).keep_indices(kv, LAYOUT)
    assert chunks_of(idx) == [0, 1, 7, 8, 9]
    assert idx.tolist() == list(range(0, 2 * C)) + list(range(7 * C, 10 * C))
    # Largest possible drop still keeps the first and last chunk.
    assert chunks_of(DropMiddle(0.8).keep_indices(make_kv(10 * C), LAYOUT)) == [0, 9]


def test_drop_middle_partial_last_chunk_and_tokens():
    kv = make_kv(8 * C + 2)  # 9 units, the last one partial: drop 4 -> keep 0,1 + 6,7,8
    idx = DropMiddle(0.5).keep_indices(kv, LAYOUT)
    assert chunks_of(idx) == [0, 1, 6, 7, 8] and idx[-1] == 8 * C + 1
    tok = DropMiddle(0.5, granularity="token").keep_indices(make_kv(10), LAYOUT)
    assert tok.tolist() == [0, 1, 7, 8, 9]


def test_call_gathers_rerotates_and_keeps_tokens_aligned():
    kv = make_kv(6 * C)
    tokens = list(range(100, 100 + 6 * C))
    out, kept = DropMiddle(0.5)(kv.clone(), tokens, layout=LAYOUT)
    idx = DropMiddle(0.5).keep_indices(kv, LAYOUT)
    assert kept == [tokens[i] for i in idx.tolist()]
    assert out.shape == (2, L, len(idx), H * HD)
    torch.testing.assert_close(out[1], kv[1][:, idx])  # values gathered, unchanged
    expect = rerotate(kv[:, :, idx].clone(), idx, torch.arange(len(idx)), LAYOUT)
    torch.testing.assert_close(out[0], expect[0])
    assert not torch.allclose(out[0], kv[0][:, idx])  # moved keys were re-rotated
    # Without rotation no layout is needed.
    plain, _ = DropMiddle(0.5, chunk_size=C, rerotate=False)(kv, tokens)
    torch.testing.assert_close(plain, kv[:, :, idx])
    tt, tk = DropMiddle(0.5, chunk_size=C, rerotate=False)(kv, torch.tensor(tokens))
    assert torch.equal(tk, torch.tensor(tokens)[idx])


def test_uniform_drop_even_spacing():
    idx = UniformDrop(0.5).keep_indices(make_kv(10 * C), LAYOUT)
    assert chunks_of(idx) == [0, 2, 5, 7, 9]  # 5 of 10, first and last included
    idx = UniformDrop(0.75, granularity="token").keep_indices(make_kv(8), LAYOUT)
    assert idx.tolist() == [0, 7]
    idx = UniformDrop(0.25, granularity="token").keep_indices(make_kv(4), LAYOUT)
    assert idx.tolist() == [0, 2, 3]  # 1.5 rounds up, as floor(x + 0.5) does


def test_streaming_llm_sink_and_window():
    idx = StreamingLLM(0.5, sink=4, granularity="token").keep_indices(make_kv(20), LAYOUT)
    assert idx.tolist() == [0, 1, 2, 3] + list(range(14, 20))
    idx = StreamingLLM(sink=2, window=5, granularity="token").keep_indices(make_kv(20), LAYOUT)
    assert idx.tolist() == [0, 1] + list(range(15, 20))
    short = StreamingLLM(sink=2, window=50, granularity="token").keep_indices(make_kv(20), LAYOUT)
    assert short.tolist() == list(range(20))  # shorter than sink + window: nothing dropped
    # Chunk granularity: the sink rounds up to the first chunk.
    assert chunks_of(StreamingLLM(0.5).keep_indices(make_kv(8 * C), LAYOUT)) == [0, 5, 6, 7]


def test_key_norm_keeps_low_norm_keys():
    kv = make_kv(8 * C)
    loud = [1, 3, 6]
    for c in loud:  # large keys in three chunks
        kv[0, :, c * C:(c + 1) * C] *= 10
    kv[0, :, 2 * C] *= 100  # one very loud token in chunk 2
    assert chunks_of(KeyNorm(0.5).keep_indices(kv, LAYOUT)) == [0, 4, 5, 7]
    tok = KeyNorm(0.5, granularity="token").keep_indices(kv, LAYOUT)
    assert not set(tok.tolist()) & {2 * C} and len(tok) == 4 * C


def test_snapkv_keeps_window_and_attended_tokens():
    T = 8 * C
    kv = make_kv(T) * 0.1
    q = torch.randn(H * HD)
    kv[0, :, T - C:] += q  # the last chunk (the window) shares a direction ...
    kv[0, :, 2 * C + 1] = 3 * q  # ... with one token of chunk 2, which draws its attention
    pol = SnapKVProxy(0.5, window=C, kernel=1)
    assert {2, 7} <= set(chunks_of(pol.keep_indices(kv, LAYOUT)))
    tok = SnapKVProxy(0.8, window=C, kernel=1, granularity="token").keep_indices(kv, LAYOUT)
    assert set(range(T - C, T)) <= set(tok.tolist()) and 2 * C + 1 in tok.tolist()


@pytest.mark.parametrize("policy", [DropMiddle(0.5), UniformDrop(0.5), StreamingLLM(0.5),
                                    KeyNorm(0.5), SnapKVProxy(0.5, window=C), KeyDiff(0.5),
                                    LeverageScore(0.5), RandomDrop(0.5)])
@pytest.mark.parametrize("T", [12 * C, 12 * C + 3])
def test_every_policy_ratio_and_order(policy, T):
    idx = policy.keep_indices(make_kv(T, seed=T), LAYOUT)
    units = -(-T // C)
    kept_units = len(chunks_of(idx))
    assert kept_units == units - int(0.5 * units)
    assert idx.tolist() == sorted(set(idx.tolist()))  # order kept, no duplicates
    for c in chunks_of(idx):  # whole chunks only
        assert set(range(c * C, min(T, (c + 1) * C))) <= set(idx.tolist())


def unit_keys(T, direction, spread, seed):
    """[L, T, H*HD] keys of norm 1 (per head) around `direction` [HD] with noise `spread`."""
    g = torch.Generator().manual_seed(seed)
    k = direction + spread * torch.randn(L, T, H, HD, generator=g)
    return torch.nn.functional.normalize(k, dim=-1).view(L, T, H * HD)


def test_keydiff_keeps_outlier_keys_and_drops_the_mean_aligned():
    g = torch.Generator().manual_seed(7)
    u = torch.nn.functional.normalize(torch.randn(HD, generator=g), dim=0)
    kv = make_kv(8 * C)
    kv[0] = unit_keys(8 * C, u, 0.3, seed=1)       # every key norm 1: KeyNorm sees no difference
    kv[0, :, 2 * C:3 * C] = unit_keys(C, -u, 0.3, seed=2)  # chunk 2 points away from the mean
    kv[0, :, 5 * C:6 * C] = unit_keys(C, -u, 0.3, seed=3)  # chunk 5 too
    kv[0, :, 6 * C:7 * C] = u.repeat(H)             # chunk 6 is the mean direction exactly
    kept = chunks_of(KeyDiff(0.5).keep_indices(kv, LAYOUT))
    assert {2, 5} <= set(kept) and 6 not in kept
    # A planted token: one key opposite the mean in every layer and head survives ratio 0.75.
    kv[0, :, 4 * C + 1] = (-u).repeat(H)
    tok = KeyDiff(0.75, granularity="token").keep_indices(kv, LAYOUT).tolist()
    assert 4 * C + 1 in tok and not set(range(6 * C, 7 * C)) & set(tok)


def test_keydiff_score_is_kvpress_per_head_cosine_averaged_over_layers_and_heads():
    kv = make_kv(3 * C + 1, seed=5)
    kv[0, :, :, :HD] *= 50  # head 0 much louder than head 1: cosines do not care
    units = Units(size=1, count=3 * C + 1, tokens=3 * C + 1)
    got = KeyDiff(0.5, granularity="token").score(kv, units, LAYOUT)
    k = kv[0].view(L, -1, H, HD)
    ref = torch.zeros(units.count)
    for layer in range(L):
        for h in range(H):
            keys = k[layer, :, h]
            anchor = torch.nn.functional.normalize(keys, dim=-1).mean(dim=0, keepdim=True)
            ref -= torch.nn.functional.cosine_similarity(keys, anchor, dim=-1) / (L * H)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_leverage_keeps_keys_outside_the_common_subspace_whatever_their_rotation():
    T, g = 8 * C, torch.Generator().manual_seed(11)
    basis = torch.linalg.qr(torch.randn(HD, HD, generator=g)).Q  # orthonormal directions
    coef = torch.randn(L, T, H, 3, generator=g)
    pre = coef @ basis[:3] + 0.01 * torch.randn(L, T, H, HD, generator=g)  # a 3-d subspace
    outliers = [C + 2, 5 * C + 1]
    for t in outliers:  # same norm as the others, but along a direction nobody else uses
        pre[:, t] = basis[5] * pre[:, t].norm(dim=-1, keepdim=True)
    kv = make_kv(T)
    kv[0] = pre.reshape(L, T, H * HD)
    rotate_keys(kv[0], torch.arange(T), LAYOUT.rope, HD)  # the cache holds rotated keys
    units = Units(size=1, count=T, tokens=T)
    got = LeverageScore(0.5, granularity="token").score(kv, units, LAYOUT)
    assert set(got.topk(2).indices.tolist()) == set(outliers)
    # Reference on the pre-RoPE keys: z-scored hat-matrix diagonal, averaged over (layer, head).
    ref = torch.zeros(T, dtype=torch.float64)
    for layer in range(L):
        for h in range(H):
            x = pre[layer, :, h].double()
            x = x - x.mean(0)
            gram = x.T @ x
            gram += 1e-4 * gram.diagonal().mean() * torch.eye(HD, dtype=torch.float64)
            lev = torch.einsum("td,de,te->t", x, torch.linalg.inv(gram), x)
            ref += (lev - lev.mean()) / lev.std() / (L * H)
    torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=1e-3)
    kept = chunks_of(LeverageScore(0.5).keep_indices(kv, LAYOUT))
    assert {1, 5} <= set(kept)
    before = kv.clone()
    LeverageScore(0.5).keep_indices(kv, LAYOUT)
    assert torch.equal(kv, before)


def test_random_drop_is_seeded_and_unbiased():
    kv = make_kv(20 * C)
    a = RandomDrop(0.5, seed=3).keep_indices(kv, LAYOUT)
    assert torch.equal(a, RandomDrop(0.5, seed=3).keep_indices(kv, LAYOUT))
    assert not torch.equal(a, RandomDrop(0.5, seed=4).keep_indices(kv, LAYOUT))
    kept = torch.zeros(20)
    for seed in range(200):
        kept[chunks_of(RandomDrop(0.5, seed=seed).keep_indices(kv, LAYOUT))] += 1
    assert kept.sum() == 200 * 10 and kept.min() > 60 and kept.max() < 140  # ~100 each


def test_a_new_policy_is_one_score_method():
    class DropOdd(DropPolicy):
        def score(self, kv, units, layout):
            return (torch.arange(units.count) % 2 == 0).float()

    idx = DropOdd(0.5, granularity="token").keep_indices(make_kv(10), LAYOUT)
    assert idx.tolist() == [0, 2, 4, 6, 8]


def test_errors():
    with pytest.raises(ValueError, match="ratio must be in"):
        DropMiddle(1.0)
    with pytest.raises(ValueError, match="ratio must be in"):
        KeyNorm(-0.1)
    with pytest.raises(ValueError, match="granularity"):
        UniformDrop(0.5, granularity="layer")
    with pytest.raises(ValueError, match="too short"):
        UniformDrop(0.3).keep_indices(make_kv(3 * C), LAYOUT)  # 0.9 chunks rounds to 0
    with pytest.raises(ValueError, match="first and last"):
        DropMiddle(0.7).keep_indices(make_kv(2 * C + 1), LAYOUT)  # 3 units: cannot drop 2
    with pytest.raises(ValueError, match="too short"):
        DropMiddle(0.5).keep_indices(make_kv(C), LAYOUT)
    with pytest.raises(ValueError, match=r"RoPE parameters \(layout.rope\)"):
        DropMiddle(0.5)(make_kv(8 * C), list(range(8 * C)))
    with pytest.raises(ValueError, match="RoPE"):
        DropMiddle(0.5)(make_kv(8 * C), list(range(8 * C)),
                        layout=ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD,
                                           dtype="float32", chunk_size=C))
    with pytest.raises(ValueError, match="tokens but kv holds"):
        DropMiddle(0.5)(make_kv(8 * C), list(range(5)), layout=LAYOUT)
    with pytest.raises(ValueError, match=r"\[2, L, T, D\]"):
        DropMiddle(0.5).keep_indices(torch.zeros(3, L, 8, H * HD), LAYOUT)
    with pytest.raises(ValueError, match="head_dim"):
        KeyNorm(0.5, chunk_size=C, rerotate=False).keep_indices(make_kv(8 * C), None)
    with pytest.raises(ValueError, match="odd kernel"):
        SnapKVProxy(0.5, kernel=4)
    with pytest.raises(ValueError, match="sink"):
        StreamingLLM(0.5, sink=-1)
    with pytest.raises(ValueError, match="window"):
        StreamingLLM(0.9, sink=8, granularity="token").keep_indices(make_kv(10), LAYOUT)

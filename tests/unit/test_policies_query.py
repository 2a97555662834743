"""Query-aware policies (SnapKV, TOVA) on synthetic tensors and against transformers.

The reference for "same scores" is transformers' own eager attention weights on the tiny
Qwen3 in float32: the policy, fed the queries transformers computes (q_proj -> q_norm ->
RoPE, read in a forward hook) and the keys of its cache, must score every token exactly as
the same aggregation computed from `output_attentions` for the window rows.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvedit.edits import (POLICIES, TOVA, DropPolicy, KeyNorm, SnapKV, SnapKVProxy, Window,
                          window_attention)
from kvedit.edits.attention import check_window
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD = 3, 2, 3, 8
HQ = HKV * GROUP
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=4, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def naive_attention(kv, queries, start):
    """Loop reference: per layer, query head h -> KV head h // GROUP, causal by position."""
    T = kv.shape[2]
    total = torch.zeros(T, dtype=torch.float64)
    for layer in range(kv.shape[1]):
        k = kv[0, layer].double().view(T, HKV, HD)
        q = queries[layer].double().view(queries.shape[1], HQ, HD)
        for h in range(HQ):
            for r in range(q.shape[0]):
                seen = min(T, start + r + 1)
                logits = k[:seen, h // GROUP] @ q[r, h] / math.sqrt(HD)
                total[:seen] += logits.softmax(0)
    return total.float()


@pytest.mark.parametrize("T,W,start", [(20, 5, 20), (20, 5, 30), (20, 6, 16), (20, 4, 3)])
def test_window_attention_matches_the_loop_reference(T, W, start):
    kv, q = rand(2, L, T, HKV * HD, seed=T), rand(L, W, HQ * HD, seed=W) * 2
    got = window_attention(kv, Window(q, start), HD)
    torch.testing.assert_close(got, naive_attention(kv, q, start), rtol=1e-5, atol=1e-5)
    # Every (layer, query head, row) adds a distribution of mass 1.
    assert got.sum().item() == pytest.approx(L * HQ * W, rel=1e-5)
    # Blocks of layers change nothing.
    small = window_attention(kv, Window(q, start), HD, block_bytes=1)
    torch.testing.assert_close(small, got, rtol=1e-6, atol=1e-6)
    # A range of layers sums those layers only.
    deep = window_attention(kv, Window(q, start), HD, layers=range(1, L), block_bytes=1)
    torch.testing.assert_close(deep, naive_attention(kv[:, 1:], q[1:], start), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("per_head,heads,rows", [(False, "sum", "sum"), (False, "max", "sum"),
                                                 (True, "sum", "sum"), (True, "max", "max")])
def test_row_blocks_give_the_scores_of_whole_layers(per_head, heads, rows):
    """A layer whose rows alone pass block_bytes (KVzip's ~4k rows) is scored in blocks of
    rows: the same scores (each row's softmax is its own), never the whole layer's logits."""
    T, W, start = 20, 7, 20
    kv, q = rand(2, L, T, HKV * HD, seed=3), rand(L, W, HQ * HD, seed=4) * 2
    kw = {"heads": heads, "rows": rows, "per_head": per_head}
    whole = window_attention(kv, Window(q, start), HD, **kw)
    for rows_per_block in (1, 2, 3):  # 7 rows in blocks of 1, 2 (+1) and 3 (+1)
        got = window_attention(kv, Window(q, start), HD,
                               block_bytes=HKV * GROUP * T * 4 * rows_per_block, **kw)
        torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)
    # float32 queries (no copy on .float()) in row blocks too
    got = window_attention(kv, Window(q.float(), start), HD, block_bytes=HKV * GROUP * T * 8,
                           layers=range(1, L), **kw)
    ref = window_attention(kv, Window(q, start), HD, layers=range(1, L), **kw)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_gqa_group_of_a_query_head():
    """Query heads 3..5 (group of KV head 1) look for token 7, which only KV head 1's key
    answers; the same queries against KV head 0 would find nothing."""
    T, W = 16, 2
    kv = rand(2, L, T, HKV * HD, seed=1) * 0.01
    kv[0, :, 7, HD:] = 10.0  # KV head 1's key of token 7
    q = torch.zeros(L, W, HQ, HD)
    q[:, :, GROUP:2 * GROUP] = 10.0  # the query heads of group 1
    s = window_attention(kv, Window(q.view(L, W, HQ * HD), T), HD)
    assert s.argmax().item() == 7
    assert s[7] > 0.9 * L * GROUP * W  # group 1's heads put nearly all their mass on it
    kv2 = kv.clone()
    kv2[0, :, 7, HD:] = 0.0
    kv2[0, :, 7, :HD] = 10.0  # the loud key moved to KV head 0: group 1 no longer sees it
    assert window_attention(kv2, Window(q.view(L, W, HQ * HD), T), HD)[7] < 0.5 * s[7]


def test_snapkv_keeps_what_the_queries_attend_and_its_window():
    T, W = 32, 4
    kv = rand(2, L, T, HKV * HD, seed=2) * 0.1
    direction = rand(HD, seed=3)
    kv[0, :, 9] = direction.repeat(HKV) * 3  # token 9: the needle every query head looks for
    q = direction.repeat(L, W, HQ, 1).reshape(L, W, HQ * HD)
    kept = SnapKV(0.75, granularity="token", span=1, kernel=1).keep_indices(kv, LAYOUT,
                                                                            queries=q)
    assert 9 in kept.tolist() and len(kept) == T - 24
    # A window inside the edited tokens (rows at positions 28..31) is kept whole.
    kept = SnapKV(0.75, granularity="token", span=1).keep_indices(kv, LAYOUT, queries=q,
                                                                  query_start=28)
    assert {9, 28, 29, 30, 31} <= set(kept.tolist())
    # Pooling keeps the needle's neighbours with it.
    kept = SnapKV(0.75, granularity="token", span=1, kernel=5).keep_indices(kv, LAYOUT,
                                                                            queries=q)
    assert {8, 9, 10} <= set(kept.tolist())


def test_causal_part_of_the_window():
    """A row sees only keys up to its own position: a key after it cannot draw its attention."""
    T = 24
    kv = rand(2, L, T, HKV * HD, seed=4) * 0.1
    direction = rand(HD, seed=5)
    kv[0, :, 20] = direction.repeat(HKV) * 3  # matches the query, but after row 0 (pos 10)
    q = direction.repeat(L, 1, HQ, 1).reshape(L, 1, HQ * HD)
    inside = window_attention(kv, Window(q, 10), HD)
    assert inside[11:].abs().sum() == 0 and inside[20] == 0
    after = window_attention(kv, Window(q, T), HD)
    assert after.argmax().item() == 20


def test_tova_uses_the_last_row_only():
    T, W = 32, 6
    kv = rand(2, L, T, HKV * HD, seed=6) * 0.1
    a, b = rand(HD, seed=7), rand(HD, seed=8)
    kv[0, :, 5] = a.repeat(HKV) * 3
    kv[0, :, 17] = b.repeat(HKV) * 3
    q = a.repeat(L, W, HQ, 1)
    q[:, -1] = b  # only the last row (the last prompt token) looks for token 17
    q = q.reshape(L, W, HQ * HD)
    tova = TOVA(0.9, granularity="token", span=1).keep_indices(kv, LAYOUT, queries=q)
    assert 17 in tova.tolist() and 5 not in tova.tolist()
    snap = SnapKV(0.9, granularity="token", span=1, kernel=1).keep_indices(kv, LAYOUT,
                                                                           queries=q)
    assert 5 in snap.tolist()  # five rows of six look for token 5
    with pytest.raises(ValueError, match="last query only"):
        TOVA(0.5, window=4)


def test_call_drops_and_rerotates_with_queries():
    T, W = 32, 4
    kv, q = rand(2, L, T, HKV * HD, seed=9), rand(L, W, HQ * HD, seed=10).bfloat16()
    tokens = list(range(100, 100 + T))
    out, kept = SnapKV(0.5, granularity="token", span=1)(kv, tokens, layout=LAYOUT, queries=q)
    idx = SnapKV(0.5, granularity="token", span=1).keep_indices(kv, LAYOUT, queries=q)
    assert out.shape == (2, L, 16, HKV * HD) and kept == [100 + i for i in idx.tolist()]
    torch.testing.assert_close(out[1], kv[1].index_select(1, idx))  # values move, unchanged


def test_needs_queries_flags_and_errors():
    assert SnapKV.needs_queries and TOVA.needs_queries
    assert not any(cls.needs_queries for cls in (DropPolicy, KeyNorm, SnapKVProxy))
    assert {name for name, cls in POLICIES.items() if cls.needs_queries} == {
        "snapkv", "tova", "kvzip", "prompt_anchored"}
    kv = rand(2, L, 16, HKV * HD)
    with pytest.raises(ValueError, match=r"capture_queries=W"):
        SnapKV(0.5)(kv, list(range(16)), layout=LAYOUT)
    with pytest.raises(ValueError, match=r"\[L=3, W>0"):
        SnapKV(0.5).keep_indices(kv, LAYOUT, queries=rand(2, 4, HQ * HD))
    with pytest.raises(ValueError, match="multiple of head_dim"):
        SnapKV(0.5).keep_indices(kv, LAYOUT, queries=rand(L, 4, HQ * HD + 1))
    with pytest.raises(ValueError, match="KV heads"):
        check_window("x", kv, rand(L, 4, 3 * HD), None, HD)  # 3 query heads, 2 KV heads
    with pytest.raises(ValueError, match="query_start must be >= 0"):
        SnapKV(0.5).keep_indices(kv, LAYOUT, queries=rand(L, 4, HQ * HD), query_start=-1)
    with pytest.raises(ValueError, match="head_dim"):
        SnapKV(0.5, rerotate=False, granularity="token", span=1)(kv, list(range(16)),
                                                         queries=rand(L, 4, HQ * HD))
    with pytest.raises(ValueError, match="odd kernel"):
        SnapKV(0.5, kernel=4)
    with pytest.raises(ValueError, match="from_layer"):
        TOVA(0.5, from_layer=1.0)
    # A query-free policy ignores queries (the SDK does not fetch them for it).
    assert torch.equal(KeyNorm(0.5).keep_indices(kv, LAYOUT, queries=None),
                       KeyNorm(0.5).keep_indices(kv, LAYOUT))


# -- against transformers' attention weights (tiny Qwen3, float32) -------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_run():
    """One float32 forward of the tiny Qwen3 over P random tokens: per layer the post-RoPE
    queries (hooked), the cache's post-RoPE keys and the eager attention weights."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from kvedit.harness.tiny_model import default_tiny_model

    model = AutoModelForCausalLM.from_pretrained(default_tiny_model(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    P = 48
    ids = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(0))
    queries = []

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"]
        q = module.q_norm(module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim))
        q = q.transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        queries.append(q[0].transpose(0, 1).reshape(P, -1))  # [P, Hq*D]

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    keys = torch.stack([out.past_key_values.layers[i].keys[0].transpose(0, 1).reshape(P, -1)
                        for i in range(cfg.num_hidden_layers)])  # [L, P, Hkv*D]
    attn = torch.stack([a[0] for a in out.attentions])  # [L, Hq, P, P]
    layout = ModelLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, dtype="float32", chunk_size=16,
                         rope=RopeParams(theta=cfg.rope_parameters["rope_theta"]))
    return {"queries": torch.stack(queries), "keys": keys, "attn": attn, "P": P,
            "layout": layout}


def reference_scores(attn, T, start, W, first_layer=0):
    """From transformers' weights: rows start..start+W-1, columns of the T edited tokens,
    each row renormalised over them, summed over rows, heads and layers first_layer.."""
    rows = attn[first_layer:, :, start:start + W, :T]
    return (rows / rows.sum(-1, keepdim=True)).sum(dim=(0, 1, 2))


@pytest.mark.parametrize("T,W", [(32, 16), (48, 16), (32, 24), (40, 1)],
                         ids=["window-after-kv", "window-inside-kv", "straddling", "last-row"])
@pytest.mark.parametrize("from_layer", [0.0, 0.5])
def test_scores_equal_transformers_attention(tiny_run, T, W, from_layer):
    P, lay = tiny_run["P"], tiny_run["layout"]
    start = P - W
    first = int(from_layer * lay.num_layers)
    kv = torch.stack([tiny_run["keys"][:, :T], torch.zeros_like(tiny_run["keys"][:, :T])])
    q = tiny_run["queries"][:, start:]
    ref = reference_scores(tiny_run["attn"], T, start, W, first)
    got = window_attention(kv, Window(q, start), lay.head_dim,
                           layers=range(first, lay.num_layers))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # The policy's scores: the same, pooled (kernel 5, as kvpress), window tokens kept.
    pooled = F.avg_pool1d(ref[None, None], 5, stride=1, padding=2, count_include_pad=False)[0, 0]
    pooled[start:T] = float("inf")
    w = check_window("SnapKV", kv, q, start, lay.head_dim)
    snap = SnapKV(0.5, granularity="token", span=1, from_layer=from_layer)
    torch.testing.assert_close(snap.token_scores(kv, lay, w), pooled, rtol=1e-4, atol=1e-5)
    # TOVA: the last row only.
    last = reference_scores(tiny_run["attn"], T, P - 1, 1, first)
    last[P - 1:T] = float("inf")
    tova = TOVA(0.5, granularity="token", span=1, from_layer=from_layer)
    torch.testing.assert_close(tova.token_scores(kv, lay, w), last, rtol=1e-4, atol=1e-5)


def naive_max_heads(kv, queries, start):
    """Loop reference for heads="max": per layer and row, the largest attention any query
    head pays a token, summed over rows and layers."""
    T = kv.shape[2]
    total = torch.zeros(T, dtype=torch.float64)
    for layer in range(kv.shape[1]):
        k = kv[0, layer].double().view(T, HKV, HD)
        q = queries[layer].double().view(queries.shape[1], HQ, HD)
        for r in range(q.shape[0]):
            seen = min(T, start + r + 1)
            best = torch.zeros(T, dtype=torch.float64)
            for h in range(HQ):
                p = (k[:seen, h // GROUP] @ q[r, h] / math.sqrt(HD)).softmax(0)
                best[:seen] = torch.maximum(best[:seen], p)
            total += best
    return total.float()


@pytest.mark.parametrize("start", [20, 17])
def test_window_attention_max_over_heads(start):
    T, W = 20, 4
    kv, q = rand(2, L, T, HKV * HD, seed=11), rand(L, W, HQ * HD, seed=12) * 2
    got = window_attention(kv, Window(q, start), HD, heads="max", block_bytes=1)
    torch.testing.assert_close(got, naive_max_heads(kv, q, start), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="heads must be"):
        window_attention(kv, Window(q, start), HD, heads="mean")


def test_max_over_heads_lets_one_head_win():
    """One query head of six points at token 3; the other five agree on token 12. Summed,
    token 12 wins; by the best head, token 3 (the retrieval head) is worth as much."""
    T, W = 16, 1
    kv = rand(2, L, T, HKV * HD, seed=13) * 0.01
    a, b = torch.zeros(HD), torch.zeros(HD)
    a[0], b[1] = 1.0, 1.0
    kv[0, :, 3, :HD] = a * 10
    kv[0, :, 12, :HD], kv[0, :, 12, HD:] = b * 10, b * 10
    q = torch.zeros(L, W, HQ, HD)
    q[:, :, 0] = a * 10      # one head of group 0 looks for token 3
    q[:, :, 1:] = b * 10     # the five others look for token 12
    q = q.view(L, W, HQ * HD)
    summed = window_attention(kv, Window(q, T), HD)
    best = window_attention(kv, Window(q, T), HD, heads="max")
    assert summed[12] > 3 * summed[3]
    assert best[3] == pytest.approx(best[12].item(), rel=0.05)
    kept = SnapKV(15 / 16, granularity="token", span=1, kernel=1, heads="max").keep_indices(
        kv, LAYOUT, queries=q)
    assert set(kept.tolist()) in ({3}, {12})


def test_sink_keeps_the_first_tokens():
    T, W = 32, 4
    kv = rand(2, L, T, HKV * HD, seed=14) * 0.1
    direction = rand(HD, seed=15)
    kv[0, :, 20] = direction.repeat(HKV) * 3
    q = direction.repeat(L, W, HQ, 1).reshape(L, W, HQ * HD)
    for cls in (SnapKV, TOVA):
        plain = cls(0.75, granularity="token", span=1).keep_indices(kv, LAYOUT, queries=q)
        plain = plain.tolist()
        sunk = cls(0.75, granularity="token", span=1, sink=5).keep_indices(kv, LAYOUT,
                                                                           queries=q)
        assert set(range(5)) <= set(sunk.tolist()) and 20 in sunk.tolist()
        assert len(sunk) == len(plain) == 8 and not set(range(5)) <= set(plain)
    with pytest.raises(ValueError, match="sink >= 0"):
        SnapKV(0.5, sink=-1)
    with pytest.raises(ValueError, match="heads 'sum' or 'max'"):
        TOVA(0.5, heads="mean")
    # TOVA may pool (kernel > 1) but still scores with the last row only.
    assert TOVA(0.5, kernel=5).kernel == 5


def test_max_pool_keeps_the_whole_neighbourhood_of_a_peak():
    """Average pooling of a sharp peak can lose the peak's far neighbours to a broad bump;
    max pooling gives every token within kernel // 2 of the peak the peak's score."""
    T, W = 32, 2
    kv = rand(2, L, T, HKV * HD, seed=16) * 0.1
    direction = rand(HD, seed=17)
    kv[0, :, 10] = direction.repeat(HKV) * 4
    q = direction.repeat(L, W, HQ, 1).reshape(L, W, HQ * HD)
    pol = SnapKV(0.5, granularity="token", span=1, kernel=5, pool="max")
    w = Window(q, T)
    raw = SnapKV(0.5, kernel=1, span=1).token_scores(kv, LAYOUT, w)
    pooled = pol.token_scores(kv, LAYOUT, w)
    torch.testing.assert_close(pooled[8:13], raw[10].expand(5))
    expect = torch.stack([raw[max(0, i - 2):i + 3].max() for i in range(T)])
    torch.testing.assert_close(pooled, expect)
    assert {8, 9, 10, 11, 12} <= set(pol.keep_indices(kv, LAYOUT, queries=q).tolist())
    with pytest.raises(ValueError, match="pool must be"):
        TOVA(0.5, pool="min")


def test_span_scores_are_the_span_means_aligned_after_the_sink():
    from kvedit.edits.query_policies import span_scores

    s = torch.tensor([1., 2., 3., 10., 0., 0., 0., 4., 4., 9.])
    # start 2: [0, 1] is one span, then [2..5], [6..9].
    torch.testing.assert_close(span_scores(s, 4, start=2),
                               torch.tensor([1.5] * 2 + [3.25] * 4 + [4.25] * 4))
    # A short last span is the mean of what it has, not a sum diluted by missing tokens.
    torch.testing.assert_close(span_scores(s, 4), torch.tensor([4.] * 4 + [1.] * 4 + [6.5] * 2))
    torch.testing.assert_close(span_scores(s, 1), s)


def test_span_keeps_whole_spans_around_the_peak_and_the_exact_budget():
    """A peak token (the queries point at it) inside span [8, 12): token scoring keeps the
    peak and a few scattered tokens; span=4 keeps the peak's whole span, still T/2 tokens."""
    T, W = 32, 2
    kv = rand(2, L, T, HKV * HD, seed=18) * 0.1
    direction = rand(HD, seed=19)
    kv[0, :, 9] = direction.repeat(HKV) * 4
    q = direction.repeat(L, W, HQ, 1).reshape(L, W, HQ * HD)
    plain = TOVA(0.875, granularity="token", span=1).keep_indices(kv, LAYOUT, queries=q)
    plain = plain.tolist()
    spans = TOVA(0.875, granularity="token", span=4).keep_indices(kv, LAYOUT, queries=q)
    assert 9 in plain and set(plain) != {8, 9, 10, 11}
    assert spans.tolist() == [8, 9, 10, 11]
    # With a sink, spans start after it: sink 2 -> spans [2, 6), [6, 10), [10, 14) ...
    sunk = SnapKV(0.75, granularity="token", kernel=1, span=4, sink=2).keep_indices(
        kv, LAYOUT, queries=q).tolist()
    assert len(sunk) == 8 and sunk[:2] == [0, 1] and {6, 7, 8, 9} <= set(sunk)
    with pytest.raises(ValueError, match="span > 0"):
        TOVA(0.5, span=0)
    assert SnapKV().span == TOVA().span == 10  # the ChunkKV paper's chunk size, by default

"""KVzip's scores: the largest attention a key receives from the reconstruction pass.

References: a loop over layers, KV heads, their query heads and the rows (synthetic
tensors), and transformers' own eager attention weights on the tiny Qwen3 in float32 for the
prompt `context + repeat prompt + context` (rows of the repeated part, columns of the
context, each row renormalised over the context as kvedit's window attention does), with
the queries read from the same forward (q_proj -> q_norm -> RoPE, as vLLM captures them).
"""
from __future__ import annotations

import math

import pytest
import torch

from kvedit.edits import KVzip
from kvedit.edits.attention import check_window
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD = 3, 2, 3, 8
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=4, rope=RopeParams(theta=10000.0))


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def loop_max_attention(kv, queries, start):
    """[L, HKV, T] float64: per layer and KV head, the largest softmax weight any row and
    any query head of the head's group gives each key (rows see keys up to their position)."""
    T = kv.shape[2]
    out = torch.zeros(kv.shape[1], HKV, T, dtype=torch.float64)
    for layer in range(kv.shape[1]):
        k = kv[0, layer].double().view(T, HKV, HD)
        q = queries[layer].double().view(queries.shape[1], HKV * GROUP, HD)
        for h in range(HKV * GROUP):
            for r in range(q.shape[0]):
                seen = min(T, start + r + 1)
                p = (k[:seen, h // GROUP] @ q[r, h] / math.sqrt(HD)).softmax(0)
                out[layer, h // GROUP, :seen] = torch.maximum(out[layer, h // GROUP, :seen], p)
    return out


@pytest.mark.parametrize("start", [16, 30])
def test_per_head_scores_are_the_largest_attention_of_any_row_and_group_head(start):
    T, W = 16, 7
    kv, q = rand(2, L, T, HKV * HD, seed=1), rand(L, W, HKV * GROUP * HD, seed=2) * 2
    w = check_window("KVzip", kv, q, start, HD)
    got = KVzip(0.5, granularity="token", per_head=True, sink=0).token_scores(kv, LAYOUT, w)
    ref = loop_max_attention(kv, q, start)
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-6)
    # one decision per token: the mean over layers and heads
    flat = KVzip(0.5, granularity="token", sink=0).token_scores(kv, LAYOUT, w)
    torch.testing.assert_close(flat, ref.mean(dim=(0, 1)).float(), rtol=1e-5, atol=1e-6)


def test_keeps_each_heads_most_attended_keys_and_the_sinks_in_every_head():
    T, W = 24, 5
    kv, q = rand(2, L, T, HKV * HD, seed=3), rand(L, W, HKV * GROUP * HD, seed=4) * 3
    idx = KVzip(0.5, granularity="token", per_head=True, sink=2).keep_indices(
        kv, LAYOUT, queries=q, query_start=T)
    assert idx.shape == (L, HKV, 12)
    ref = loop_max_attention(kv, q, T)
    ref[..., :2] = math.inf
    for layer in range(L):
        for h in range(HKV):
            want = sorted(sorted(range(T), key=lambda t: (-ref[layer, h, t], t))[:12])
            assert idx[layer, h].tolist() == want
            assert {0, 1} <= set(idx[layer, h].tolist())
    assert KVzip.needs_queries and KVzip.needs_reconstruction


def test_bad_options_and_missing_queries():
    with pytest.raises(ValueError, match="sink >= 0 and span > 0"):
        KVzip(0.5, sink=-1)
    with pytest.raises(ValueError, match="captured queries and got none"):
        KVzip(0.5, granularity="token").keep_indices(rand(2, L, 8, HKV * HD), LAYOUT)


# -- against transformers' attention weights (tiny Qwen3, float32) -------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reconstruction():
    """One float32 forward of the tiny Qwen3 over context + repeat + context[start:]."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from kvedit.harness.tiny_model import default_tiny_model

    model = AutoModelForCausalLM.from_pretrained(default_tiny_model(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    T, start = 40, 6
    context = torch.randint(0, cfg.vocab_size, (T,), generator=gen).tolist()
    repeat = torch.randint(0, cfg.vocab_size, (5,), generator=gen).tolist()
    ids = context + repeat + context[start:]
    queries = []

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"]
        q = module.q_norm(module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim))
        cos, sin = kwargs["position_embeddings"]
        q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        queries.append(q[0].transpose(0, 1).reshape(len(ids), -1)[T:])  # the window rows

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    n = cfg.num_hidden_layers
    keys = torch.stack([out.past_key_values.layers[i].keys[0, :, :T].transpose(0, 1)
                        .reshape(T, -1) for i in range(n)])
    layout = ModelLayout(num_layers=n, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, dtype="float32", chunk_size=16,
                         rope=RopeParams(theta=cfg.rope_parameters["rope_theta"]))
    return {"kv": torch.stack([keys, torch.zeros_like(keys)]), "queries": torch.stack(queries),
            "attn": torch.stack([a[0] for a in out.attentions]), "T": T, "layout": layout,
            "group": cfg.num_attention_heads // cfg.num_key_value_heads}


def test_scores_equal_transformers_attention_over_the_context(reconstruction):
    r = reconstruction
    T, lay, g = r["T"], r["layout"], r["group"]
    rows = r["attn"][:, :, T:, :T]                              # [L, Hq, W, T]
    rows = rows / rows.sum(-1, keepdim=True)                    # renormalised over the context
    n, hq = rows.shape[:2]
    ref = rows.view(n, hq // g, g, -1, T).amax(dim=(2, 3))      # [L, Hkv, T]
    w = check_window("KVzip", r["kv"], r["queries"], T, lay.head_dim)
    got = KVzip(0.5, granularity="token", per_head=True, sink=0).token_scores(r["kv"], lay, w)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    flat = KVzip(0.5, granularity="token", sink=0).token_scores(r["kv"], lay, w)
    torch.testing.assert_close(flat, ref.mean(dim=(0, 1)), rtol=1e-4, atol=1e-6)


def test_reconstruction_passes_in_flight_stay_under_the_capture_budget():
    """The connector captures at most max_capture_bytes of queries at once and a request past
    it gets none, so reconstruct runs only as many passes at once as fit in capture_bytes."""
    from types import SimpleNamespace

    from kvedit.layout import ModelLayout
    from kvedit.sdk.kvzip import _in_flight

    lay = ModelLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16",
                      chunk_size=128, num_q_heads=9)          # SmolLM2-135M
    ctx = SimpleNamespace(chunk_size=128, layouts=(lay,))
    streams = [SimpleNamespace(ctx=ctx, prompt=list(range(640)), kv_tokens=640,
                               label=f"s{i}") for i in range(120)]
    repeat = list(range(10))
    row = 30 * 9 * 64 * 2
    per_pass = 650 * row                                     # window: 10 + 640 rows
    assert _in_flight(streams, repeat, 0, 1 << 30) == (1 << 30) // per_pass   # 47
    assert _in_flight(streams, repeat, 0, 512 << 20) == (512 << 20) // per_pass
    assert _in_flight(streams, repeat, 0, 1) == 1              # always at least one
    assert _in_flight([], repeat, 0, 1 << 30) == 1

"""Per-head edits on the host path through the real vLLM (tiny Qwen3, float32): each (layer,
KV head) keeps its own tokens, the SDK stores them under stand-in ids and a fresh salt, vLLM
loads them and decodes.

Reference: transformers on the same model in float32, with a cache holding, per layer and
KV head, exactly the kept tokens' keys and values, the keys rotated to their new positions
by transformers' own rotary embedding (from the pre-RoPE keys), then the tokens vLLM
computes (the recomputed partial chunk and the rest of the prompt) and greedy decoding.
vLLM's greedy tokens must be the reference's and its logprobs equal to within float32
kernel differences. Also: heads keeping different counts are refused, naming the stream,
with the original KV kept.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from kvedit.edits import KeyNorm
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256
N_OUT = 6


def distinct_tokens(n: int, seed: int) -> list[int]:
    """n different token ids: a kept id names its position."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(7990, generator=g)[:n] + 10).tolist()


class Recording:
    """The policy as the edit fn, remembering what each head kept."""

    def __init__(self, policy):
        self.policy, self.ids = policy, None

    def __call__(self, kv, tokens, layout=None):
        out, ids = self.policy(kv, tokens, layout)
        self.ids = ids
        return out, ids


def reference(model_dir, prompt, region, kept, n_out, positions):
    """(greedy tokens, their logprobs) of transformers with the cache holding, per (layer,
    head), the whole chunks' worth of the `kept` [L, H, K] positions of the region, each
    head's re-rotated to 0..; then the rest of `prompt` (the partial chunk's tokens, which
    vLLM recomputes, and what follows the region) fed after them."""
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pre = []

    def grab(attn, args, kwargs, output):  # pre-RoPE keys of the region: k_norm(k_proj(h))
        h = kwargs["hidden_states"]
        k = attn.k_norm(attn.k_proj(h).view(*h.shape[:-1], -1, attn.head_dim))
        pre.append(k[0].transpose(0, 1))  # [H, T, d]

    hooks = [layer.self_attn.register_forward_hook(grab, with_kwargs=True)
             for layer in model.model.layers]
    with torch.no_grad():
        try:
            out = model(torch.tensor([prompt[:region]]), use_cache=True)
        finally:
            for h in hooks:
                h.remove()
    full = kept.shape[-1] // C * C  # slots stored as chunks; the rest vLLM recomputes
    cache = DynamicCache()
    for layer, k_pre in enumerate(pre):
        idx = kept[layer, :, :full]                                      # [H, full]
        k = torch.stack([k_pre[h, idx[h]] for h in range(idx.shape[0])])[None]
        # compact: slot j at position j; logical: each key back by the number dropped
        pos = torch.arange(full).expand_as(idx) if positions == "compact" \
            else idx - (region - kept.shape[-1])
        cos, sin = model.model.rotary_emb(k, pos)                        # [H, full, d]
        k = k * cos[None] + rotate_half(k) * sin[None]
        v_all = out.past_key_values.layers[layer].values[0]              # [H, T, d]
        v = torch.stack([v_all[h, idx[h]] for h in range(idx.shape[0])])[None]
        cache.update(k, v, layer)
    feed = prompt[region - (kept.shape[-1] - full):]  # recomputed tail + the prompt's rest
    tokens, lps, position = [], [], full
    with torch.no_grad():
        for _ in range(n_out):
            p = torch.arange(position, position + len(feed))[None]
            logits = model(torch.tensor([feed]), past_key_values=cache, position_ids=p).logits
            logp = logits[0, -1].log_softmax(-1)
            t = int(logp.argmax())
            tokens.append(t)
            lps.append(float(logp[t]))
            position += len(feed)
            feed = [t]
    return tokens, lps


@pytest.mark.parametrize("positions", ["compact", "logical"])
def test_decode_after_a_per_head_edit_equals_transformers_over_the_same_kept_keys(
        ctx, post, tiny_model, positions):
    prompt = distinct_tokens(2 * C + 40, 1 + (positions == "logical"))
    s = create_request(ctx, post, prompt, f"ph-{uuid.uuid4().hex[:8]}")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    # 512 -> 300 kept: one whole chunk and 44 slots vLLM recomputes (the same in every head)
    fn = Recording(KeyNorm(212 / 512, granularity="token", per_head=True, positions=positions))
    m = batch.modify(fn)
    assert fn.ids.shape == (ctx.layout.num_layers, ctx.layout.num_kv_heads, 300)
    position = {t: i for i, t in enumerate(prompt)}
    kept = torch.tensor([[[position[t] for t in row] for row in layer] for layer in
                         fn.ids.tolist()])
    assert not all(torch.equal(kept[0, 0], kept[la, h]) for la in range(kept.shape[0])
                   for h in range(kept.shape[1])), "the heads should keep different tokens"
    assert (kept[..., C:] == torch.arange(512 - 44, 512)).all()  # the tail, in every head
    assert m.salt_changes == 1 and m.tokens_after == C  # stored under a fresh salt
    assert len(s.tokens) == C and s.suffix[:44] == prompt[512 - 44:512]
    first = s.output_token_ids[0]  # the prefill's token, re-sent after the prompt
    batch.decode({**GREEDY, "max_tokens": N_OUT})
    want, want_lp = reference(tiny_model, prompt + [first], 2 * C, kept, N_OUT, positions)
    assert s.output_token_ids[1:] == want
    got_lp = s.logprobs[-N_OUT:]
    assert all(lp is not None for lp in got_lp)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=2e-3,
                               rtol=0)


def test_heads_keeping_different_counts_are_refused_and_the_original_kept(ctx, post):
    prompt = distinct_tokens(C + 10, 2)
    s = create_request(ctx, post, prompt, f"ph-{uuid.uuid4().hex[:8]}", name="ragged")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    keys, salt = list(s.keys), s.cache_salt

    def ragged(kv, tokens):
        ids = [[list(tokens[:200]) for _ in range(kv.shape[3] // 64)]
               for _ in range(kv.shape[1])]
        ids[1][0] = ids[1][0][:199]  # layer 1, head 0 keeps one token fewer
        return kv[:, :, :200].clone(), ids

    with pytest.raises(ModifyError, match=r"ragged.*keeps 199 tokens in layer 1, KV head 0 "
                                          r"but 200 in layer 0, KV head 0"):
        batch.modify(ragged)
    assert (s.tokens, s.keys, s.cache_salt) == (prompt, keys, salt)
    assert ctx.client.lookup(ctx.model, keys) == 1  # the original chunk is still there
    batch.decode({**GREEDY, "max_tokens": 2})          # and still decodes
    assert len(s.output_token_ids) == 3

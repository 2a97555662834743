"""What transformers computes, for comparing against what kvedit captured inside vLLM."""
from __future__ import annotations

import torch


def qwen3_queries(model_dir):
    """queries(tokens) -> [L, T, Hq*D]: transformers' q_proj -> q_norm -> RoPE per layer of a
    Qwen3 model (the tiny one), float32: the post-RoPE queries vLLM's attention receives."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def queries(tokens: list[int]) -> torch.Tensor:
        got = []

        def grab(attn, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = attn.q_norm(attn.q_proj(h).view(*h.shape[:-1], -1, attn.head_dim))
            q = q.transpose(1, 2)                          # [1, Hq, T, D]
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            got.append(q[0].transpose(0, 1).flatten(1))   # [T, Hq*D]

        hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True)
                 for layer in model.model.layers]
        try:
            with torch.no_grad():
                model(torch.tensor([tokens]))
        finally:
            for h in hooks:
                h.remove()
        return torch.stack(got)

    return queries


def decode_over_kept(model_dir, prompt: list[int], keep: torch.Tensor, positions: str,
                     n: int) -> tuple[list[int], list[float]]:
    """Greedy decode in transformers (float32) after keeping, of the prompt's KV, only the
    tokens `keep` ([K], or [L, Hkv, K] per layer and KV head): the prompt's greedy token
    first, then n more. positions "logical": kept keys keep their RoPE and new tokens run at
    their true positions (len(prompt), ...); "compact": kept keys re-rotated to 0..K-1 and new
    tokens at K, K+1, ... Returns (tokens, their logprobs), n + 1 of each."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvedit.edits.rope import rotate_keys

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    rope = _rope(cfg)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    full = out.past_key_values
    logp = out.logits[0, -1].log_softmax(-1)
    tok = int(logp.argmax())
    tokens, lps = [tok], [float(logp[tok])]
    L = cfg.num_hidden_layers
    kept = DynamicCache()
    for layer in range(L):
        k, v = full.layers[layer].keys, full.layers[layer].values   # [1, Hkv, T, D]
        idx = keep if keep.dim() == 1 else keep[layer]
        idx = idx.expand(k.shape[1], -1) if idx.dim() == 1 else idx  # [Hkv, K]
        gi = idx[None, :, :, None].expand(1, -1, -1, k.shape[-1])
        k, v = k.gather(2, gi).clone(), v.gather(2, gi).clone()
        if positions == "compact":
            delta = torch.arange(idx.shape[1])[None, :] - idx         # [Hkv, K]
            flat = k[0].transpose(0, 1).reshape(1, idx.shape[1], -1)  # [1, K, Hkv*D]
            rotate_keys(flat, delta.T[None], rope, k.shape[-1])
            k = flat.view(idx.shape[1], k.shape[1], -1).transpose(0, 1)[None]
        kept.update(k, v, layer)
    K = keep.shape[-1]
    pos = len(prompt) if positions == "logical" else K
    with torch.no_grad():
        for i in range(n):
            out = model(torch.tensor([[tok]]), past_key_values=kept,
                        position_ids=torch.tensor([[pos + i]]),
                        cache_position=torch.tensor([K + i]))
            logp = out.logits[0, -1].log_softmax(-1)
            tok = int(logp.argmax())
            tokens.append(tok)
            lps.append(float(logp[tok]))
    return tokens, lps


def _rope(cfg):
    from kvedit.vllm.settings import rope_params

    return rope_params(cfg, cfg.head_dim)

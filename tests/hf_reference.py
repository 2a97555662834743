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

"""A per-head selection applied to a request's KV: each (layer, KV head) keeps its own tokens.

`keep_indices` of a `per_head` policy is `[L, H_kv, T']` (sorted rows, one count); `gather`
builds the edited `[2, L, T', D]` from it, slot t of (layer l, head h) holding token
`idx[l, h, t]`, and `compact_shift` is the RoPE shift that moves each head's kept keys to
the contiguous positions 0..T'-1 vLLM will count them at (`rope.rotate_keys` takes a shift
per head).
"""
from __future__ import annotations

import torch


def gather(kv: torch.Tensor, idx: torch.Tensor, head_dim: int) -> torch.Tensor:
    """kv [2, L, T, H*head_dim] and idx [L, H, T'] -> [2, L, T', H*head_dim] (a new tensor)."""
    two, L, T, D = kv.shape
    H, Tk = D // head_dim, idx.shape[-1]
    if idx.shape[:2] != (L, H):
        raise ValueError(f"per-head indices must be [L={L}, H_kv={H}, T'], got "
                         f"{tuple(idx.shape)}")
    at = idx.transpose(1, 2)                                   # [L, T', H]
    at = at[None, :, :, :, None].expand(two, L, Tk, H, head_dim)
    return kv.view(two, L, T, H, head_dim).gather(2, at).reshape(two, L, Tk, D)


def compact_shift(idx: torch.Tensor) -> torch.Tensor:
    """[L, T', H]: slot t's new position t minus its token's old position, per head."""
    slots = torch.arange(idx.shape[-1], device=idx.device)
    return slots[None, :, None] - idx.transpose(1, 2)

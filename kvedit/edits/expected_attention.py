"""Expected Attention (Devoto et al. 2025, kvpress's ExpectedAttentionPress): query-agnostic
scores from the statistics of the context's own queries.

A cache meant for questions not yet asked cannot be scored with their queries, but the
queries a model produces over a context follow a distribution it can estimate: the mean and
covariance of the context's (pre-RoPE) queries, per layer and query head, rotated by the
average rotation of the positions still to come (the next `n_future` after the context). A
key's expected attention logit under a Gaussian query is `k.mu/sqrt(d) + k^T S k/(2d)`
(the log of E[exp(q.k/sqrt(d))]); softmax over the context's keys, averaged over each KV
head's group of query heads and multiplied by the value's norm (a key that is attended but
writes a small value matters less), gives the score.

The queries are those of the edited context itself, captured by a pass over the context
alone (`kvedit.sdk.context_pass`, `queries_from = "context"`): rows at prompt positions
inside the edited tokens. Rows at or after the edited tokens (a question that follows the
context) are never used, so the score is query-agnostic by construction. Captured queries
carry RoPE at their positions; they are un-rotated (`rope.rotate_keys` by minus the
position) before their statistics are taken, as kvpress takes them before RoPE.

Aggregation: per (layer, KV head) with `per_head=True` (kvpress); otherwise each (layer,
head)'s scores are made a distribution over the tokens (sum 1) and averaged, so no layer
dominates by its values' magnitude. The first `sink` tokens are always kept (kvpress: 4;
the eval passes the prompt's header) and are left out of the softmax, as kvpress does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvedit.edits.attention import Window
from kvedit.edits.base import DropPolicy
from kvedit.edits.rope import mean_rotation, rotate_keys
from kvedit.layout import ModelLayout

INF = float("inf")


def query_stats(window: Window, num_tokens: int, layout: ModelLayout, skip: int,
                who: str = "ExpectedAttention") -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [L, Hq, d], covariance [L, Hq, d, d]) of the pre-RoPE queries of the window's
    rows at positions in [skip, num_tokens), float32."""
    if layout.rope is None:
        raise ValueError(f"{who} un-rotates the captured queries and needs layout.rope")
    d = layout.head_dim
    pos = window.start + torch.arange(window.rows, device=window.queries.device)
    inside = (pos >= skip) & (pos < num_tokens)
    if not bool(inside.any()):
        raise ValueError(
            f"{who} scores with the queries of the context itself and got none inside it: "
            f"the {window.rows} captured rows sit at positions {window.start}.."
            f"{window.start + window.rows - 1}, the edited context is positions "
            f"{skip}..{num_tokens - 1} (after the {skip} sink tokens). Capture the context's "
            f"last rows with kvedit.sdk.context_pass.capture_context (a question's rows are "
            f"after the context and are never used)")
    q = window.queries[:, inside].to(torch.float32, copy=True)          # [L, n, Hq*d]
    rotate_keys(q, -pos[inside], layout.rope, d)                        # to position 0
    L, n = q.shape[:2]
    q = q.view(L, n, -1, d).transpose(1, 2)                              # [L, Hq, n, d]
    mu = q.mean(dim=2)
    centred = q - mu[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / n                        # [L, Hq, d, d]
    return mu, cov


@dataclass
class ExpectedAttention(DropPolicy):
    """Keep the keys the context's own queries are expected to attend to (module
    docstring). Needs the context's captured queries: `kvedit.sdk.context_pass`."""
    sink: int = 4
    n_future: int = 512      # positions after the context the rotation is averaged over
    covariance: bool = True  # the k^T S k term (False: the mean query alone)
    vnorm: bool = True       # multiply by the value's norm
    epsilon: float = 0.0     # added to the attention before the value norm (kvpress)
    needs_queries: ClassVar[bool] = True
    queries_from: ClassVar[str | None] = "context"

    def __post_init__(self):
        super().__post_init__()
        if self.sink < 0 or self.n_future <= 0 or self.epsilon < 0:
            raise ValueError(f"ExpectedAttention needs sink >= 0, n_future > 0 and epsilon "
                             f">= 0, got sink={self.sink}, n_future={self.n_future}, "
                             f"epsilon={self.epsilon}")

    def head_scores(self, kv: torch.Tensor, layout: ModelLayout, window: Window) -> torch.Tensor:
        """[L, Hkv, T] float32 per (layer, KV head); the sink tokens inf."""
        L, T, hidden = kv.shape[1:]
        d = layout.head_dim
        hkv = hidden // d
        sink = min(self.sink, T - 1)
        mu, cov = query_stats(window, T, layout, sink)
        R = mean_rotation(layout.rope, d, T, self.n_future).to(mu.device)
        mu = mu @ R.T
        cov = R @ cov @ R.T if self.covariance else None
        group = mu.shape[1] // hkv
        out = torch.full((L, hkv, T), INF, device=kv.device)
        for l in range(L):
            k = kv[0, l, sink:].float().view(T - sink, hkv, d).transpose(0, 1)   # [Hkv, t, d]
            m = mu[l].view(hkv, group, d)
            logits = (k @ m.transpose(-1, -2)).transpose(-1, -2) / math.sqrt(d)  # [Hkv, g, t]
            if cov is not None:
                c = cov[l].view(hkv, group, d, d)
                kc = torch.einsum("htd,hgde->hgte", k, c)
                logits = logits + (kc * k[:, None]).sum(-1) / d / 2
            att = logits.softmax(dim=-1).mean(dim=1)                             # [Hkv, t]
            if self.vnorm:
                v = kv[1, l, sink:].float().view(T - sink, hkv, d).transpose(0, 1)
                att = (att + self.epsilon) * v.norm(dim=-1)
            out[l, :, sink:] = att
        return out

    def score_window(self, kv, units, layout, window):
        s = self.head_scores(kv, layout, window)
        if not self.per_head:
            sink = min(self.sink, s.shape[-1] - 1)
            part = s[..., sink:]
            part = part / part.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            s = torch.cat([s[0, 0, :sink], part.mean(dim=(0, 1))])
        return units.pool(s)

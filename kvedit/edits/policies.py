"""Token-dropping policies: each is the shared `DropPolicy` machinery plus one `score` method.

Use one as the SDK's edit function: `batch.modify(DropMiddle(0.5))`. Every policy keeps the
order of the kept tokens and re-rotates their keys to contiguous positions by default
(`rerotate=False` skips it); `granularity="chunk"` (default) or `"token"`.

By default one decision per token for all layers and heads: vLLM's paged cache keeps a
token's K/V for every layer and KV head in one slot. A policy that scores per (layer, head)
says in its docstring how it folds those scores into one per token: KeyNorm averages key
norms, KeyDiff cosines, LeverageScore per-head z-scores, SnapKVProxy sums attention
probabilities over layers, heads and proxy queries. With `per_head=True` those four skip the
fold and return their scores per (layer, KV head), `[L, H_kv, units]`, so each head keeps
its own tokens (equal counts; `base.py`). RandomDrop draws per head too; the positional
policies (DropMiddle, UniformDrop, StreamingLLM) score by position alone and keep the same
tokens in every head. The query-aware policies (real SnapKV, TOVA) are in
`query_policies.py`. A chunk's score is the mean of its tokens' (`Units.pool`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvedit.edits.base import DropPolicy, Units
from kvedit.edits.rope import rotate_keys
from kvedit.layout import ModelLayout

INF = float("inf")


def _mask(count: int, keep: torch.Tensor) -> torch.Tensor:
    """Scores that keep exactly the units in `keep` (1) and drop the rest (0)."""
    s = torch.zeros(count)
    s[keep] = 1.0
    return s


def _heads(kv: torch.Tensor, layout: ModelLayout | None, who: str) -> torch.Tensor:
    """Keys as [L, T, H, head_dim] (a view); head_dim comes from the layout."""
    if layout is None:
        raise ValueError(f"{who} scores per attention head and needs the model layout "
                         "(head_dim): run it through the SDK or pass layout=...")
    L, T, D = kv.shape[1:]
    return kv[0].view(L, T, D // layout.head_dim, layout.head_dim)


@dataclass
class DropMiddle(DropPolicy):
    """Keep the first and last units, drop one contiguous run of units centred in between
    (the LMCache SDK example: drop the middle half of the chunks)."""
    reads_kv: ClassVar[bool] = False

    def num_drop(self, units: Units) -> int:
        drop = super().num_drop(units)
        if drop > units.count - 2:
            raise ValueError(
                f"DropMiddle keeps the first and last {self.granularity}: {units.tokens} tokens "
                f"make {units.count} units, too few to drop {drop} (ratio {self.ratio}); "
                f"need at least {drop + 2}")
        return drop

    def score(self, kv, units, layout):
        drop = self.num_drop(units)
        start = (units.count - drop) // 2  # >= 1 and start + drop <= count - 1
        keep = torch.cat([torch.arange(start), torch.arange(start + drop, units.count)])
        return _mask(units.count, keep)


@dataclass
class UniformDrop(DropPolicy):
    """Keep evenly spaced units (first and last included), drop the ones between them."""
    reads_kv: ClassVar[bool] = False

    def score(self, kv, units, layout):
        n_keep = units.count - self.num_drop(units)
        if n_keep == 1:
            return _mask(units.count, torch.tensor([0]))
        # Picks are >= 1 apart, so rounding them gives distinct units.
        picks = torch.floor(torch.linspace(0, units.count - 1, n_keep, dtype=torch.float64) + 0.5)
        return _mask(units.count, picks.long())


@dataclass
class StreamingLLM(DropPolicy):
    """Attention sinks + a recent window (Xiao et al. 2023). `sink` is in tokens (rounded up
    to whole units); the window is `window` tokens if given, else whatever `ratio` leaves."""
    reads_kv: ClassVar[bool] = False
    sink: int = 4
    window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.sink < 0 or (self.window is not None and self.window <= 0):
            raise ValueError(f"StreamingLLM needs sink >= 0 and window > 0, got sink={self.sink}, "
                             f"window={self.window}")

    def _sink_units(self, units: Units) -> int:
        return -(-self.sink // units.size)

    def num_drop(self, units: Units) -> int:
        sinks = self._sink_units(units)
        if self.window is not None:  # fixed window: short inputs are kept whole
            return max(0, units.count - sinks - -(-self.window // units.size))
        drop = super().num_drop(units)
        if drop > units.count - sinks - 1:
            raise ValueError(
                f"StreamingLLM: {units.tokens} tokens make {units.count} units; keeping "
                f"{sinks} sink unit(s) and a non-empty window leaves fewer than the {drop} "
                f"to drop (ratio {self.ratio})")
        return drop

    def score(self, kv, units, layout):
        s = torch.arange(units.count, dtype=torch.float32)  # recent = higher
        s[: self._sink_units(units)] = INF
        return s


@dataclass
class KeyNorm(DropPolicy):
    """kvpress's KnormPress: keys with a low L2 norm draw more attention, keep those. The
    per-token score is minus the key norm averaged over layers and heads (rotation-invariant,
    so it does not matter that the keys carry RoPE); per_head: minus each head's key norm."""

    def score(self, kv, units, layout):
        k = _heads(kv, layout, "KeyNorm")
        norms = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)  # [L, T, H]
        if self.per_head:
            return units.pool(-norms.permute(0, 2, 1))                     # [L, H, units]
        return units.pool(-norms.mean(dim=(0, 2)))


@dataclass
class SnapKVProxy(DropPolicy):
    """SnapKV (Li et al. 2024) without queries: the keys of the last `window` edited tokens
    serve as proxy queries (no capture needed; the real SnapKV is `query_policies.SnapKV`).
    A token's score is the softmax attention it gets from them, averaged over layers, heads
    and window, smoothed by average pooling (`kernel`). The window is kept. per_head: the
    attention each (layer, head) pays, summed over the window only."""
    window: int = 64
    kernel: int = 5
    # Temporary float32 attention memory per block of layers.
    block_bytes: int = 256 << 20

    def __post_init__(self):
        super().__post_init__()
        if self.window <= 0 or self.kernel <= 0 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKVProxy needs window > 0 and an odd kernel > 0, got "
                             f"window={self.window}, kernel={self.kernel}")

    def token_scores(self, kv: torch.Tensor, layout: ModelLayout | None) -> torch.Tensor:
        """[T] float32 (per_head: [L, H, T]); the window's own tokens inf."""
        k = _heads(kv, layout, "SnapKVProxy")  # [L, T, H, d]
        L, T, H, d = k.shape
        w = min(self.window, T)
        # Causal: proxy query i (position T - w + i) sees tokens up to its own position.
        pos = torch.arange(T, device=kv.device)
        future = pos[None, :] > pos[T - w:, None]  # [w, T]
        total = torch.zeros((L, H, T) if self.per_head else (T,), device=kv.device)
        step = max(1, self.block_bytes // (H * w * T * 4))
        for l0 in range(0, L, step):  # blocks of layers bound the [l, H, w, T] attention
            kb = k[l0: l0 + step].float().transpose(1, 2)  # [l, H, T, d]
            att = kb[:, :, T - w:] @ kb.transpose(-1, -2) / math.sqrt(d)  # [l, H, w, T]
            att = att.masked_fill(future, -INF).softmax(dim=-1)
            if self.per_head:
                total[l0: l0 + step] = att.sum(dim=2)
            else:
                total += att.sum(dim=(0, 1, 2))
        rows = total.reshape(-1, 1, T)
        scores = F.avg_pool1d(rows, self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False).reshape(total.shape)
        scores[..., T - w:] = INF
        return scores

    def score(self, kv, units, layout):
        return units.pool(self.token_scores(kv, layout))


@dataclass
class KeyDiff(DropPolicy):
    """KeyDiff (Park et al. 2025; kvpress's KeyDiffPress): keep the keys least like the
    average key. Per layer and KV head, the anchor is the mean of the request's
    L2-normalised keys and a token's score is minus its key's cosine similarity to that
    anchor; tokens pointing away from the common direction are the distinctive ones.

    Aggregation: one vLLM cache slot holds a token for every layer and head, so the token
    score is the mean of the per-(layer, head) scores (cosines, all on one [-1, 1] scale,
    so no head dominates by magnitude); a chunk's score is the mean over its tokens. The
    keys carry RoPE, as kvpress's do (it scores the cache's rotated keys too). per_head:
    each (layer, head) keeps by its own cosines, as kvpress does."""

    def score(self, kv, units, layout):
        k = _heads(kv, layout, "KeyDiff").float()           # [L, T, H, d]
        unit = F.normalize(k, dim=-1)
        anchor = F.normalize(unit.mean(dim=1, keepdim=True), dim=-1)  # [L, 1, H, d]
        cos = (unit * anchor).sum(dim=-1)                  # [L, T, H]
        if self.per_head:
            return units.pool(-cos.permute(0, 2, 1))         # [L, H, units]
        return units.pool(-cos.mean(dim=(0, 2)))


@dataclass
class LeverageScore(DropPolicy):
    """Statistical leverage of the pre-RoPE keys (Chari & Van Durme 2025, "Compactor";
    kvpress's LeverageScorePress): per layer and KV head, with X the request's keys
    un-rotated to position 0 and centred over the sequence, a token's leverage is
    diag(X (XᵀX)⁻¹ Xᵀ): how far its key lies outside the subspace the other keys fill.
    Keep the high-leverage (geometric outlier) keys. Exact here (head_dim is small), where
    kvpress uses a Gaussian sketch.

    Aggregation: per (layer, head) the leverages are z-scored (so a head with a flat
    spectrum does not drown the others), then averaged over layers and heads into one score
    per token — one vLLM cache slot holds the token for all of them; a chunk's score is the
    mean over its tokens. Un-rotation needs the RoPE parameters (layout.rope). per_head:
    each (layer, head) keeps by its own leverages."""
    jitter: float = 1e-4  # ridge, relative to the Gram matrix's mean diagonal

    def score(self, kv, units, layout):
        k = _heads(kv, layout, "LeverageScore")
        if layout.rope is None:
            raise ValueError("LeverageScore un-rotates the keys and needs layout.rope")
        L, T, H, d = k.shape
        keys = kv[0].to(torch.float32, copy=True)  # rotated below: never the caller's

        # Token i sits at position i (the SDK hands a request's KV in position order).
        rotate_keys(keys, -torch.arange(T), layout.rope, layout.head_dim)
        x = keys.view(L, T, H, d).permute(0, 2, 1, 3)      # [L, H, T, d]
        x = x - x.mean(dim=2, keepdim=True)
        gram = x.transpose(-1, -2) @ x                      # [L, H, d, d]
        ridge = self.jitter * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)
        gram = gram + ridge[..., None, None] * torch.eye(d, device=kv.device)
        solved = torch.linalg.solve(gram, x.transpose(-1, -2))  # (XᵀX)⁻¹Xᵀ: [L, H, d, T]
        lev = (x * solved.transpose(-1, -2)).sum(-1)        # [L, H, T]
        z = (lev - lev.mean(-1, keepdim=True)) / lev.std(-1, keepdim=True).clamp_min(1e-6)
        if self.per_head:
            return units.pool(z)                            # [L, H, units]
        return units.pool(z.mean(dim=(0, 1)))


@dataclass
class RandomDrop(DropPolicy):
    """Drop random units (kvpress's RandomPress): the floor any policy must beat. The same
    `seed` and unit count give the same choice. Same choice for every layer and head (per_head:
    an independent draw per layer and head)."""
    reads_kv: ClassVar[bool] = False
    seed: int = 0

    def score(self, kv, units, layout):
        gen = torch.Generator().manual_seed(self.seed)
        if self.per_head:
            heads = _heads(kv, layout, "RandomDrop").shape[2]
            return torch.rand(kv.shape[1], heads, units.count, generator=gen).to(kv.device)
        return torch.rand(units.count, generator=gen)

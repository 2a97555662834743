"""Token-dropping policies: each is the shared `DropPolicy` machinery plus one `score` method.

Use one as the SDK's edit function: `batch.modify(DropMiddle(0.5))`. Every policy keeps the
order of the kept tokens and re-rotates their keys to contiguous positions by default
(`rerotate=False` skips it); `granularity="chunk"` (default) or `"token"`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvedit.edits.base import DropPolicy, Units
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
    so it does not matter that the keys carry RoPE)."""

    def score(self, kv, units, layout):
        k = _heads(kv, layout, "KeyNorm")
        norms = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)  # [L, T, H]
        return units.pool(-norms.mean(dim=(0, 2)))


@dataclass
class SnapKV(DropPolicy):
    """SnapKV (Li et al. 2024) without queries: the keys of the last `window` tokens serve as
    proxy queries. A token's score is the softmax attention it gets from them, averaged over
    layers, heads and window, smoothed by average pooling (`kernel`). The window is kept."""
    window: int = 64
    kernel: int = 5
    # Temporary float32 attention memory per block of layers.
    block_bytes: int = 256 << 20

    def __post_init__(self):
        super().__post_init__()
        if self.window <= 0 or self.kernel <= 0 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKV needs window > 0 and an odd kernel > 0, got "
                             f"window={self.window}, kernel={self.kernel}")

    def token_scores(self, kv: torch.Tensor, layout: ModelLayout | None) -> torch.Tensor:
        k = _heads(kv, layout, "SnapKV")  # [L, T, H, d]
        L, T, H, d = k.shape
        w = min(self.window, T)
        # Causal: proxy query i (position T - w + i) sees tokens up to its own position.
        future = torch.arange(T)[None, :] > torch.arange(T - w, T)[:, None]  # [w, T]
        total = torch.zeros(T)
        step = max(1, self.block_bytes // (H * w * T * 4))
        for l0 in range(0, L, step):  # blocks of layers bound the [l, H, w, T] attention
            kb = k[l0: l0 + step].float().transpose(1, 2)  # [l, H, T, d]
            att = kb[:, :, T - w:] @ kb.transpose(-1, -2) / math.sqrt(d)  # [l, H, w, T]
            att = att.masked_fill(future, -INF).softmax(dim=-1)
            total += att.sum(dim=(0, 1, 2))
        scores = F.avg_pool1d(total[None, None], self.kernel, stride=1,
                              padding=self.kernel // 2, count_include_pad=False)[0, 0]
        scores[T - w:] = INF
        return scores

    def score(self, kv, units, layout):
        return units.pool(self.token_scores(kv, layout))

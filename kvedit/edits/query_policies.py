"""Query-aware dropping policies: they rank tokens by how the request's own queries attend.

The queries are the ones vLLM computed for the prompt's last W tokens, captured when the
request asks (`kvedit.create_request(..., capture_queries=W)`, docs/queries.md) and handed
to the policy by the SDK (`needs_queries = True`). When the question is the end of the prompt
(as in `kvedit eval`, where the question follows the edited context), the window *is* the
question, and the policy keeps what the question looks at: SnapKV "with the question",
kvpress's strongest setting for SnapKV.

Aggregation (one vLLM cache slot holds a token for every layer and KV head, so one decision
per token): a token's score is its attention from the window (`attention.window_attention`:
softmax over the edited tokens, per layer, query head and window row) summed over the rows,
over all query heads (each KV-head group's query heads, and then the groups) and over the
deeper layers (`from_layer`, default the deeper half); every (layer, head, row) adds a
distribution of total mass 1, so no layer or head dominates by magnitude. kvpress scores per
KV head (the sum over its group) and keeps different tokens per head; with `per_head=True`
these policies do the same (`window_attention(per_head=True)`: [L, Hkv, T], every layer on
its own, so `from_layer` does not apply), pooled and span-averaged per head. A chunk's score
is the mean over its tokens (`Units.pool`).

Why the deeper half by default: summed over all layers, the shallow layers' attention (by
position: the first and the most recent tokens, spread over the whole context) drowns the
few retrieval heads of the deeper layers that point at the needle. Measured on SmolLM2-135M
(30 layers) with the eval's tasks at seed 1 (not the eval's seed 0), fraction of prompts
whose answer tokens all survive at ratio 0.5: SnapKV all layers 1/16, deeper half 12/16;
last query only (TOVA) 6/16 and 16/16 (docs/eval.md). `from_layer=0` sums every layer.

Why spans (ChunkKV, arXiv 2502.00299) by default: SmolLM2 tokenizes a number one digit per
token, and a per-token ranking can keep four digits of a five-digit pass key, or the key but
not the sentence that says what it is. Averaging the scores over aligned spans of 10 tokens
(the paper's chunk size; kvpress's ChunkKVPress wraps a scorer the same way, default 20)
keeps whole spans. Measured through `kvedit eval` at ratio 0.5 (40 prompts, header kept),
SnapKV 27 -> 32 right at seed 0, 24 -> 27 at seed 1, 26 -> 25 at seed 2; TOVA 27 -> 29,
23 -> 24, 23 -> 25 (docs/eval.md, "What was tried for ratio 0.5").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvedit.edits.attention import Window, window_attention
from kvedit.edits.base import DropPolicy, Units
from kvedit.layout import ModelLayout

INF = float("inf")


def span_scores(scores: torch.Tensor, span: int, start: int = 0) -> torch.Tensor:
    """ChunkKV (Liu et al. 2025, arXiv 2502.00299): tokens in spans of `span` (aligned at
    `start`; the tokens before it and a short last span are spans too) all get their span's
    mean score, so the top spans are kept whole: a 5-digit number, one token per digit in
    SmolLM2, is kept or dropped with its neighbours rather than digit by digit. With the
    base's exact token budget and stable order, only the last span kept may be cut short."""
    T = scores.shape[-1]
    ids = (torch.arange(T, device=scores.device) - start).clamp_min(-1).div(
        span, rounding_mode="floor") + 1
    n = int(ids.max()) + 1
    sums = scores.new_zeros((*scores.shape[:-1], n)).index_add_(-1, ids, scores)
    counts = scores.new_zeros(n).index_add_(0, ids, scores.new_ones(T))
    return (sums / counts)[..., ids]


@dataclass
class SnapKV(DropPolicy):
    """SnapKV (Li et al. 2024) with the request's captured queries: a token's score is the
    attention the observation window (the last `window` captured rows; None = every row
    captured) pays it, summed over rows, query heads and the deeper layers (from
    `from_layer`; module docstring), then
    smoothed by average pooling over `kernel` neighbouring tokens (kvpress and the paper
    use 5: keeps a needle's neighbours with it), then averaged over spans of `span` tokens
    (ChunkKV, `span_scores`: the best spans are kept whole, so a number split into digit
    tokens survives or goes as one). The window's own tokens, where they lie among the
    edited ones, are always kept (`keep_window`), as in SnapKV; so are the first `sink`."""
    window: int | None = None
    kernel: int = 5
    from_layer: float = 0.5  # score with layers floor(from_layer * L).. (0: every layer)
    keep_window: bool = True
    pool: str = "avg"  # "max": a token scores its best neighbour's score (within kernel)
    sink: int = 0  # the first `sink` tokens (template + instruction) are always kept
    heads: str = "sum"  # "max": a token's score per layer and row is its best query head's
    # ChunkKV spans (span_scores): every token scores its span's mean, whole spans are kept.
    # 10 = the ChunkKV paper's chunk size; 1 = per-token selection.
    span: int = 10
    block_bytes: int = 256 << 20  # temporary float32 logits per block of layers
    needs_queries: ClassVar[bool] = True
    queries_from: ClassVar[str | None] = "prompt"

    def __post_init__(self):
        super().__post_init__()
        if (self.window is not None and self.window <= 0) or self.kernel <= 0 \
                or self.kernel % 2 == 0:
            raise ValueError(f"{type(self).__name__} needs window > 0 (or None) and an odd "
                             f"kernel > 0, got window={self.window}, kernel={self.kernel}")
        if self.pool not in ("avg", "max"):
            raise ValueError(f"{type(self).__name__}.pool must be 'avg' or 'max', got {self.pool!r}")
        if self.sink < 0 or self.heads not in ("sum", "max") or self.span <= 0:
            raise ValueError(f"{type(self).__name__} needs sink >= 0, span > 0 and heads 'sum' "
                             f"or 'max', got sink={self.sink}, span={self.span}, "
                             f"heads={self.heads!r}")
        if not 0.0 <= self.from_layer < 1.0:
            raise ValueError(f"{type(self).__name__}.from_layer is the fraction of the layers "
                             f"skipped from the bottom, in [0, 1), got {self.from_layer}")

    def rows(self, window: Window) -> Window:
        return window if self.window is None else window.last(self.window)

    def layers(self, num_layers: int) -> range:
        return range(int(self.from_layer * num_layers), num_layers)

    def token_scores(self, kv: torch.Tensor, layout: ModelLayout, window: Window) -> torch.Tensor:
        """[T] float32 per-token scores (inf = the window's own tokens, kept); per_head:
        [L, Hkv, T], every layer scored on its own (from_layer does not apply)."""
        w = self.rows(window)
        layers = range(kv.shape[1]) if self.per_head else self.layers(kv.shape[1])
        total = window_attention(kv, w, layout.head_dim, layers=layers,
                                 block_bytes=self.block_bytes, heads=self.heads,
                                 per_head=self.per_head)
        T = total.shape[-1]
        rows = total.reshape(-1, 1, T)
        if self.kernel > 1 and self.pool == "max":
            rows = F.max_pool1d(rows, self.kernel, stride=1, padding=self.kernel // 2)
        elif self.kernel > 1:
            rows = F.avg_pool1d(rows, self.kernel, stride=1, padding=self.kernel // 2,
                                count_include_pad=False)
        total = rows.reshape(total.shape)
        if self.span > 1:
            total = span_scores(total, self.span, start=self.sink)
        if self.keep_window:
            total[..., w.kept_in(T)] = INF
        total[..., :self.sink] = INF
        return total

    def score_window(self, kv, units: Units, layout, window):
        return units.pool(self.token_scores(kv, layout, window))


@dataclass
class TOVA(SnapKV):
    """TOVA-like (Oren et al. 2024; kvpress's TOVAPress): only the last prompt token's query
    (the last captured row) ranks the tokens; its attention is summed over query heads and
    the deeper layers (`from_layer`; TOVA averages over heads per layer, one slot per token
    here sums the layers too), no pooling, then averaged over ChunkKV spans as SnapKV
    (`span`, default 10). The last token is kept when it lies among the edited ones."""
    window: int | None = 1
    kernel: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.window != 1:
            raise ValueError(f"TOVA scores with the last query only (window=1), got "
                             f"window={self.window}; use SnapKV for more")

"""KVzip (Kim et al. 2025, arXiv 2505.23416): query-agnostic scores from context reconstruction.

A cache meant to serve many questions cannot be scored with one question's queries. KVzip
asks the model to repeat its context instead: the prompt `context + "Repeat the previous
context exactly." + context` makes every row of the repeated part look back at the original
token it is about to copy (and its neighbours), so the attention a key receives during the
reconstruction says whether the model needs it to reproduce the context, whatever is asked
later. The queries are those of the reconstruction pass (`kvedit.sdk.kvzip.reconstruct`
runs it through vLLM with the context's KV loaded from the kvedit server and captures the
repeated part's queries); the policy only needs them as a `Window` whose rows follow the
context, like any captured window.

Score, as kvpress's KVzipPress: per layer and KV head, the largest softmax attention any row
and any query head of the head's GQA group pays the key (`window_attention(rows="max",
heads="max", per_head=True)`). The softmax is over the context keys a row sees (the
renormalised restriction of the model's attention, as for SnapKV; kvpress also counts the
repeated part's own keys in the denominator, which rescales each row: the order within a row
holds, the largest over rows can differ).
With `per_head=True` each (layer, KV head) keeps its own best keys (equal counts, `base.py`);
otherwise a token's score is the mean of its per-(layer, head) scores. The first `sink`
tokens are always kept (kvpress: 4 attention sinks; the eval passes the prompt's header).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvedit.edits.attention import window_attention
from kvedit.edits.base import DropPolicy
from kvedit.edits.query_policies import span_scores

INF = float("inf")


@dataclass
class KVzip(DropPolicy):
    """Keep the keys the model attends to most while repeating its context (module
    docstring). Needs the reconstruction pass's queries: `kvedit.sdk.kvzip.reconstruct`."""
    sink: int = 4
    span: int = 1  # ChunkKV spans (query_policies.span_scores); 1: per-token scores
    block_bytes: int = 256 << 20
    needs_queries: ClassVar[bool] = True
    needs_reconstruction: ClassVar[bool] = True
    queries_from: ClassVar[str | None] = "reconstruction"

    def __post_init__(self):
        super().__post_init__()
        if self.sink < 0 or self.span <= 0:
            raise ValueError(f"KVzip needs sink >= 0 and span > 0, got sink={self.sink}, "
                             f"span={self.span}")

    def token_scores(self, kv: torch.Tensor, layout, window) -> torch.Tensor:
        """[L, Hkv, T] (per_head) or [T] float32; the sink inf."""
        s = window_attention(kv, window, layout.head_dim, heads="max", rows="max",
                             per_head=True, block_bytes=self.block_bytes)
        if not self.per_head:
            s = s.mean(dim=(0, 1))
        if self.span > 1:
            s = span_scores(s, self.span, start=self.sink)
        s[..., :self.sink] = INF
        return s

    def score_window(self, kv, units, layout, window):
        return units.pool(self.token_scores(kv, layout, window))

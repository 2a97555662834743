"""A decode-time budget policy that keeps what the rest of the reply will need: the prompt
ranked once, by its own question, and the generated tokens by redundancy and recency.

Why a policy of its own. A budget kept during a long generation compacts the same request
again and again. A query-aware policy (SnapKV) that re-scores the whole KV at each compaction
scores the prompt with the queries of whatever the model wrote last: after 2,000 tokens of
counting, the counting's queries, which never look at the secret code the reply must restate
at its end (the H100 run of issue 42: in-engine SnapKV kept the code in 2 of 32 streams,
KeyNorm in 23, plain vLLM in 32). A query-agnostic score (KeyNorm) does not know what the
instruction asks for at all. The prompt's own last window does: its instruction ("... then
write the secret code") attends to the fact it will ask for, as SnapKV with the question
does at prefill (1.02x of full-KV accuracy at 0.5 on this model at 4k, docs/eval.md).

So the request's KV is two regions, always the prompt's kept tokens first:
- **prompt**: scored once, at prefill, by the prompt's last `window` query rows (SnapKV:
  window attention from the deeper layers, pooled, averaged over ChunkKV spans; the window's
  own tokens, the instruction's tail, always kept). The ranking never changes afterwards
  (`PromptRanks` carries it from one compaction to the next): the prompt only shrinks, best
  kept, from whatever the budget leaves down to its share.
- **generated**: the last `protect_last` tokens always kept (the model's local context);
  of the older ones, the least redundant and the newest (R-KV, Cai et al. 2025: a token whose
  key a later token repeats adds little; keep the later copy): score = position / G -
  `redundancy` x (the highest cosine similarity of its key to a later generated token's key,
  per layer and KV head, averaged unless per_head). No queries are needed, so no query ring
  runs during decode.
- **split**: the prompt keeps at least `prompt_share` of `keep` (all of it, if shorter); the
  generated tokens the rest; while fewer tokens have been generated than their share, the
  prompt keeps what they leave.

The caller (the engine's worker, or the host driver) holds one `PromptRanks` per request:
built by `rank_prompt` when the prompt is computed (the queries of its last rows), passed to
`select(..., prompt=ranks)` at every compaction, and updated by it (the prompt positions still
resident). Per head (`per_head=True`): the prompt's scores and the redundancy per (layer, KV
head), equal counts in every head (the prompt's count and the generated count alike).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvedit.edits.attention import Window, check_window
from kvedit.edits.base import INF, DropPolicy, Units, top_tokens
from kvedit.edits.query_policies import SnapKV
from kvedit.layout import ModelLayout

# The most bytes of key similarities PromptAnchored.generated_scores holds at once.
SIM_BYTES = 256 << 20


@dataclass
class PromptRanks:
    """One request's prompt ranking from prefill: `scores` over the prompt's P logical
    positions ([P], or [L, H_kv, P] per head; inf = always kept) and `pos`, the logical
    positions of the prompt tokens still resident, in slot order ([P'] or [L, H_kv, P'])."""
    scores: torch.Tensor
    pos: torch.Tensor

    @classmethod
    def fresh(cls, scores: torch.Tensor) -> PromptRanks:
        """Every prompt token resident (before the first compaction, or after a recompute)."""
        P = scores.shape[-1]
        pos = torch.arange(P, device=scores.device)
        return cls(scores, pos.expand(*scores.shape[:-1], P).contiguous())

    @property
    def resident(self) -> int:
        return self.pos.shape[-1]

    def current(self) -> torch.Tensor:
        """The scores of the resident prompt tokens, in slot order."""
        return self.scores.gather(-1, self.pos)

    def keep(self, idx: torch.Tensor, n: int, seen: int | None = None) -> None:
        """After a selection `idx` ([keep] or [L, H_kv, keep], sorted) whose first `n` slots
        are prompt slots in every row (`select`'s rule): the prompt positions still resident.
        (n is given, not counted: counting on a GPU would wait for it.) `seen`: how many
        prompt slots the selection saw; those after them (a host edit's region can end
        inside the prompt: its tail is recomputed by the next round) stay."""
        kept = self.pos.gather(-1, idx[..., :n])
        if seen is not None and seen < self.resident:
            kept = torch.cat([kept, self.pos[..., seen:]], dim=-1)
        self.pos = kept


@dataclass
class PromptAnchored(DropPolicy):
    """The prompt ranked once by its own last window, generated tokens by redundancy and
    recency, the budget split between them (module docstring). A decode-time policy: used by
    an in-engine budget (`EngineBudget.from_policy(PromptAnchored(), ...)`, queries = window)
    or a HostBudget; as a one-off edit of a prompt it is SnapKV with the prompt's window."""
    granularity: str = "token"
    prompt_share: float = 0.5   # the prompt keeps at least this share of a compaction's keep
    window: int = 64            # the prompt's last rows whose queries rank it
    kernel: int = 5             # SnapKV's pooling of the prompt's scores
    span: int = 10              # ChunkKV spans of the prompt's scores
    from_layer: float = 0.5     # layers that rank the prompt (per_head: every layer)
    redundancy: float = 1.0     # generated tokens: weight of R-KV redundancy against recency
    needs_queries: ClassVar[bool] = True
    queries_from: ClassVar[str | None] = "prompt"
    # The queries are needed once, when the prompt is computed (the engine keeps no query
    # ring during decode, and its window's tokens need no protection: they are kept as the
    # prompt's window).
    queries_at_prefill: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"PromptAnchored.prompt_share must be in [0, 1], got "
                             f"{self.prompt_share}")
        if self.redundancy < 0:
            raise ValueError(f"PromptAnchored.redundancy must be >= 0, got {self.redundancy}")
        self._snap()  # its own checks: window, kernel, span, from_layer

    def _snap(self) -> SnapKV:
        return SnapKV(granularity="token", window=self.window, kernel=self.kernel,
                      span=self.span, from_layer=self.from_layer, per_head=self.per_head)

    # -- the prompt, once -------------------------------------------------------------------
    def rank_prompt(self, kv: torch.Tensor, layout: ModelLayout, queries: torch.Tensor,
                    query_start: int | None = None) -> PromptRanks:
        """The prompt's ranking: `kv` [2, L, P, D] is the whole computed prompt, `queries`
        [L, W, Hq*D] its last rows (row 0 at `query_start`, default P - W)."""
        P = kv.shape[2]
        start = P - queries.shape[1] if query_start is None else query_start
        window = check_window(type(self).__name__, kv, queries, start, layout.head_dim)
        scores = self._snap().token_scores(kv, layout, window)
        return PromptRanks.fresh(scores)

    # -- generated tokens ---------------------------------------------------------------------
    def generated_scores(self, kv: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
        """[G] (per_head: [L, H_kv, G]) scores of generated tokens `kv` [2, L, G, D]:
        recency minus `redundancy` x the highest cosine similarity to a later token's key."""
        return self._generated(kv[0], layout)

    def _generated(self, keys: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
        """`generated_scores` of keys [L, *B, G, D] (B: requests scored at once, one batch
        dim or none): [*B, G] (per_head: [*B, L, H_kv, G])."""
        G, hidden = keys.shape[-2:]
        H = hidden // layout.head_dim
        lead = keys.shape[:-2]                       # (L, *B)
        recency = torch.arange(G, dtype=torch.float32, device=keys.device) / max(G, 1)
        if self.redundancy == 0 or G < 2:
            shape = (*lead[1:], *lead[:1], H, G) if self.per_head else (*lead[1:], G)
            return recency.expand(shape)
        earlier = torch.ones(G, G, dtype=torch.bool, device=keys.device).tril()  # j <= i
        rows = keys.reshape(-1, G, hidden)           # [L * B, G, D]
        red = torch.empty((rows.shape[0], H, G), dtype=torch.float32, device=keys.device)
        # As many rows (layers, requests) at a time as fit SIM_BYTES of similarities: a loop
        # of one layer at a time was 28 x 5 small kernels a compaction, 3x KeyNorm's time on
        # the H100 (results/long/h100-2026-12-06); the cap bounds the temporary.
        step = max(1, SIM_BYTES // (H * G * G * 4))
        for r in range(0, rows.shape[0], step):
            k = rows[r:r + step].float().view(-1, G, H, layout.head_dim).transpose(1, 2)
            k = F.normalize(k, dim=-1)
            sim = (k @ k.transpose(-1, -2)).masked_fill_(earlier, -1.0)
            red[r:r + step] = sim.amax(dim=-1)
        red[..., -1] = -1.0  # the newest has no later copy
        red = red.view(*lead, H, G)
        if lead[1:]:                                 # [L, B, H, G] -> [B, L, H, G]
            red = red.movedim(1, 0)
        red = red if self.per_head else red.mean(dim=(-3, -2))
        return recency - self.redundancy * red

    # -- a compaction -------------------------------------------------------------------------
    def split(self, resident_prompt: int, generated: int, keep: int) -> tuple[int, int]:
        """(prompt tokens kept, generated tokens kept) of a compaction keeping `keep`."""
        share = min(resident_prompt, int(self.prompt_share * keep))
        g = min(generated, keep - share)
        return keep - g, g

    def select(self, kv: torch.Tensor, keep: int, layout: ModelLayout | None = None, *,
               queries=None, query_start: int | None = None,
               prompt: PromptRanks | None = None) -> torch.Tensor:
        """Exactly `keep` slot indices (sorted; [keep] or [L, H_kv, keep]) of `kv`, whose first
        `prompt.resident` slots are the prompt's kept tokens; `prompt` is updated to the
        prompt slots kept. Without `prompt` (a one-off edit): the whole kv is a prompt ranked
        by `queries` (its last rows)."""
        self._check_kv(kv)
        T = kv.shape[2]
        if not 0 < keep <= T:
            raise ValueError(f"PromptAnchored.select: keep must be in [1, {T}], got {keep}")
        if layout is None:
            raise ValueError("PromptAnchored needs the model layout (head_dim): pass layout=...")
        if prompt is None:
            if queries is None:
                raise ValueError("PromptAnchored.select needs the request's PromptRanks "
                                 "(prompt=...) or, for a one-off edit, the prompt's captured "
                                 "queries (queries=...)")
            prompt = self.rank_prompt(kv, layout, queries, query_start)
        P = min(prompt.resident, T)   # a host edit's region may end inside the prompt
        p_keep, g_keep = self.split(P, T - P, keep)
        protect = self.protect_last
        p_scores = prompt.current()[..., :P].to(kv.device)
        if protect > T - P:  # the newest tokens reach into the prompt (no reply yet)
            p_scores = p_scores.clone()
            p_scores[..., P - (protect - (T - P)):] = INF
        idx = [top_tokens(p_scores, p_keep)] if p_keep else []
        if g_keep:
            g = self.generated_scores(kv[:, :, P:], layout)
            if protect:
                g = g.clone()
                g[..., max(0, g.shape[-1] - protect):] = INF
            idx.append(top_tokens(g, g_keep) + P)
        out = torch.cat(idx, dim=-1)  # per head both parts are [L, H_kv, n]: same rows
        prompt.keep(out, p_keep, P)
        return out

    def select_many(self, kv: torch.Tensor, keep: int, layout: ModelLayout,
                    prompts: list[PromptRanks]) -> torch.Tensor:
        """`select` of N requests at once (the compactions that fall due in one engine step:
        one set of kernels instead of N): `kv` [2, L, N, T, D] holds each request's T
        resident slots, whose first P are its prompt's kept tokens, P the same for every
        request (`prompts[i].resident`; T >= P). Returns [N, keep] (per head [N, L, H_kv,
        keep]), row i what `select(kv[:, :, i], keep, layout, prompt=prompts[i])` returns,
        and updates each of `prompts` as it would."""
        T = kv.shape[3]
        P = prompts[0].resident
        if any(p.resident != P for p in prompts) or P > T or not 0 < keep <= T:
            raise ValueError(f"PromptAnchored.select_many: every request needs the same "
                             f"resident prompt (got {sorted({p.resident for p in prompts})}) "
                             f"within T = {T}, and keep in [1, {T}] (got {keep})")
        p_keep, g_keep = self.split(P, T - P, keep)
        protect = self.protect_last
        pos = torch.stack([p.pos for p in prompts])                  # [N, (L, H,) P]
        p_scores = torch.stack([p.scores for p in prompts]).to(kv.device).gather(
            -1, pos.to(kv.device))
        if protect > T - P:
            p_scores[..., P - (protect - (T - P)):] = INF
        idx = [top_tokens(p_scores, p_keep)] if p_keep else []
        if g_keep:
            g = self._generated(kv[0, :, :, P:], layout)              # [N, (L, H,) G]
            if protect:
                g = g.clone()
                g[..., max(0, g.shape[-1] - protect):] = INF
            idx.append(top_tokens(g, g_keep) + P)
        out = torch.cat(idx, dim=-1)
        kept = pos.gather(-1, out[..., :p_keep].to(pos.device))
        for i, p in enumerate(prompts):
            p.pos = kept[i]
        return out

    def keeping(self, max_tokens: int, memo: dict | None = None):
        """A budget's edit on the host (kvedit.sdk.driver): keep at most `max_tokens` of the
        kv it is given. `memo` is the stream's, kept from one edit to the next: it holds
        "prompt_tokens" (the stream's prompt length, set by the driver) and, once the first
        edit has ranked the prompt by the stream's captured queries, "ranks". Without a memo:
        a one-off edit that ranks the whole kv each time."""
        if memo is None:
            return super().keeping(max_tokens)
        policy = self

        def fit(kv, tokens, layout=None, queries=None, query_start=None):
            if kv.shape[2] <= max_tokens:
                return kv, tokens
            if "ranks" not in memo:
                memo["ranks"] = policy._rank_region(kv, layout, queries, query_start,
                                                    memo["prompt_tokens"])
            pol = policy
            if policy.per_head:  # the slots past the last whole chunk: one token everywhere
                tail = max_tokens % layout.chunk_size
                if tail > policy.protect_last:
                    pol = replace(policy, protect_last=tail)
            idx = pol.select(kv, max_tokens, layout, prompt=memo["ranks"])
            if policy.per_head:
                return policy._apply_per_head(kv, tokens, idx, layout)
            return policy._edit(kv, tokens, idx, layout)

        fit.needs_queries = "ranks" not in memo
        return fit

    def _rank_region(self, kv, layout, queries, query_start, prompt_tokens: int) -> PromptRanks:
        """The first host edit's ranking: the region holds the prompt's first min(P, T)
        tokens; the window's rows may lie past it (its tail is in the stream's suffix), and
        those tail tokens are the window's own: always kept (inf)."""
        if queries is None:
            raise ValueError("PromptAnchored on the host ranks the prompt by its captured "
                             "queries: create the stream with capture_queries=W (its window)")
        seen = min(prompt_tokens, kv.shape[2])
        ranks = self.rank_prompt(kv[:, :, :seen], layout, queries,
                                 prompt_tokens - queries.shape[1]
                                 if query_start is None else query_start)
        if seen < prompt_tokens:
            tail = ranks.scores.new_full((*ranks.scores.shape[:-1], prompt_tokens - seen), INF)
            ranks = PromptRanks.fresh(torch.cat([ranks.scores, tail], dim=-1))
        return ranks

    def keep_indices(self, kv: torch.Tensor, layout: ModelLayout | None = None, *,
                     queries=None, query_start: int | None = None) -> torch.Tensor:
        """A one-off edit (`batch.modify(PromptAnchored(ratio))`): the whole kv is the prompt,
        ranked by its window; `ratio` of its tokens dropped."""
        units = self.units(kv.shape[2], layout)
        keep = kv.shape[2] - self.num_drop(units)
        return self.select(kv, keep, layout, queries=queries, query_start=query_start)

    def score(self, kv: torch.Tensor, units: Units, layout: ModelLayout | None):
        raise TypeError("PromptAnchored ranks with select(kv, keep, prompt=...); it has no "
                        "per-unit score of its own")

    def score_window(self, kv, units, layout, window: Window | None):
        return self.score(kv, units, layout)

"""The shared base of token-dropping policies: score units, keep the best, re-rotate.

A policy is one `score` method. The base splits the sequence into units (whole chunks or
single tokens), asks the policy for one score per unit (higher = keep), keeps the
`n - floor(ratio * n)` best units in their original order, gathers their K/V and tokens,
and re-rotates the kept keys (see `rope.py`): vLLM numbers a request's tokens by count, so
the T' kept keys must look as if at positions vLLM will give what follows them (T', T'+1,
...). Two choices (`positions`): "compact" moves each kept key to its new slot (key i at
i), as if the dropped tokens had never been there; "logical" moves every kept key back by
the number of tokens dropped, so each keeps its original distance to everything after the
edited region (the geometry the model computed, as kvpress keeps it; the first kept keys
then sit at negative positions, which RoPE does not mind: only differences count).

Chunk granularity keeps the edited sequence chunk-aligned, so every kept chunk is stored
under a full key and the decode reloads all of it; token granularity may leave a partial
last chunk, which the SDK moves into the stream's suffix and vLLM recomputes.

Query-aware policies (`needs_queries = True`, see `query_policies.py`) score from the
request's captured queries: the SDK passes `queries=` (and `query_start=`) to `__call__`
and the base hands them to the policy's `score_window` as a `Window`. The SDK passes queries
only to a fn whose `needs_queries` is True, so a query-free policy never asks for them.

Per-head selection (`per_head=True`). One vLLM cache slot holds a token's K/V for every
layer and KV head, but once keys carry their RoPE a slot may hold a different token in each
(layer, KV head), provided every head keeps the same number of tokens (uniform block
tables). With `per_head=True`, `score` returns `[L, H_kv, units]` (a policy that has one
score per unit returns `[units]` and every head gets it), and `keep_indices` returns
`[L, H_kv, T']`: each row sorted, the same count T' in every row. Per head the ranking is by
token: each token carries its unit's score, so whole units are kept except possibly the
lowest-ranked one, cut short to make the count T' = T - (dropped units) x (unit size).
Protected positions (score inf: a policy's sinks or window, and the last `protect_last`
tokens) are kept in every head. `__call__` (the host path's edit) returns the kept KV with
token ids per head, `[L, H_kv, T']`, and keeps the last `T' mod chunk_size` tokens in every
head (the SDK recomputes that partial chunk from one token id per slot; which id stands for
a slot is the SDK's rule, kvedit.sdk.head_tokens). "compact" positions differ per head
there (each head's slot j holds another token); "logical" ones are one shift for all.

`select(kv, keep)` is the same ranking with an exact count (`keep` tokens per row): what an
engine that must keep a fixed number of slots uses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kvedit.edits import budgets, heads
from kvedit.edits.attention import Window, check_window
from kvedit.edits.rope import rerotate, rotate_keys
from kvedit.layout import ModelLayout

GRANULARITIES = ("chunk", "token")
POSITIONS = ("compact", "logical")
DEFAULT_CHUNK_SIZE = 256  # the server's default; a layout's chunk_size wins when known
INF = float("inf")


@dataclass
class Units:
    """How the T tokens of one request are grouped for scoring."""
    size: int    # tokens per unit (the last unit may be shorter)
    count: int   # number of units
    tokens: int  # T

    def token_indices(self, units: torch.Tensor) -> torch.Tensor:
        """Token indices of `units` (sorted), in order."""
        starts = units * self.size
        idx = (starts[:, None] + torch.arange(self.size, device=units.device)).flatten()
        return idx[idx < self.tokens]

    def pool(self, token_scores: torch.Tensor) -> torch.Tensor:
        """Mean of per-token scores within each unit: [..., T] -> [..., count]."""
        if self.size == 1:
            return token_scores
        pad = self.count * self.size - self.tokens
        padded = torch.cat([token_scores,
                            token_scores.new_full((*token_scores.shape[:-1], pad), float("nan"))],
                           dim=-1)
        return padded.unflatten(-1, (self.count, self.size)).nanmean(dim=-1)

    def expand(self, unit_scores: torch.Tensor) -> torch.Tensor:
        """Each token gets its unit's score: [..., count] -> [..., T]."""
        if self.size == 1:
            return unit_scores
        return unit_scores.repeat_interleave(self.size, dim=-1)[..., :self.tokens]


def top_tokens(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Sorted indices of the `keep` best of `scores` [..., T] along the last dim (stable: among
    equal scores the earlier token wins); [..., keep]."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :keep].sort(dim=-1).values


@dataclass
class DropPolicy:
    """Base: drop `ratio` of the units with the lowest scores. Subclasses implement `score`."""
    ratio: float = 0.5
    granularity: str = "chunk"
    chunk_size: int | None = None  # None: the layout's chunk size (else 256)
    rerotate: bool = True
    per_head: bool = False  # one selection per (layer, KV head); module docstring
    protect_last: int = 0   # the last tokens are always kept (in every head)
    # Where kept keys go (module docstring): "compact" re-rotates each to its new slot;
    # "logical" shifts all by the number dropped, keeping every distance to what follows.
    # None: "logical" with per_head (compact positions would differ per head), else
    # "compact" (docs/eval.md measures both).
    positions: str | None = None
    # Where the edit runs ("cuda", "cuda:1"; None: where kv is): the KV and the captured
    # queries are copied there, scored, gathered and re-rotated there, and the edited KV
    # comes back where kv was (keep_indices/select: the scores are computed there). For a
    # host edit beside a GPU engine: the attention of a window over a long context, and the
    # gather and re-rotation of a 16k-token cache, are GPU work.
    edit_device: str | None = None
    # Tokens per (layer, KV head) with per_head (budgets.py): "uniform" (equal counts),
    # "layer" (AdaKV: a layer's total shared by its heads) or "global" (one ranking over every
    # layer and head, KVzip's); the unequal ones are stored with null-key pads, in as many
    # slots as the largest head keeps. `alpha`: every head keeps at least that share of T'.
    budget: str = "uniform"
    alpha: float = 0.2
    # True: the policy scores from the request's captured queries; the SDK then fetches them
    # (the request must be created with capture_queries=W) and passes them to __call__.
    # An unequal `budget` needs queries too (its pads' null keys), from the context.
    needs_queries: ClassVar[bool] = False
    # True: those queries are a reconstruction pass's (KVzip, kvedit.sdk.kvzip), not the
    # prompt's own: the policy does not see the question (query-agnostic).
    needs_reconstruction: ClassVar[bool] = False
    # Whose queries: "prompt" (the prompt's last W tokens as captured by its prefill: the
    # question when it ends the prompt), "reconstruction" (KVzip's pass) or "context" (the
    # edited context's own last rows, kvedit.sdk.context_pass: no question); None: none.
    queries_from: ClassVar[str | None] = None
    # True: those queries rank the prompt once, when it is computed (kvedit.edits.anchored);
    # a decode-time budget then keeps no query ring and needs no protection for the window.
    queries_at_prefill: ClassVar[bool] = False
    # False: the scores depend on positions only, never on the KV's values (an engine that
    # compacts in place then reads only the kept tokens; kv may be a stand-in of its shape).
    reads_kv: ClassVar[bool] = True

    def __post_init__(self):
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"{type(self).__name__}.ratio must be in [0, 1), got {self.ratio}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{type(self).__name__}.granularity must be one of {GRANULARITIES}, "
                             f"got {self.granularity!r}")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"{type(self).__name__}.chunk_size must be positive, "
                             f"got {self.chunk_size}")
        if self.positions is not None and self.positions not in POSITIONS:
            raise ValueError(f"{type(self).__name__}.positions must be one of {POSITIONS}, "
                             f"got {self.positions!r}")
        if self.protect_last < 0:
            raise ValueError(f"{type(self).__name__}.protect_last must be >= 0 tokens, "
                             f"got {self.protect_last}")
        self._check_budget()

    def _check_budget(self) -> None:
        who = type(self).__name__
        if self.budget not in budgets.BUDGETS or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{who}.budget must be one of {budgets.BUDGETS} and alpha in "
                             f"[0, 1], got budget={self.budget!r}, alpha={self.alpha}")
        if self.budget == "uniform":
            return
        if not self.per_head or self.where != "logical":
            raise ValueError(f"{who}(budget={self.budget!r}) selects per (layer, KV head) at "
                             f"logical positions: set per_head=True and leave positions "
                             f"'logical' (got per_head={self.per_head}, "
                             f"positions={self.positions!r})")
        if not type(self).needs_queries:  # the pads' null keys need a sample of queries
            self.needs_queries = True
            self.queries_from = "context"

    # -- what a policy implements -------------------------------------------------------
    def score(self, kv: torch.Tensor, units: Units, layout: ModelLayout | None) -> torch.Tensor:
        """One float score per unit ([units.count]); higher is kept. inf = always keep.
        With `per_head`, a policy that scores per (layer, KV head) returns [L, H_kv, count]."""
        raise NotImplementedError

    def score_window(self, kv: torch.Tensor, units: Units, layout: ModelLayout | None,
                     window: Window | None) -> torch.Tensor:
        """`score` with the captured queries; query-aware policies override this instead."""
        return self.score(kv, units, layout)

    def num_drop(self, units: Units) -> int:
        """How many units to drop (a policy may override, e.g. to protect some units)."""
        drop = int(self.ratio * units.count)
        if drop == 0 and self.ratio > 0:
            raise ValueError(
                f"{type(self).__name__}: input too short to drop anything: {units.tokens} tokens "
                f"make {units.count} unit(s) of {units.size} token(s) ({self.granularity} "
                f"granularity), and ratio {self.ratio} of them rounds down to 0")
        return drop

    # -- the shared machinery ------------------------------------------------------------
    def units(self, num_tokens: int, layout: ModelLayout | None) -> Units:
        if self.granularity == "token":
            size = 1
        else:
            size = self.chunk_size or (layout.chunk_size if layout else DEFAULT_CHUNK_SIZE)
        return Units(size=size, count=-(-num_tokens // size), tokens=num_tokens)

    def captured_window(self, kv: torch.Tensor, layout: ModelLayout | None, queries,
               query_start: int | None) -> Window | None:
        """The checked `Window` of `queries` (None for a query-free policy)."""
        who = type(self).__name__
        if not self.needs_queries:
            return None
        if queries is None:
            raise ValueError(f"{who} scores with the request's captured queries and got none: "
                             "create the request with kvedit.create_request(..., "
                             "capture_queries=W) and run the edit through the SDK (or pass "
                             "queries=[L, W, num_q_heads*head_dim] and query_start=...)")
        if layout is None:
            raise ValueError(f"{who} needs the model layout (head_dim): run it through the SDK "
                             "or pass layout=...")
        return check_window(who, kv, queries, query_start, layout.head_dim)

    def _check_kv(self, kv: torch.Tensor) -> None:
        if kv.dim() != 4 or kv.shape[0] != 2:
            raise ValueError(f"{type(self).__name__}: kv must be [2, L, T, D], "
                             f"got {tuple(kv.shape)}")

    def _check_keep(self, kv: torch.Tensor, keep: int) -> int:
        """T, the tokens in `kv`, once `keep` is checked to be a selection's size of them."""
        T = kv.shape[2]
        if not 0 < keep <= T:
            raise ValueError(f"{type(self).__name__}.select: keep must be in [1, {T}] (the "
                             f"tokens in kv), got {keep}")
        return T

    def unit_scores(self, kv: torch.Tensor, units: Units, layout: ModelLayout | None,
                    window: Window | None) -> torch.Tensor:
        """The policy's scores, checked: [count], or [L, H_kv, count] when per_head (a
        policy with one score per unit is broadcast to every head)."""
        scores = self.score_window(kv, units, layout, window).float().to(kv.device)
        who = type(self).__name__
        if self.per_head:
            L, hidden = kv.shape[1], kv.shape[3]
            if layout is None:
                raise ValueError(f"{who}(per_head=True) needs the model layout (head_dim) to "
                                 "split the KV into heads: pass layout=...")
            shape = (L, hidden // layout.head_dim, units.count)
            if scores.shape == (units.count,):
                return scores.expand(shape)
            if scores.shape != shape:
                raise ValueError(f"{who}.score returned shape {tuple(scores.shape)}, expected "
                                 f"{shape} or ({units.count},) with per_head=True")
            return scores
        if scores.shape != (units.count,):
            raise ValueError(f"{who}.score returned shape {tuple(scores.shape)}, "
                             f"expected ({units.count},)")
        return scores

    def _elsewhere(self, kv: torch.Tensor) -> torch.device | None:
        """The edit_device when it is not where kv is (None: run here)."""
        if self.edit_device is None:
            return None
        dev = torch.device(self.edit_device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return None if dev == kv.device else dev

    def _scores(self, kv: torch.Tensor, units: Units, layout: ModelLayout | None, queries,
                query_start: int | None) -> torch.Tensor:
        """unit_scores, computed on `edit_device` when one is set (and the policy reads the
        KV), returned on kv's device."""
        dev = self._elsewhere(kv)
        if dev is None or not self.reads_kv:
            return self.unit_scores(kv, units, layout,
                                    self.captured_window(kv, layout, queries, query_start))
        there = kv.to(dev)
        if isinstance(queries, torch.Tensor):
            queries = queries.to(dev)
        window = self.captured_window(there, layout, queries, query_start)
        return self.unit_scores(there, units, layout, window).to(kv.device)

    def _protect(self, token_scores: torch.Tensor) -> torch.Tensor:
        """Scores [..., T] with the last `protect_last` tokens made inf (a new tensor)."""
        if self.protect_last <= 0:
            return token_scores
        out = token_scores.clone()
        out[..., max(0, out.shape[-1] - self.protect_last):] = INF
        return out

    def _all(self, kv: torch.Tensor, layout: ModelLayout | None, n: int) -> torch.Tensor:
        idx = torch.arange(n, device=kv.device)
        if not self.per_head:
            return idx
        if layout is None:
            raise ValueError(f"{type(self).__name__}(per_head=True) needs the model layout "
                             "(head_dim) to split the KV into heads: pass layout=...")
        return idx.expand(kv.shape[1], kv.shape[3] // layout.head_dim, n)

    def keep_indices(self, kv: torch.Tensor, layout: ModelLayout | None = None, *,
                     queries=None, query_start: int | None = None) -> torch.Tensor:
        """Sorted token indices this policy keeps for `kv` [2, L, T, D] (and the captured
        `queries` [L, W, Hq*D] whose row 0 is prompt position `query_start`, if it needs
        them): [T'], or [L, H_kv, T'] when per_head (module docstring)."""
        self._check_kv(kv)
        units = self.units(kv.shape[2], layout)
        drop = self.num_drop(units)
        if drop == 0:
            return self._all(kv, layout, units.tokens)
        if self.budget != "uniform":  # [L, H_kv, S] with -1 where a head's pads go
            return self._adaptive(kv, layout, queries, query_start)[0]
        scores = self._scores(kv, units, layout, queries, query_start)
        if self.per_head:
            keep = units.tokens - min(drop * units.size, units.tokens - 1)
            return top_tokens(self._protect(units.expand(scores)), keep)
        if self.protect_last > 0:  # units holding one of the last tokens are kept whole
            first = max(0, units.tokens - self.protect_last) // units.size
            scores = scores.clone()
            scores[first:] = INF
        # Stable: among equal scores the earlier unit is kept; inf scores are always kept.
        kept = top_tokens(scores, units.count - drop)
        return units.token_indices(kept)

    def select(self, kv: torch.Tensor, keep: int, layout: ModelLayout | None = None, *,
               queries=None, query_start: int | None = None) -> torch.Tensor:
        """Exactly `keep` token indices (sorted) per row: [keep], or [L, H_kv, keep] when
        per_head. Tokens are ranked by their unit's score (stable: the earlier wins a tie),
        protected ones first; `ratio` is not used (a policy whose scores depend on it, such
        as DropMiddle, scores with the ratio it was given)."""
        self._check_kv(kv)
        self._equal_counts("select")
        T = self._check_keep(kv, keep)
        if keep == T:
            return self._all(kv, layout, T)
        units = self.units(T, layout)
        scores = self._scores(kv, units, layout, queries, query_start)
        return top_tokens(self._protect(units.expand(scores)), keep)

    def keeping(self, max_tokens: int):
        """This policy as an edit fn that keeps at most `max_tokens` of the kv it is given:
        the ratio that drops just enough units (what a budget's edit needs between decode
        rounds, kvedit.sdk.driver; a repair's, kvedit.sdk.repair); kv already that short is
        returned as it is. A query-aware policy's fit takes the captured queries on too."""
        self._equal_counts("keeping")
        def fit(kv, tokens, layout=None, queries=None, query_start=None):
            units = self.units(kv.shape[2], layout)
            keep = max_tokens // units.size
            drop = units.count - keep
            if drop <= 0:
                return kv, tokens
            if keep <= 0:
                raise ValueError(f"budget leaves room for {max_tokens} tokens, less than one "
                                 f"{self.granularity} of {units.size}")
            # int(ratio * count) == drop: the policy drops exactly the units the budget needs
            return replace(self, ratio=(drop + 0.5) / units.count)(
                kv, tokens, layout=layout, queries=queries, query_start=query_start)
        fit.needs_queries = self.needs_queries   # the SDK fetches them for fit as for self
        return fit

    def __call__(self, kv: torch.Tensor, tokens, layout: ModelLayout | None = None,
                 queries: torch.Tensor | None = None, query_start: int | None = None):
        """Drop tokens from `kv` [2, L, T, D] and `tokens` (len T); returns (kv, tokens).
        `queries`/`query_start`: the request's captured queries, for policies that need them
        (query_start None: the rows follow the T tokens, as when the question is after them)."""
        if len(tokens) != kv.shape[2]:
            raise ValueError(f"{type(self).__name__}: {len(tokens)} tokens but kv holds "
                             f"{kv.shape[2]} (shape {tuple(kv.shape)})")
        if self.rerotate and (layout is None or layout.rope is None):
            raise ValueError(f"{type(self).__name__}: re-rotation needs the model's RoPE "
                             "parameters (layout.rope); run it through the SDK, pass "
                             "layout=..., or set rerotate=False")
        dev = self._elsewhere(kv)
        if dev is not None:  # the whole edit there, the result back here
            here = replace(self, edit_device=None)
            if isinstance(queries, torch.Tensor):
                queries = queries.to(dev)
            out, kept = here(kv.to(dev), tokens, layout, queries, query_start)
            return out.to(kv.device), kept.to(kv.device) if isinstance(
                kept, torch.Tensor) else kept
        if self.per_head:
            return self._per_head_call(kv, tokens, layout, queries, query_start)
        idx = self.keep_indices(kv, layout, queries=queries, query_start=query_start)
        return self._edit(kv, tokens, idx, layout)

    def _edit(self, kv, tokens, idx: torch.Tensor, layout):
        """(kv, tokens) of the kept tokens `idx` [T'], keys re-rotated (`positions`)."""
        if len(idx) == kv.shape[2]:
            return kv, tokens
        out = kv.index_select(2, idx)  # compact copy of the kept tokens; rotated in place
        if self.rerotate:
            rerotate(out, idx, self._new_positions(idx, kv.shape[2]), layout)
        if isinstance(tokens, torch.Tensor):
            return out, tokens.index_select(0, idx)
        kept = [tokens[i] for i in idx.tolist()]
        return out, kept

    def _per_head_call(self, kv, tokens, layout, queries, query_start):
        """(kv [2, L, T', D], token ids [L, H_kv, T']): each head's own kept tokens, keys
        moved to contiguous positions per head. The last `T' mod chunk_size` tokens (the
        slots past the last full chunk, which vLLM recomputes from one token id) are kept in
        every head (`protect_last`), so they are the same tokens everywhere
        (kvedit.sdk.head_tokens)."""
        if layout is None:
            raise ValueError(f"{type(self).__name__}(per_head=True) needs the model layout "
                             "(head_dim, chunk_size): run it through the SDK or pass layout=...")
        if self.budget != "uniform":
            idx, nulls = self._adaptive(kv, layout, queries, query_start)
            return budgets.store(kv, tokens, idx, nulls, layout, self.rerotate)
        T = kv.shape[2]
        units = self.units(T, layout)
        keep = T - min(self.num_drop(units) * units.size, T - 1)
        tail = keep % layout.chunk_size
        policy = replace(self, protect_last=tail) if tail > self.protect_last else self
        idx = policy.keep_indices(kv, layout, queries=queries, query_start=query_start)
        return self._apply_per_head(kv, tokens, idx, layout)

    def _apply_per_head(self, kv, tokens, idx: torch.Tensor, layout):
        """(kv, token ids [L, H_kv, T']) of the per-head selection idx [L, H_kv, T']: each
        head's tokens, keys moved to their new positions (`positions`)."""
        T = kv.shape[2]
        if (idx == idx[:1, :1]).all():  # every head kept the same tokens: one token list
            return self._edit(kv, tokens, idx[0, 0], layout)
        out = heads.gather(kv, idx, layout.head_dim)
        if self.rerotate and self.where == "compact":
            rotate_keys(out[0], heads.compact_shift(idx), layout.rope, layout.head_dim)
        elif self.rerotate:  # one shift for every head and token
            rotate_keys(out[0], torch.full((idx.shape[-1],), idx.shape[-1] - T), layout.rope,
                        layout.head_dim)
        ids = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
                              dtype=torch.int64, device=idx.device)
        return out, ids[idx]

    def _adaptive(self, kv, layout, queries, query_start) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx [L, H_kv, S] with -1 pads, null keys): the `budget` selection (budgets.py),
        the pads' null keys from the policy's own queries."""
        window = self.captured_window(kv, layout, queries, query_start)
        T = kv.shape[2]
        units = self.units(T, layout)
        keep = T - min(self.num_drop(units) * units.size, T - 1)
        scores = self._protect(units.expand(self.unit_scores(kv, units, layout, window)))
        return budgets.selection(scores, keep, self.budget, self.alpha, window.queries, layout)

    def _equal_counts(self, what: str) -> None:
        if self.budget != "uniform":
            raise ValueError(f"{type(self).__name__}.{what} keeps an exact number of slots per "
                             f"head; budget={self.budget!r} keeps as many as its largest head "
                             "needs (kvedit.edits.budgets): use budget='uniform'")

    @property
    def where(self) -> str:
        """The positions in effect: `positions`, or its default for per_head."""
        return self.positions or ("logical" if self.per_head else "compact")

    def _new_positions(self, idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Where the kept tokens `idx` (of `num_tokens`) go: slots 0..T'-1 ("compact"), or
        each moved back by the number dropped ("logical")."""
        if self.where == "compact":
            return torch.arange(len(idx), device=idx.device)
        return idx - (num_tokens - len(idx))

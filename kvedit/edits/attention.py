"""How a request's captured queries attend to its cached keys: the core of query-aware policies.

The queries come from vLLM (kvedit's query capture, see docs/queries.md): `[L, W, Hq*D]`, the
post-RoPE (and post-q_norm) query vectors of the prompt's last W tokens, layers in the KV
layers' order, row w at prompt position `start + w`. The keys are the edited KV's `kv[0]`,
`[L, T, Hkv*D]`, post-RoPE at positions 0..T-1. Both carry RoPE at their true positions, so
`q . k` is the model's own attention logit and no re-rotation is needed.

`window_attention` is the attention each of the T tokens gets from the window:
softmax(q k^T / sqrt(D)) over the keys a query row can see among the T, per layer and query
head, then summed over rows, query heads (every query head of each KV-head group: GQA maps
query head h to KV head h // (Hq / Hkv), as transformers' repeat_kv and vLLM do) and layers.

Two things differ from the model's attention, on purpose:
- **Causal part of the window.** A row whose position is inside the edited tokens (a window
  longer than the un-edited tail, or a prompt that ends inside the last full chunk) sees
  only the keys up to its own position; rows after the T tokens see all of them.
- **Keys after the T tokens are not here.** A row in the prompt's tail also attends to the
  tail's own keys (the question), which the edit never sees (they are not in the chunks).
  Each row's softmax is therefore taken over the keys it sees among the T: the model's
  attention weights of that row restricted to the T columns and renormalised to sum to 1.
  (kvpress drops the window's columns without renormalising; with every row weighted
  alike here, a question row that looks mostly at the question itself still ranks the
  context by where its remaining attention goes.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Window:
    """The captured queries of one request and the prompt position of their first row."""
    queries: torch.Tensor  # [L, W, Hq*D], the model dtype
    start: int             # prompt position of row 0 (= len(prompt) - W)

    @property
    def rows(self) -> int:
        return self.queries.shape[1]

    def last(self, n: int) -> Window:
        """The last n rows (all if n >= rows)."""
        n = min(n, self.rows)
        return Window(self.queries[:, self.rows - n:], self.start + self.rows - n)

    def kept_in(self, num_tokens: int) -> torch.Tensor:
        """Indices of the window rows' own tokens that lie among the first `num_tokens`."""
        lo = min(num_tokens, self.start)
        return torch.arange(lo, max(lo, min(num_tokens, self.start + self.rows)),
                            device=self.queries.device)


def check_window(who: str, kv: torch.Tensor, queries, start: int | None,
                 head_dim: int) -> Window:
    """Validate `queries` against `kv` [2, L, T, Hkv*D]; `start` None = right after the T."""
    if not isinstance(queries, torch.Tensor):
        raise ValueError(f"{who}: queries must be a torch.Tensor [L, W, num_q_heads*head_dim], "
                         f"got {type(queries).__name__}")
    L, T, hidden = kv.shape[1:]
    if queries.dim() != 3 or queries.shape[0] != L or queries.shape[1] == 0:
        raise ValueError(f"{who}: queries must be [L={L}, W>0, num_q_heads*head_dim], got "
                         f"{tuple(queries.shape)} (captured for another model or layer count?)")
    hq_d = queries.shape[2]
    if hq_d % head_dim or (hq_d // head_dim) % (hidden // head_dim):
        raise ValueError(f"{who}: queries' last dimension {hq_d} is not a multiple of "
                         f"head_dim {head_dim} times the {hidden // head_dim} KV heads "
                         "(a query head count divisible by the KV head count, as GQA needs)")
    start = T if start is None else int(start)
    if start < 0:
        raise ValueError(f"{who}: query_start must be >= 0 (the prompt position of the first "
                         f"captured row), got {start}")
    return Window(queries, start)


def window_attention(kv: torch.Tensor, window: Window, head_dim: int, *,
                     layers: range | None = None, scale: float | None = None,
                     block_bytes: int = 256 << 20, heads: str = "sum",
                     per_head: bool = False, rows: str = "sum") -> torch.Tensor:
    """[T] float32: the attention the window's rows pay each token of `kv` [2, L, T, Hkv*D],
    summed over rows, query heads and the `layers` (default: all; module docstring).
    `scale` defaults to 1/sqrt(head_dim). `heads="max"` takes, per layer and row, the
    largest attention any query head pays a token instead of the sum (a token one retrieval
    head points at is not outvoted by many heads spread by position). Every row sees token 0
    (rows start at position >= 0), so every softmax is over at least one key.
    `per_head=True`: [len(layers), Hkv, T], per layer and KV head, summed over rows and the
    head's GQA group of query heads (the largest of the group with heads="max"); with
    `rows="max"` the largest over the rows instead of their sum (KVzip's score: the most
    attention a key receives from any row and any query head of its group)."""
    if heads not in ("sum", "max"):
        raise ValueError(f"window_attention: heads must be 'sum' or 'max', got {heads!r}")
    if rows not in ("sum", "max") or (rows == "max" and not per_head):
        raise ValueError(f"window_attention: rows must be 'sum', or 'max' with per_head=True, "
                         f"got rows={rows!r}, per_head={per_head}")
    L, T, hidden = kv.shape[1:]
    layers = range(L) if layers is None else layers
    hkv, d = hidden // head_dim, head_dim
    w = window.rows
    group = window.queries.shape[2] // head_dim // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # Row r (position start + r) sees token t iff t <= start + r.
    pos = torch.arange(max(T, w), device=kv.device)
    hidden_keys = pos[None, :T] > (window.start + pos[:w])[:, None]  # [w, T]
    total = torch.zeros((len(layers), hkv, T) if per_head else (T,), dtype=torch.float32,
                        device=kv.device)
    # Blocks bound the [l, Hkv, g*rows, T] float32 logits (and their softmax) to block_bytes:
    # layers first; where one layer's rows alone pass it (KVzip's ~4k rows x 4k keys: ~0.8 GB
    # a layer for a 1.5B model) rows too. Each row's softmax is its own, so row blocks are
    # exact: sums add, maxima take the larger.
    per_row = hkv * group * T * 4
    rstep = min(w, max(1, block_bytes // per_row))
    step = max(1, block_bytes // (per_row * w)) if rstep == w else 1
    for l0 in range(layers.start, layers.stop, step):
        l1 = min(layers.stop, l0 + step)
        k = kv[0, l0:l1].float().view(l1 - l0, T, hkv, d).transpose(1, 2)        # [l, Hkv, T, d]
        for r0 in range(0, w, rstep):
            r1 = min(w, r0 + rstep)
            q = window.queries[l0:l1, r0:r1].float().reshape(l1 - l0, r1 - r0, hkv, group, d)
            q = q.permute(0, 2, 3, 1, 4).reshape(l1 - l0, hkv, group * (r1 - r0), d)
            logits = (q @ k.transpose(-1, -2)) * scale                            # [l, Hkv, g*r, T]
            logits = logits.view(l1 - l0, hkv, group, r1 - r0, T).masked_fill(
                hidden_keys[r0:r1], NEG_INF)
            probs = logits.softmax(dim=-1)                                       # [l, Hkv, g, r, T]
            if per_head:
                group_heads = probs.amax(dim=2) if heads == "max" else probs.sum(dim=2)
                part = group_heads.amax(dim=2) if rows == "max" else group_heads.sum(dim=2)
                out = total[l0 - layers.start: l1 - layers.start]                 # [l, Hkv, T]
                if r0 == 0:
                    out.copy_(part)
                elif rows == "max":
                    torch.maximum(out, part, out=out)
                else:
                    out.add_(part)
                continue
            if heads == "max":
                probs = probs.amax(dim=(1, 2))                                     # [l, r, T]
            total += probs.sum(dim=tuple(range(probs.dim() - 1)))
    return total

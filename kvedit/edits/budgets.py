"""Budgets that differ per (layer, KV head), stored in vLLM's uniform block tables.

kvpress's AdaKVPress (Feng et al. 2024) lets the heads of a layer share the layer's total:
each layer keeps H x T' (layer, head, token) entries, ranked across its heads, with a
safeguard share `alpha` of T' for every head; its KVzipPress ranks every layer and head at
once (`budget="global"`). Both keep as many entries as equal counts would, but a head that
attends to few tokens gives its room to one that needs many.

vLLM gives a request one block table for all layers and heads, so every (layer, head) holds
the same number of slots. A head-adaptive selection is stored in S = the largest head count
slots: each head's kept tokens fill its last slots (sorted), and the slots in front of them
hold a *null key* (and a zero value), a key no query of that head attends to. So the edit
keeps exactly the entries the allocation chose, and costs S slots, not T': the eval's
`kept_fraction` reports the slots. At equal slots nothing beats each head keeping its own
best S tokens (the adaptive heads keep a subset of those), so what head-adaptive buys in a
paged engine is the accuracy of kvpress's allocation, at the memory its largest head needs
(docs/eval.md measures both).

The null key is kvpress's (its attention patch): a vector Y with q.Y > 0 for every query q of
the head's GQA group, found from a sample of the model's queries, and the key -s.Y, scaled
so those queries' logits are at most -NULL_MARGIN. kvpress searches Y for each decoding call
from that call's queries; here the pads are stored once, so Y comes from the queries the edit
has (the question's captured rows, KVzip's reconstruction rows, the context's own rows) and
must hold for the queries that come later. A half-space found on half of a 4k reconstruction
pass holds every other row at logits <= -46 on Qwen2.5-1.5B (docs/eval.md). A head for which
no such Y is found keeps real tokens (its next best) in its pad slots instead.
"""
from __future__ import annotations

import math

import torch

from kvedit.edits import heads
from kvedit.edits.rope import rotate_keys

BUDGETS = ("uniform", "layer", "global")
NULL_MARGIN = 50.0     # the sample queries' logits on a null key are at most -NULL_MARGIN
NULL_NORM_CAP = 1e8    # ... unless the key would need a larger norm than this (bf16-safe)


def head_counts(scores: torch.Tensor, keep: int, budget: str, alpha: float) -> torch.Tensor:
    """[L, H] tokens each (layer, head) keeps: `keep` each ("uniform"), the layer's H x keep
    ranked across its heads ("layer", AdaKV), or all L x H x keep ranked at once ("global",
    KVzip); every head keeps at least int(alpha x keep) (its best), as AdaKV's safeguard."""
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    L, H, T = scores.shape
    if not 0 < keep <= T:
        raise ValueError(f"keep must be in [1, {T}], got {keep}")
    if budget == "uniform":
        return torch.full((L, H), keep, dtype=torch.long, device=scores.device)
    s = scores.float().clone()
    safe = int(alpha * keep)
    if safe > 0:  # the safeguard: each head's best `safe` tokens outrank everything else
        top = s.topk(safe, dim=-1).indices
        s.scatter_(-1, top, float("inf"))
    flat = s.reshape(L, H * T) if budget == "layer" else s.reshape(1, L * H * T)
    n = H * keep if budget == "layer" else L * H * keep
    picked = torch.zeros_like(flat, dtype=torch.bool)
    picked.scatter_(1, torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :n], True)
    return picked.view(L, H, T).sum(dim=-1)


def ragged_indices(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[L, H, S] (S = counts.max()): each (layer, head)'s best counts[l, h] tokens, sorted,
    in its last slots; -1 in the slots in front (the pads). Stable: the earlier of equal
    scores wins, as `base.top_tokens`."""
    L, H, T = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(T, device=scores.device).expand(L, H, T))
    kept = rank < counts[..., None]
    key = torch.where(kept, torch.arange(T, device=scores.device), -1)
    S = int(counts.max())
    return key.sort(dim=-1).values[..., T - S:]


def null_keys(queries: torch.Tensor, num_kv_heads: int, head_dim: int, iters: int = 200,
              rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [L, Hkv, head_dim] float32, found [L, Hkv] bool): per (layer, KV head) a key
    whose logit for every row of `queries` [L, W, Hq*head_dim] in the head's GQA group is at
    most -NULL_MARGIN (module docstring); `found` False where no half-space holds them all
    (that head's key is zeros and must not be used). The direction is the one that keeps
    the sample's least aligned query most aligned (the widest margin found in `iters`
    steps from the mean direction: a key that barely separates the sample would turn a
    later query just across the line into the largest logit of all); at most `rows` rows of
    each head's group are used, evenly spaced."""
    L, W, width = queries.shape
    group = width // head_dim // num_kv_heads
    x = queries.float().view(L, W, num_kv_heads, group, head_dim)
    x = x.permute(0, 2, 1, 3, 4).reshape(L, num_kv_heads, W * group, head_dim)
    if x.shape[2] > rows:
        x = x[:, :, torch.linspace(0, x.shape[2] - 1, rows, device=x.device).long()]
    unit = torch.nn.functional.normalize(x, dim=-1)
    y = torch.nn.functional.normalize(unit.mean(dim=2), dim=-1)          # [L, Hkv, d]
    best, best_cos = y, (unit @ y[..., None])[..., 0].amin(-1)
    for t in range(iters):  # subgradient ascent on the smallest cosine
        cos = (unit @ y[..., None])[..., 0]
        worst = cos.argmin(-1)
        low = cos.gather(-1, worst[..., None])[..., 0]
        better = low > best_cos
        best = torch.where(better[..., None], y, best)
        best_cos = torch.where(better, low, best_cos)
        pick = unit.gather(2, worst[..., None, None].expand(L, num_kv_heads, 1, head_dim))
        y = torch.nn.functional.normalize(y + pick[:, :, 0] / (t + 2) ** 0.5, dim=-1)
    found = best_cos > 0
    least = (x @ best[..., None])[..., 0].amin(-1).clamp_min(1e-30)     # min q.y > 0
    scale = torch.clamp(NULL_MARGIN * math.sqrt(head_dim) / least, max=NULL_NORM_CAP)
    keys = -scale[..., None] * best
    return torch.where(found[..., None], keys, torch.zeros_like(keys)), found


def selection(scores: torch.Tensor, keep: int, budget: str, alpha: float,
              queries: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [L, H, S] with -1 pads, null keys [L, H, d]) of a head-adaptive selection from
    per-token `scores` [L, H, T] (protected tokens inf): `budget`'s counts, the pads' null
    keys from `queries` [L, W, Hq*d]. The last S mod chunk_size tokens are kept in every
    head (vLLM recomputes those slots from one token id each)."""
    T = scores.shape[-1]
    counts = head_counts(scores, keep, budget, alpha)
    nulls, found = null_keys(queries.to(scores.device), scores.shape[1], layout.head_dim)
    counts = torch.where(found, counts, counts.max())  # no null key: that head keeps S tokens
    # Every head keeps the last S mod chunk_size tokens, and keeps them on top of its other
    # protected (inf) tokens, a sink or a window: a head whose count were only the tail's
    # would keep the earlier inf tokens first (ties go to the earlier) and lose some of the
    # tail. Raising a count may raise S, and with it the tail: until neither moves.
    base = scores
    while True:
        tail = int(counts.max()) % layout.chunk_size
        scores = base
        if tail:
            scores = base.clone()
            scores[..., T - tail:] = float("inf")
        need = counts.clamp(min=torch.isinf(scores).sum(dim=-1).clamp(max=T))
        if torch.equal(need, counts):
            return ragged_indices(scores, counts), nulls
        counts = need


def store(kv: torch.Tensor, tokens, idx: torch.Tensor, nulls: torch.Tensor, layout,
          rerotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv [2, L, S, D], token ids [L, H, S]): the selection `idx` stored in S slots per
    head, the pads holding the null key and a zero value, every key shifted back by T - S
    (logical positions: each keeps its distance to what follows; the null keys move with
    them, so the queries that come later stay as far from them as the sample was)."""
    L, H, S = idx.shape
    d, T = layout.head_dim, kv.shape[2]
    out = heads.gather(kv, idx.clamp(min=0), d)
    pad = (idx < 0).transpose(1, 2)                                     # [L, S, H]
    if bool(pad.any()):
        k, v = out[0].view(L, S, H, d), out[1].view(L, S, H, d)
        k[pad] = nulls[:, None].expand(L, S, H, d)[pad].to(k.dtype)
        v[pad] = 0
    if rerotate:
        rotate_keys(out[0], torch.full((S,), S - T, device=kv.device), layout.rope, d)
    ids = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
                          dtype=torch.int64, device=idx.device)
    return out, ids[idx.clamp(min=0)]

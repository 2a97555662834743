"""Per-head edits on the host path: a slot may hold a different token in each (layer, KV head).

vLLM's paged cache gives a request one block table for every layer (one KV cache group), so
every (layer, KV head) must keep the same number of tokens; which token each keeps in a slot
is free once keys carry their RoPE (kvedit.edits.base). An edit fn says what it kept per
head by returning, instead of a token list, the token ids `[L, H_kv, T']` (a tensor, or
nested lists) with its kv `[2, L, T', D]`: slot t of (layer l, head h) holds token
`ids[l, h, t]`.

What stands for such a slot in the stream (`stand_ins`): the chunk keys, the prompt vLLM is
sent on the next request and `Stream.tokens` need one id per slot. kvedit takes the token
most (layer, head) pairs hold in that slot (a tie goes to the smaller id): where every head
agrees it is exact, and otherwise it is the best single description of what the slot holds.
vLLM never recomputes those slots (their KV is loaded), except the last `T' mod chunk`
ones, which only full chunks can be stored and so are sent as token ids: those must hold the
same token in every head (`check_tail`; the policies protect the prompt's last tokens in
every head for that, `protect_last`). Since a stand-in sequence does not say what each head
holds, two different per-head edits could give the same ids: the SDK stores a per-head edit
under a fresh derived salt, so no cache (the kvedit server's or vLLM's own prefix cache) can
serve another edit's blocks for it.
"""
from __future__ import annotations

import torch


def as_head_tokens(tokens, num_layers: int, num_kv_heads: int) -> torch.Tensor | None:
    """`tokens` as a [L, H_kv, T'] int64 tensor when it is per head (3 dimensions), None when
    it is one token list. ValueError when the heads keep different counts or the shape is
    not the model's."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 3:
            return None
        t = tokens
    else:
        if not isinstance(tokens, (list, tuple)) or not tokens \
                or not isinstance(tokens[0], (list, tuple, torch.Tensor)):
            return None
        counts = {(la, h): len(row) for la, layer in enumerate(tokens)
                  for h, row in enumerate(layer)}
        if len(set(counts.values())) > 1:
            lo = min(counts, key=counts.get)
            hi = max(counts, key=counts.get)
            raise ValueError(
                f"the edit keeps {counts[lo]} tokens in layer {lo[0]}, KV head {lo[1]} but "
                f"{counts[hi]} in layer {hi[0]}, KV head {hi[1]}: every (layer, KV head) must "
                "keep the same number of tokens (vLLM gives a request one block table for all "
                "layers and heads), so budgets that differ per head cannot be stored "
                "(docs/eval.md)")
        t = torch.tensor(tokens, dtype=torch.int64)
    if t.shape[:2] != (num_layers, num_kv_heads) or t.dim() != 3:
        raise ValueError(f"per-head token ids must be [L={num_layers}, H_kv={num_kv_heads}, "
                         f"T'], got {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"per-head token ids must be integers, got {t.dtype}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= 2**32):
        raise ValueError("per-head token ids must be token ids in [0, 2**32)")
    return t.to(torch.int64)


def stand_ins(head_tokens: torch.Tensor) -> list[int]:
    """One id per slot: the token most (layer, head) pairs hold there; ties to the smaller."""
    L, H, T = head_tokens.shape
    if T == 0:
        return []
    flat = head_tokens.reshape(L * H, T).sort(dim=0).values      # per slot, ascending ids
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    run = start.long().cumsum(dim=0) - 1                        # the run of equal ids a row is in
    counts = torch.zeros_like(flat).scatter_add_(0, run, torch.ones_like(flat))
    values = torch.zeros_like(flat).scatter_(0, run, flat)
    best = counts.argmax(dim=0, keepdim=True)   # the first longest run: the smaller id wins
    return values.gather(0, best)[0].tolist()


def check_tail(head_tokens: torch.Tensor, chunk: int) -> None:
    """ValueError unless the slots after the last full chunk hold one token in every head
    (vLLM recomputes them from one token id each)."""
    T = head_tokens.shape[-1]
    tail = head_tokens[..., T // chunk * chunk:]
    if tail.numel() == 0:
        return
    flat = tail.reshape(-1, tail.shape[-1])
    differ = (flat != flat[:1]).any(dim=0).nonzero().flatten()
    if differ.numel():
        slot = T // chunk * chunk + int(differ[0])
        raise ValueError(
            f"slot {slot} holds different tokens in different heads, but the last {T % chunk} "
            f"of the {T} kept slots are past the last full chunk of {chunk}: vLLM recomputes "
            f"them from one token id each. Keep the prompt's last tokens in every head "
            f"(protect_last >= {T % chunk}; the policies' __call__ does it) or keep a whole "
            f"number of chunks")

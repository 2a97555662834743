"""Compaction of one request's KV inside vLLM's paged cache: the data movement of an
in-engine budget, pure torch over `PagedKV` (no vLLM import; tested on any machine).

A request's resident tokens sit in slots 0..R-1 of its block list. A compaction gathers
them into one tensor [2, L, R, D] (`gather`), lets the policy pick the kept slots (`keep`,
[R'] or per head [L, H, R']), builds the kept KV in order (`kept_kv`: per head, each head
takes its own slots), and scatters it to slots 0..R'-1 of the request's new block list
(`scatter`). Every read of a step happens before any write (the caller gathers all
compactions and stashes first), so a block may be both a source and, after the scheduler
handed it to someone else, a target in the same step. Kept slots that stay where they are
(the leading ones before the first dropped slot, in a block written in place) already hold
their bytes: `unmoved` counts them, and a compaction reads and writes only the rest.

Positions. With "compact" positions slot j always holds the key rotated to position j: the
kept keys are re-rotated from their old slot index to their new one (per head when per
head). With "logical" positions keys keep the rotation of the position they were computed
at, and nothing is rotated here.
"""
from __future__ import annotations

import torch

from kvedit.edits.rope import rotate_keys
from kvedit.layout import ModelLayout
from kvedit.vllm.paged import PagedKV


def gather(paged: PagedKV, block_ids: list[int], n: int) -> torch.Tensor:
    """Slots 0..n-1 of a request's blocks as [2, L, n, D] on the cache's device."""
    out = torch.empty((2, paged.num_layers, n, paged.hidden), dtype=paged.dtype,
                      device=paged.device)
    paged.gather(paged.slots(block_ids, 0, n), out)
    return out


def gather_kept(paged: PagedKV, block_ids: list[int], keep: torch.Tensor, layout: ModelLayout,
                positions: str, start: int = 0) -> torch.Tensor:
    """`kept_kv` of the slots `keep` [R'] read straight from the paged cache (a policy that
    scores by position alone needs no other slot), from kept slot `start` on: [2, L, R' -
    start, D], bound for slots start..R'-1."""
    keep = keep[start:]
    out = torch.empty((2, paged.num_layers, keep.numel(), paged.hidden), dtype=paged.dtype,
                      device=paged.device)
    paged.gather(paged.slots_at(block_ids, keep.cpu()), out)
    return _rotate(out, keep, layout, positions, start)


def gather_many(paged: PagedKV, block_lists: list[list[int]], n: int) -> torch.Tensor:
    """Slots 0..n-1 of N requests' blocks in one gather: [2, L, N, n, D] (request i at
    [:, :, i])."""
    out = torch.empty((2, paged.num_layers, len(block_lists) * n, paged.hidden),
                      dtype=paged.dtype, device=paged.device)
    pos = torch.arange(n, dtype=torch.int64)
    paged.gather(paged.slots_many([(ids, pos) for ids in block_lists]), out)
    return out.view(2, paged.num_layers, len(block_lists), n, paged.hidden)


def scatter(paged: PagedKV, block_ids: list[int], kv: torch.Tensor, start: int = 0) -> None:
    """Write `kv` [2, L, n, D] into slots start..start+n-1 of a request's blocks."""
    paged.scatter(paged.slots(block_ids, start, start + kv.shape[2]), kv)


def unmoved(keep: torch.Tensor, old_blocks: list[int], new_blocks: list[int],
            block_size: int) -> int:
    """How many leading kept slots stay where they are: slot j keeps slot j (in every head)
    in a block that is the same before and after. Their bytes need no copy (with compact
    positions their rotation is by 0). `keep` is [R'] or [L, H, R'], on any device (on a
    device this waits for it: callers pass host indices where they have them)."""
    n = keep.shape[-1]
    same = next((i for i, (a, b) in enumerate(zip(old_blocks, new_blocks)) if a != b),
                min(len(old_blocks), len(new_blocks)))
    limit = min(n, same * block_size)
    if limit == 0:
        return 0
    moved = (keep[..., :limit] != torch.arange(limit, device=keep.device))
    if moved.dim() > 1:
        moved = moved.flatten(0, -2).any(0)
    first = moved.nonzero()
    return int(first[0]) if first.numel() else limit


def kept_kv(kv: torch.Tensor, keep: torch.Tensor, layout: ModelLayout,
            positions: str, start: int = 0) -> torch.Tensor:
    """The kept tokens of `kv` [2, L, R, D] in slot order, from kept slot `start` on: `keep`
    is [R'] (every head the same) or [L, H, R'] (per head). "compact" positions re-rotate
    kept keys from slot i to their new slot j; "logical" leaves them as they are. Returns a
    new [2, L, R' - start, D], bound for slots start..R'-1."""
    L, R, D = kv.shape[1:]
    hd = layout.head_dim
    if keep.dim() == 1:
        keep = keep[start:]
        return _rotate(kv.index_select(2, keep), keep, layout, positions, start)
    H = keep.shape[1]
    if keep.shape[0] != L or H * hd != D:
        raise ValueError(f"per-head kept slots of shape {tuple(keep.shape)} do not fit KV "
                         f"{tuple(kv.shape)} with head_dim {hd}")
    keep = keep[..., start:]
    n = keep.shape[2]
    heads = kv.view(2, L, R, H, hd)
    idx = keep.permute(0, 2, 1)                                     # [L, n, H]
    out = torch.gather(heads, 2, idx[None, :, :, :, None].expand(2, L, n, H, hd))
    out = out.reshape(2, L, n, D)
    if positions == "compact":
        delta = torch.arange(start, start + n, device=keep.device)[None, :, None] - idx
        rotate_keys(out[0], delta, layout.rope, hd)
    return out


def kept_kv_many(kv: torch.Tensor, keep: torch.Tensor, layout: ModelLayout,
                 positions: str) -> torch.Tensor:
    """`kept_kv` of N requests at once: `kv` [2, L, N, R, D], `keep` [N, R'] or per head
    [N, L, H, R'] (`PromptAnchored.select_many`). Returns [2, L, N * R', D]: request i's
    kept KV at tokens i*R'..(i+1)*R'-1, bound for its slots 0..R'-1."""
    L, N, R, D = kv.shape[1:]
    hd = layout.head_dim
    n = keep.shape[-1]
    if keep.dim() == 2:
        idx = keep[:, :, None]                                           # [N, n, 1]
        out = torch.gather(kv, 3, idx[None, None].expand(2, L, N, n, D))
    else:
        H = keep.shape[2]
        if keep.shape[:2] != (N, L) or H * hd != D:
            raise ValueError(f"per-head kept slots of shape {tuple(keep.shape)} do not fit KV "
                             f"{tuple(kv.shape)} with head_dim {hd}")
        idx = keep.permute(1, 0, 3, 2)                                   # [L, N, n, H]
        heads = kv.view(2, L, N, R, H, hd)
        out = torch.gather(heads, 3, idx[None, ..., None].expand(2, L, N, n, H, hd))
    out = out.reshape(2, L, N * n, D)
    if positions == "compact":
        if keep.dim() == 2:  # one shift per token: [N * n], every layer and head alike
            rotate_keys(out[0], (torch.arange(n, device=keep.device) - keep).reshape(-1),
                        layout.rope, hd)
        else:
            delta = torch.arange(n, device=keep.device)[None, None, :, None] - idx
            rotate_keys(out[0].view(L, N, n, D), delta, layout.rope, hd)
    return out


def _rotate(out: torch.Tensor, keep: torch.Tensor, layout: ModelLayout,
            positions: str, start: int = 0) -> torch.Tensor:
    """Compact positions: the kept keys `out[0]` from their old slots `keep` [n] to
    start..start+n-1. Kept slots that stay where they are (the leading ones) are skipped when
    `keep` is on the host; on a device every slot is rotated (by 0 for those: exact), since
    finding the first moved slot there would make the host wait for the device."""
    if positions != "compact":
        return out
    new = torch.arange(start, start + keep.numel(), device=keep.device)
    lo = 0
    if keep.device.type == "cpu":
        moved = (new != keep).nonzero()
        if not moved.numel():
            return out
        lo = int(moved[0])
    delta = (new[lo:] - keep[lo:]).to(out.device, non_blocking=True)
    rotate_keys(out[0, :, lo:], delta, layout.rope, layout.head_dim)
    return out

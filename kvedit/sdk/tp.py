"""Tensor parallel: one [2, L, T, all_kv_heads * head_dim] KV from the ranks' chunks, and back.

With tensor parallel n, vLLM's rank r holds only some KV heads, and the connector stores each
rank's chunks under that rank's own keys (the key namespace binds tp_rank/tp_size). An edit
function sees every head at once, so the SDK gathers the ranks' tensors into one before `fn`
and scatters `fn`'s result back per rank after it. How vLLM splits the heads
(QKVParallelLinear):
- n <= total KV heads: rank r holds heads [r*h, (r+1)*h), h = total // n (n must divide it);
- n > total KV heads: each rank holds one head, head r // (n // total), i.e. every head is
  replicated on n // total consecutive ranks (total must divide n).

Pure functions (no server, no vLLM, no copies beyond the one `torch.cat`); scatter returns
views of the edited tensor. The per-rank fields of a layout do not say the model's total KV
head count (with replication, 1 head per rank fits several totals): the connector registers
it as `ModelLayout.total_kv_heads`, or the user passes `connect(..., total_kv_heads=)`.
`TPRanks` is what a context keeps: the ranks' layouts, their head split and the layout of
the gathered tensor that fn sees. modify (kvedit.sdk.modify) runs its one set of steps over
every rank: kvedit.sdk.source fills the gathered kv rank by rank (`TPHeads.columns`), and
kvedit.sdk.store stores `scatter_ranks`'s pieces under each rank's keys.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kvedit.layout import ModelLayout


@dataclass(frozen=True)
class TPHeads:
    """How `total_kv_heads` heads of `head_dim` are spread over `tp_size` ranks."""
    tp_size: int
    total_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("tp_size", "total_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TPHeads.{name} must be positive, got {getattr(self, name)}")
        n, h = self.tp_size, self.total_kv_heads
        if (n <= h and h % n) or (n > h and n % h):
            raise ValueError(f"tensor parallel {n} over {h} KV heads: expected one to divide "
                             "the other (vLLM's split)")

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def replicas(self) -> int:
        """How many ranks hold each head (1 unless tp_size > total_kv_heads)."""
        return max(1, self.tp_size // self.total_kv_heads)

    def heads_of(self, rank: int) -> range:
        """The global KV heads rank `rank` holds, in its order."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside [0, {self.tp_size})")
        first = rank // self.replicas * self.heads_per_rank
        return range(first, first + self.heads_per_rank)

    def columns(self, rank: int) -> slice:
        """Where rank `rank`'s heads lie in the last dimension of the gathered tensor."""
        heads = self.heads_of(rank)
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def source_ranks(self) -> list[int]:
        """One rank per distinct head group, in head order: the ranks a gather reads."""
        return list(range(0, self.tp_size, self.replicas))


def tp_heads(layouts: Sequence[ModelLayout], total_kv_heads: int) -> TPHeads:
    """TPHeads for the ranks' registered layouts (one per rank, in rank order), checking that
    they describe one model split the way vLLM splits it."""
    if not layouts:
        raise ValueError("no rank layouts")
    first = layouts[0]
    n = first.tp_size
    if len(layouts) != n or [lay.tp_rank for lay in layouts] != list(range(n)):
        raise ValueError(f"rank layouts: expected ranks 0..{n - 1} of tp_size {n} in order, got "
                         f"{[(lay.tp_rank, lay.tp_size) for lay in layouts]}")
    same = ("num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_size", "tp_size",
            "num_q_heads")
    for lay in layouts[1:]:
        diff = [f for f in same if getattr(lay, f) != getattr(first, f)]
        if diff:
            raise ValueError(f"rank {lay.tp_rank}'s layout differs from rank 0's in {diff}")
    said = {lay.total_kv_heads for lay in layouts} - {0}
    if said and said != {total_kv_heads}:
        raise ValueError(f"the ranks registered total_kv_heads {sorted(said)}, not "
                         f"{total_kv_heads}")
    heads = TPHeads(n, total_kv_heads, first.head_dim)
    if heads.heads_per_rank != first.num_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads over {n} ranks gives {heads.heads_per_rank} "
                         f"per rank; the layouts say {first.num_kv_heads}")
    return heads


def _check(t: torch.Tensor, what: str, hidden: int) -> None:
    if t.dim() != 4 or t.shape[0] != 2 or t.shape[3] != hidden:
        raise ValueError(f"{what} of shape {tuple(t.shape)}: expected [2, L, T, {hidden}]")


def gather_ranks(per_rank: Sequence[torch.Tensor], heads: TPHeads) -> torch.Tensor:
    """The ranks' KV tensors [2, L, T, heads_per_rank*D] (index = rank) as one
    [2, L, T, total_kv_heads*D], heads in the model's order. Replicated heads are read from
    the first rank holding them."""
    if len(per_rank) != heads.tp_size:
        raise ValueError(f"{len(per_rank)} rank tensors for tensor parallel {heads.tp_size}")
    hidden = heads.heads_per_rank * heads.head_dim
    for r, t in enumerate(per_rank):
        _check(t, f"rank {r}'s KV", hidden)
        if t.shape != per_rank[0].shape or t.dtype != per_rank[0].dtype \
                or t.device != per_rank[0].device:
            raise ValueError(f"rank {r}'s KV {tuple(t.shape)} {t.dtype} {t.device} differs from "
                             f"rank 0's {tuple(per_rank[0].shape)} {per_rank[0].dtype} "
                             f"{per_rank[0].device}")
    return torch.cat([per_rank[r] for r in heads.source_ranks()], dim=-1)


def scatter_ranks(kv: torch.Tensor, heads: TPHeads) -> list[torch.Tensor]:
    """`kv` [2, L, T, total_kv_heads*D] split back per rank (index = rank): views of `kv`,
    the same view for ranks that replicate a head. T may differ from the gathered one (an
    edit that dropped tokens)."""
    _check(kv, "the edited KV", heads.total_kv_heads * heads.head_dim)
    pieces = kv.split(heads.heads_per_rank * heads.head_dim, dim=-1)
    return [pieces[heads.heads_of(r).start // heads.heads_per_rank]
            for r in range(heads.tp_size)]


@dataclass(frozen=True)
class TPRanks:
    """A tensor-parallel model as the SDK edits it: every rank's layout (index = rank), how
    the heads are split, and `layout`, the layout of the gathered tensor fn gets (all KV heads
    and, where the ranks say them, all query heads; one rank: tp_rank 0, tp_size 1,
    total_kv_heads not said). vLLM splits query heads without replicas, so the gathered
    query heads are the ranks' sum."""
    layouts: tuple[ModelLayout, ...]
    heads: TPHeads
    layout: ModelLayout

    @property
    def size(self) -> int:
        return self.heads.tp_size


def tp_ranks(layouts: Sequence[ModelLayout], total_kv_heads: int | None = None) -> TPRanks:
    """TPRanks from the ranks' registered layouts (rank order). The total KV head count is
    the one the layouts say, else `total_kv_heads`; ValueError naming what is missing or
    inconsistent."""
    said = {lay.total_kv_heads for lay in layouts} - {0}
    if total_kv_heads is None:
        if len(said) != 1:
            raise ValueError(
                f"the model's total KV head count is needed to gather its {len(layouts)} "
                f"ranks' heads, and its rank layouts do not say it (a kvedit connector older "
                f"than ModelLayout.total_kv_heads registered them): pass connect(..., "
                f"total_kv_heads=N), N = the model config's num_key_value_heads")
        total_kv_heads = said.pop()
    heads = tp_heads(layouts, total_kv_heads)
    gathered = msgspec.structs.replace(layouts[0], num_kv_heads=heads.total_kv_heads,
                                       tp_rank=0, tp_size=1, total_kv_heads=0,
                                       num_q_heads=layouts[0].num_q_heads * heads.tp_size)
    return TPRanks(tuple(layouts), heads, gathered)

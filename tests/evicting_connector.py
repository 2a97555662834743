"""kvedit's connector with another client flooding the server between lookup and load, for
tests/engine/test_connector_race.py.

vLLM imports this module (kv_connector_module_path) in its engine process. Everything is the
real connector; only a step's metadata, once built with loads in it (the lookups of that
step are done, the workers' loads not yet), is followed, when the file named by
$KVEDIT_TEST_FLOOD_FILE says so, by a second client storing chunks of another model (same
chunk size) until the server's pool is full: every chunk that can be evicted is. That is what
concurrent requests of other engines (or the SDK) do to a small pool between vLLM's
scheduling of a request and its workers' load, made certain instead of rare. The file says
"off", "flood" or "flood-nopin" (the same, with this engine's pins turned off: the race the
pins close, shown happening).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from kvedit.client import KVClient, KVError
from kvedit.vllm import scheduler_side
from kvedit.vllm.connector import KVEditConnector

FLOOD_FILE_ENV = "KVEDIT_TEST_FLOOD_FILE"
FLOOD_MODEL = "flood"
_lookup = scheduler_side.SchedulerSide.get_num_new_matched_tokens
_build_meta = scheduler_side.SchedulerSide.build_meta


def _mode() -> str:
    try:
        return Path(os.environ[FLOOD_FILE_ENV]).read_text().strip()
    except (KeyError, OSError):
        return "off"


def _flood(side) -> None:
    layout = side.layouts[0]
    zeros = torch.zeros(layout.chunk_shape, dtype=getattr(torch, layout.dtype))
    with KVClient(side.settings.kvedit_url) as c:
        c.register(FLOOD_MODEL, layout)
        pool_chunks = c.server_info().pool_bytes // layout.chunk_bytes
        for _ in range(pool_chunks + 1):
            try:
                c.store(FLOOD_MODEL, [os.urandom(16)], [zeros])
            except KVError as e:
                if e.code != "pool_full":   # everything left is leased: done
                    raise
                return


def _lookup_maybe_unpinned(self, request, num_computed_tokens: int):
    self.pins.max_chunks = 0 if _mode() == "flood-nopin" else self.settings.transfer.pin_max_chunks
    return _lookup(self, request, num_computed_tokens)


def _build_meta_then_flood(self, out):
    meta = _build_meta(self, out)
    if meta.loads and _mode().startswith("flood"):
        _flood(self)
    return meta


scheduler_side.SchedulerSide.get_num_new_matched_tokens = _lookup_maybe_unpinned
scheduler_side.SchedulerSide.build_meta = _build_meta_then_flood


class EvictingConnector(KVEditConnector):
    pass

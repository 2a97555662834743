"""Repair inside vLLM (tiny Qwen3, float32, in-engine budgets on): a budget whose policy is
`repair` (kvedit.edits.Repair over a query-agnostic base) compacts a request at its first
compaction with the question's queries, as the host path's repair selects.

References: the host path (prefill with the question's queries captured, modify with the same
Repair, decode on the edited KV from the server) for the continuation, token for token; and
vLLM's own `cached_tokens` for what a request loaded from the kvedit server instead of
computing it.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from kvedit.engine_budget import EngineBudget
from kvedit.edits import Repair
from kvedit.request_params import RequestAsks
from tests.engine.test_in_engine import MODEL, greedy, host_path, post, prompt_of
from tests.fixtures_vllm import CHUNK

P, KEEP, EVERY, N, W = 2 * CHUNK, CHUNK, 64, 40, 32
ARGS = {"base": "key_norm", "restore": 0.5}


@pytest.fixture(scope="module")
def engine(tiny_model, kv_server):
    from kvedit.launch.vllm import start_vllm

    with start_vllm(tiny_model, server=kv_server, served_model_name=MODEL, dtype="float32",
                    kv_cache_gib=0.5, max_model_len=4096, chunk_size=CHUNK, dev_mode=True,
                    connector_config={"in_engine": True, "stats_interval_s": 0}) as vp:
        yield vp


def test_a_repair_budget_selects_as_the_host_paths_repair(engine, kv_server):
    """The engine's first compaction comes right after the prompt, its recent-queries ring
    holding the prompt's last W queries: the same queries the host path captures."""
    prompt = prompt_of(P, seed=71)
    host, host_lp = host_path(engine, kv_server, prompt,
                              Repair(0.5, protect_last=W, **ARGS), N, capture_queries=W)
    eng, eng_lp = greedy(engine, prompt, N + 1,
                         EngineBudget(KEEP + EVERY, EVERY, "repair", ARGS, protect=W, queries=W))
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-4)
    base, _ = greedy(engine, prompt, N + 1,
                     EngineBudget(KEEP + EVERY, EVERY, "key_norm", {}, protect=W))
    assert base != eng, "the question's half of the budget changed nothing"


def ask(engine, prompt, salt, budget, capture: int = 0) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt,
            "kv_transfer_params": RequestAsks(store_eager=True, capture=capture,
                                              budget=budget).to_params()}
    r = post(engine, body)
    assert "choices" in r, r
    return r["usage"]


def test_a_new_turn_loads_its_original_context_only_when_it_also_asks_for_capture(engine):
    """A turn's context chunks, stored by the first turn, are loaded from the kvedit server
    by a later turn whose repair budget also asks to capture its question's queries (the
    window is computed, what precedes it loaded); without that ask a query-aware budget
    computes its whole prompt."""
    context, salt = prompt_of(P, seed=72), uuid.uuid4().hex
    budget = EngineBudget(KEEP + EVERY, EVERY, "repair", ARGS, protect=W, queries=W)
    ask(engine, context + prompt_of(W, seed=73), salt,
        EngineBudget(KEEP + EVERY, EVERY, "key_norm", {}))     # turn 1 stores the context
    alone = ask(engine, context + prompt_of(W, seed=74), salt, budget)
    loaded = ask(engine, context + prompt_of(W, seed=75), salt, budget, capture=W)
    assert (alone.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert loaded["prompt_tokens_details"]["cached_tokens"] >= P

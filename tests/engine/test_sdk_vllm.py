"""The SDK end to end on a real vLLM (tiny Qwen3, float32) with the kvedit connector.

Tolerance: the SDK path computes the same KV in two pieces (connector-loaded chunks + the
recomputed suffix), so greedy tokens must match exactly and logprobs within LOGPROB_ATOL.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid

import httpx
import pytest
import torch

from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256
LOGPROB_ATOL = 1e-3


_seed = iter(range(1, 10_000))


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + next(_seed))
    return torch.randint(10, 8000, (n,), generator=g).tolist()


def direct(post, tokens, n: int) -> tuple[list[int], list[float]]:
    """One plain request (its own salt, so no cache from the SDK's requests can serve it)."""
    async def go():
        ids, lps = [], []
        async for e in post(tokens, {**GREEDY, "max_tokens": n}, f"direct-{uuid.uuid4().hex}"):
            ids.append(e.token_id)
            lps.append(e.logprob)
        await post.aclose()
        return ids, lps
    return asyncio.run(go())


def reset_prefix_cache(vllm_server) -> None:
    """Empty vLLM's own prefix cache so the next request must load from the connector."""
    httpx.post(f"{vllm_server.base_url}/reset_prefix_cache", timeout=30).raise_for_status()


def assert_close(a: list[float], b: list[float], atol=LOGPROB_ATOL) -> None:
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= atol, (a, b)


def identity(kv, tokens):
    return kv, tokens


def test_identity_edit_decodes_like_a_direct_request(ctx, post, vllm_server):
    p = prompt(2 * C + 88)
    ref_ids, ref_lps = direct(post, p, 9)
    batch = BatchedStream([create_request(ctx, post, p)], progress=False)
    pre = batch.prefill(GREEDY)
    assert pre.input_tokens == len(p) and pre.output_tokens == 1
    m = batch.modify(identity)
    assert (m.chunks_reused, m.chunks_stored, m.salt_changes) == (2, 0, 0)
    reset_prefix_cache(vllm_server)
    dec = batch.decode({**GREEDY, "max_tokens": 8})
    s = batch.streams[0]
    assert s.output_token_ids == ref_ids
    assert_close(s.logprobs, ref_lps)
    assert dec.cached_tokens >= 2 * C  # both chunks came from the kvedit server


def test_pipelined_run_with_identity_matches_direct(ctx, post, vllm_server):
    prompts = [prompt(C + 40 * i) for i in range(3)]
    refs = [direct(post, p, 6)[0] for p in prompts]
    batch = BatchedStream([create_request(ctx, post, p) for p in prompts], progress=False)
    m = batch.run(GREEDY, identity, {**GREEDY, "max_tokens": 5})
    assert [s.output_token_ids for s in batch] == refs
    assert m.output_tokens == 3 * 6 and m.parts["modify"].chunks_reused == 3


def test_zeroing_v_changes_what_vllm_decodes(ctx, post, vllm_server):
    p = prompt(2 * C + 20)
    ref_ids, ref_lps = direct(post, p, 9)

    def zero_v(kv, tokens):
        kv[1].zero_()
        return kv, tokens

    batch = BatchedStream([create_request(ctx, post, p, cache_salt="zv")], progress=False)
    batch.prefill(GREEDY)
    m = batch.modify(zero_v)
    s = batch.streams[0]
    assert m.salt_changes == 1 and s.cache_salt.startswith("zv~kvedit-")
    reset_prefix_cache(vllm_server)
    dec = batch.decode({**GREEDY, "max_tokens": 8})
    assert dec.cached_tokens >= 2 * C  # the edited chunks were loaded ...
    assert s.output_token_ids[0] == ref_ids[0]  # (prefill ran on the original KV)
    diffs = [abs(x - y) for x, y in zip(s.logprobs[1:], ref_lps[1:])]
    assert s.output_token_ids[1:] != ref_ids[1:] or max(diffs) > 0.05  # ... and used


def test_dropping_chunks_shortens_the_decode_prompt(ctx, post, vllm_server):
    p = prompt(4 * C + 50)

    def drop_middle(kv, tokens):  # keep chunks 0 and 3
        return torch.cat([kv[:, :, :C], kv[:, :, 3 * C:]], dim=2), tokens[:C] + tokens[3 * C:]

    batch = BatchedStream([create_request(ctx, post, p)], progress=False)
    batch.prefill(GREEDY)
    m = batch.modify(drop_middle)
    assert (m.chunks_reused, m.chunks_stored, m.chunks_deleted) == (1, 1, 3)
    reset_prefix_cache(vllm_server)
    dec = batch.decode({**GREEDY, "max_tokens": 4})
    s = batch.streams[0]
    g = s.generations[-1]
    assert g.prompt_tokens == 2 * C + 50 + 1  # not the original 4*C+50
    assert dec.input_tokens == g.prompt_tokens
    assert g.cached_tokens >= 2 * C  # the external hit covers both edited chunks
    assert len(s.output_token_ids) == 5


@pytest.mark.parametrize("fn, reason", [
    (lambda kv, t: (kv[:, :, :, :-1], t), "shape"),
    (lambda kv, t: (kv.half(), t), "dtype torch.float16"),
    (lambda kv, t: (kv, t[:-1]), "len(tokens)"),
    (lambda kv, t: (_ for _ in ()).throw(RuntimeError("inside fn")), "inside fn"),
])
def test_bad_edit_keeps_original_and_decode_works(ctx, post, vllm_server, fn, reason):
    p = prompt(C + 30)
    ref_ids, ref_lps = direct(post, p, 4)
    batch = BatchedStream([create_request(ctx, post, p)], progress=False)
    batch.prefill(GREEDY)
    s = batch.streams[0]
    with pytest.raises(ModifyError) as exc:
        batch.modify(fn)
    assert s.label in str(exc.value) and reason in str(exc.value)
    assert ctx.client.lookup(ctx.model, s.keys) == 1 and s.tokens == p
    reset_prefix_cache(vllm_server)
    batch.decode({**GREEDY, "max_tokens": 3})
    assert s.output_token_ids == ref_ids
    assert_close(s.logprobs, ref_lps)


@pytest.mark.parametrize("n", [C + 44, 100])
def test_lengths_not_multiple_of_chunk_and_shorter_than_chunk(ctx, post, vllm_server, n):
    p = prompt(n)
    ref_ids, _ = direct(post, p, 5)
    batch = BatchedStream([create_request(ctx, post, p)], progress=False)
    batch.prefill(GREEDY)
    m = batch.modify(identity)
    assert m.streams_skipped == (n < C)
    s = batch.streams[0]
    assert len(s.tokens) == (C if n > C else n) and s.prompt == p + ref_ids[:1]
    batch.decode({**GREEDY, "max_tokens": 4})
    assert s.output_token_ids == ref_ids


def test_cache_salt_isolates_streams_with_the_same_prompt(ctx, post, vllm_server):
    p = prompt(2 * C + 5)
    ref_ids, ref_lps = direct(post, p, 6)
    a = create_request(ctx, post, p, cache_salt="salt-a")
    b = create_request(ctx, post, p, cache_salt="salt-b")
    assert not set(a.keys) & set(b.keys)
    BatchedStream([a, b], progress=False).prefill(GREEDY)

    def zero_v(kv, tokens):
        kv[1].zero_()
        return kv, tokens

    BatchedStream([a], progress=False).modify(zero_v)
    assert ctx.client.lookup(ctx.model, b.keys, wait_timeout=30) == 2
    reset_prefix_cache(vllm_server)
    BatchedStream([a, b], progress=False).decode({**GREEDY, "max_tokens": 5})
    assert b.output_token_ids == ref_ids  # untouched by a's edit
    assert_close(b.logprobs, ref_lps)
    assert a.logprobs[1:] != pytest.approx(ref_lps[1:], abs=0.05) or \
        a.output_token_ids != ref_ids


LMCACHE_SCRIPT = '''
import json, sys
import httpx
# The only lines changed from the LMCache SDK version are these three imports.
from kvedit.sdk.kvcache import connect, close
from kvedit.sdk.stream import create_request
from kvedit.sdk.batch import LMCacheBatchedStream

URL, HTTP_URL, BASE_URL, MODEL = sys.argv[1:5]


class TokenEvent:
    def __init__(self, token_id):
        self.token_id = token_id


def post_completion(prompt_token_ids, sampling_params, cache_salt):
    body = {"model": MODEL, "prompt": prompt_token_ids, "stream": True, "logprobs": 0,
            **sampling_params}
    if cache_salt:
        body["cache_salt"] = cache_salt
    with httpx.stream("POST", BASE_URL + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    for tok in (choice.get("logprobs") or {}).get("tokens") or []:
                        yield TokenEvent(int(tok.split(":")[1]))


def drop_first_chunk(kv, tokens):
    return kv[:, :, 256:].clone(), tokens[256:]


ctx = connect(URL, HTTP_URL, MODEL)
batch = LMCacheBatchedStream()
for i in range(2):
    batch.add(create_request(ctx, post_completion, [(7 * i + j) % 5000 + 10 for j in range(600)]))
params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
m1 = batch.prefill(params)
m2 = batch.modify(drop_first_chunk)
m3 = batch.decode(params)
print(json.dumps({"input_tokens": m1.input_tokens, "input_tput": m1.input_tput,
                  "duration": m2.duration, "output_tokens": m3.output_tokens,
                  "output_tput": m3.output_tput}))
close(ctx)
'''


def test_lmcache_sdk_script_runs_with_only_its_imports_changed(kv_server, vllm_server, tmp_path):
    script = tmp_path / "lmcache_script.py"
    script.write_text(textwrap.dedent(LMCACHE_SCRIPT))
    env = {**os.environ, "KVEDIT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, str(script), kv_server.url, kv_server.http_url,
                          vllm_server.base_url, vllm_server.model], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["input_tokens"] == 1200 and m["output_tokens"] == 12 and m["duration"] > 0

"""Edit during decode on the real vLLM (tiny Qwen3, float32) with the kvedit connector:
decode -> modify -> decode over prompt + generated tokens, any number of rounds (issue 11).

The connector stores the full chunks of generated tokens as well (store_generated, on by
default); a stream references them (Stream.kv_tokens / keys), modify edits them, and the
chunks an edit replaced are deleted once no stream uses them. Every check below reads the
kvedit server (lookup) or vLLM's own output, not the SDK's counters.
"""
from __future__ import annotations

import asyncio

import pytest

from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.stream import create_request
from tests.engine.test_sdk_vllm import C, direct, identity, prompt, reset_prefix_cache
from tests.fixtures_vllm import GREEDY



def present(ctx, keys) -> list[bool]:
    """Per key: is it in the kvedit server?"""
    return [ctx.client.lookup(ctx.model, [k]) == 1 for k in keys]


def test_identity_edits_between_rounds_reproduce_uninterrupted_decoding(ctx, post, vllm_server):
    p = prompt(C + 100)
    rounds = [200, 300, 150]  # crosses chunk boundaries inside generated text
    ref, _ = direct(post, p, 1 + sum(rounds))
    s = create_request(ctx, post, p)
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    edited = []
    for n in rounds:
        m = batch.modify(identity)
        edited.append(m.tokens_before)
        assert (m.chunks_stored, m.salt_changes) == (0, 0)
        reset_prefix_cache(vllm_server)  # the next decode must load every chunk it can
        dec = batch.decode({**GREEDY, "max_tokens": n})
        assert dec.cached_tokens >= len(s.tokens)
    assert s.output_token_ids == ref  # token for token
    # modify covered the generated tokens' chunks too (stored by the connector)
    assert edited == [C, (C + 100 + 200) // C * C, (C + 100 + 500) // C * C]
    assert len(s.keys) == s.kv_tokens // C == (C + 100 + 1 + sum(rounds) - 1) // C
    assert all(present(ctx, s.keys))


def test_truncating_generated_chunks_continues_like_the_shortened_sequence(ctx, post, vllm_server):
    """Positions: after an edit vLLM positions by the new length. Keeping only the first
    chunk (causal: its KV does not depend on what follows) must continue exactly like a
    direct request on the shortened sequence."""
    p = prompt(C + 30)
    s = create_request(ctx, post, p, cache_salt="trunc")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    batch.decode({**GREEDY, "max_tokens": 2 * C})
    before, old_keys = list(s.output_token_ids), list(s.keys)
    assert len(old_keys) == 3  # prompt chunk + two chunks reaching into generated text
    m = batch.modify(lambda kv, t: (kv[:, :, :C], t[:C]))
    assert (m.tokens_before, m.tokens_after, m.chunks_deleted) == (3 * C, C, 2)
    assert present(ctx, old_keys) == [True, False, False]  # replaced chunks freed
    assert s.prompt == p[:C] + (p + before)[3 * C:]
    ref, _ = direct(post, s.prompt, 40)
    reset_prefix_cache(vllm_server)
    batch.decode({**GREEDY, "max_tokens": 40})
    assert s.output_token_ids[:len(before)] == before  # nothing before the edit changed
    assert s.output_token_ids[len(before):] == ref
    assert s.generations[-1].prompt_tokens == C + (C + 30 + len(before)) - 3 * C


def test_drop_rounds_free_what_they_replace_but_not_what_others_use(ctx, post, vllm_server):
    from kvedit.edits import StreamingLLM

    p = prompt(2 * C)
    a, b = (create_request(ctx, post, p, cache_salt="shared") for _ in range(2))
    batch = BatchedStream([a, b], progress=False)
    batch.prefill(GREEDY)
    prompt_keys = list(a.keys)
    assert prompt_keys == b.keys and ctx.refs[prompt_keys[0]] == 2
    seen: set[bytes] = set(prompt_keys)
    policy = StreamingLLM(sink=C, window=C)  # keep 2 chunks: the first and the last
    for _ in range(3):
        batch.decode({**GREEDY, "max_tokens": C + 10})
        seen.update(a.keys + b.keys)
        BatchedStream([a], progress=False).modify(policy)  # only a edits; b keeps decoding
        assert len(a.tokens) == 2 * C
        assert all(present(ctx, b.keys)), "a chunk b still uses was deleted"
        assert all(present(ctx, a.keys))
    live = set(a.keys) | set(b.keys)
    assert present(ctx, sorted(seen - live)) == [False] * len(seen - live)  # nothing leaked
    assert all(present(ctx, sorted(live)))
    assert asyncio.run(a.arelease()) + asyncio.run(b.arelease()) == len(live)
    assert not any(present(ctx, sorted(seen)))
    assert not ctx.refs.keys() & seen


def test_failed_mid_decode_edit_leaves_the_stream_decodable(ctx, post, vllm_server):
    p = prompt(C + 60)
    ref, _ = direct(post, p, 1 + 2 * C + 50)
    s = create_request(ctx, post, p)
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    batch.decode({**GREEDY, "max_tokens": 2 * C})
    state = (list(s.tokens), list(s.suffix), s.kv_tokens, list(s.keys), s.cache_salt)

    def half_then_fail(kv, tokens):
        kv[0].zero_()  # written in place first: must never reach the server
        raise RuntimeError("policy bug")

    with pytest.raises(ModifyError, match="fn raised RuntimeError: policy bug"):
        batch.modify(half_then_fail)
    assert (list(s.tokens), list(s.suffix), s.kv_tokens, list(s.keys), s.cache_salt) == state
    assert all(present(ctx, s.keys))
    reset_prefix_cache(vllm_server)
    batch.decode({**GREEDY, "max_tokens": 50})
    assert s.output_token_ids == ref


def test_appended_turn_after_an_edit_continues_like_the_full_sequence(ctx, post, vllm_server):
    """Stream.append (a user's next turn after a long output): the next decode sends the
    edited sequence plus the appended tokens, and continues exactly like a direct request on
    that sequence; the appended tokens are computed by the engine, not taken from a cache."""
    p = prompt(C + 40)
    turn = prompt(37)
    s = create_request(ctx, post, p, cache_salt="append")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    batch.decode({**GREEDY, "max_tokens": C})
    generated = list(s.output_token_ids)
    batch.modify(lambda kv, t: (kv[:, :, :C], t[:C]))   # drop all but the first chunk
    s.append(turn)
    assert s.prompt == p[:C] + (p + generated)[2 * C:] + turn and not s.done
    ref, _ = direct(post, s.prompt, 30)
    reset_prefix_cache(vllm_server)
    batch.decode({**GREEDY, "max_tokens": 30})
    assert s.output_token_ids == generated + ref
    assert s.generations[-1].prompt_tokens == len(s.prompt) - 30
    with pytest.raises(ValueError, match="appended token ids"):
        s.append(["not a token"])

"""modify semantics against a real kvedit server (no vLLM): a fake engine stores KV the way
the connector does (full chunks under the prompt's keys), so keys, salts, reuse, deletion,
atomicity and the pipelined run are checked exactly."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvedit.client import KVClient
from kvedit.keys import request_keys
from kvedit.layout import ModelLayout
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.errors import BatchError, ModifyError
from kvedit.sdk.stream import create_request
from tests.fixtures_server import sdk_context

C = 256
LAYOUT = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", chunk_size=C)
MODEL = "sdk-modify-model"


class FakeEngine:
    """post_completion that stores each full chunk of the prompt and of the generated tokens
    (like the connector, with data derived from the key so equal keys mean equal data) and
    yields token 7 per step."""

    def __init__(self, url: str):
        self.client = KVClient(url)
        self.prompts: list[tuple[list[int], str]] = []

    def data(self, key: bytes) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return torch.randn(LAYOUT.chunk_shape, generator=g)

    async def __call__(self, prompt, params, cache_salt):
        self.prompts.append((list(prompt), cache_salt))
        n = params.get("max_tokens", 1)
        # like the connector: every full chunk whose KV was computed, the prompt's and the
        # generated tokens' but the last (its KV is computed by the next request)
        keys = request_keys(MODEL, LAYOUT, list(prompt) + [7] * (n - 1), cache_salt)
        await asyncio.to_thread(self.client.store, MODEL, keys, [self.data(k) for k in keys])
        for _ in range(n):
            await asyncio.sleep(0)
            yield 7


@pytest.fixture(scope="module")
def ctx(kv_server):
    with sdk_context(kv_server, MODEL, LAYOUT) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def engine(kv_server):
    e = FakeEngine(kv_server.url)
    yield e
    e.client.close()


_seed = iter(range(10_000))


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(next(_seed))
    return torch.randint(0, 8000, (n,), generator=g).tolist()


def stored(ctx, keys) -> torch.Tensor:
    with ctx.client.retrieve(ctx.model, keys) as r:
        assert len(r.tensors) == len(keys)
        return torch.cat([t.clone() for t in r.tensors], dim=2)


def prefilled(ctx, engine, n_tokens: int, salt: str = "", count: int = 1, same=False):
    p = prompt(n_tokens)
    batch = BatchedStream(progress=False)
    for _ in range(count):
        batch.add(create_request(ctx, engine, p if same else prompt(n_tokens), salt))
    batch.prefill({"max_tokens": 4})
    return batch


def identity(kv, tokens):
    return kv, tokens


def test_identity_reuses_every_chunk_and_keeps_salt(ctx, engine):
    batch = prefilled(ctx, engine, 3 * C + 10, salt="s")
    s = batch.streams[0]
    keys, before = list(s.keys), stored(ctx, s.keys)
    m = batch.modify(identity)
    assert (m.chunks_reused, m.chunks_stored, m.salt_changes, m.chunks_deleted) == (3, 0, 0, 0)
    assert s.keys == keys and s.cache_salt == "s"
    assert len(s.tokens) == 3 * C and len(s.suffix) == 10 + 1  # partial chunk + prefill token
    assert torch.equal(stored(ctx, keys), before)
    assert m.bytes_retrieved == 3 * LAYOUT.chunk_bytes and m.bytes_stored == 0


def test_same_tokens_new_data_switches_to_fresh_salt(ctx, engine):
    batch = prefilled(ctx, engine, 2 * C, salt="orig")
    s = batch.streams[0]
    old_keys, before = list(s.keys), stored(ctx, s.keys)

    def zero_v(kv, tokens):
        kv[1].zero_()  # in place: same tokens, different data
        return kv, tokens

    m = batch.modify(zero_v)
    assert m.salt_changes == 1 and m.chunks_stored == 2 and m.chunks_reused == 0
    assert s.cache_salt.startswith("orig~kvedit-") and len(s.cache_salt) == len("orig~kvedit-") + 12
    assert s.keys == request_keys(MODEL, LAYOUT, s.tokens, s.cache_salt)
    new = stored(ctx, s.keys)
    assert torch.count_nonzero(new[1]) == 0 and torch.equal(new[0], before[0])
    assert m.chunks_deleted == 2 and ctx.client.lookup(MODEL, old_keys) == 0
    # later requests carry the new salt
    batch.decode({"max_tokens": 2})
    assert engine.prompts[-1][1] == s.cache_salt


def test_drop_stores_only_new_keys_and_deletes_unreferenced(ctx, engine):
    batch = prefilled(ctx, engine, 4 * C + 5)
    s = batch.streams[0]
    old_keys, before = list(s.keys), stored(ctx, s.keys)

    def drop_middle(kv, tokens):  # keep chunks 0 and 3
        return (torch.cat([kv[:, :, :C], kv[:, :, 3 * C:]], dim=2),
                tokens[:C] + tokens[3 * C:])

    m = batch.modify(drop_middle)
    assert (m.chunks_reused, m.chunks_stored, m.salt_changes) == (1, 1, 0)
    assert s.keys[0] == old_keys[0] and len(s.tokens) == 2 * C
    assert torch.equal(stored(ctx, s.keys),
                       torch.cat([before[:, :, :C], before[:, :, 3 * C:]], dim=2))
    assert m.chunks_deleted == 3 and ctx.client.lookup(MODEL, old_keys[1:2]) == 0
    assert s.prompt == s.tokens + s.suffix and len(s.suffix) == 5 + 1


def test_shared_chunks_stay_while_another_stream_uses_them(ctx, engine):
    batch = prefilled(ctx, engine, 2 * C, count=2, same=True)
    a, b = batch.streams
    assert a.keys == b.keys
    one = BatchedStream([a], progress=False)
    m = one.modify(lambda kv, t: (kv[:, :, :C].clone(), t[:C]))
    assert m.chunks_deleted == 0  # b still references both chunks
    assert ctx.client.lookup(MODEL, b.keys) == 2
    m = BatchedStream([b], progress=False).modify(lambda kv, t: (kv[:, :, :C].clone(), t[:C]))
    assert m.chunks_deleted == 1 and ctx.client.lookup(MODEL, b.keys) == 1


def test_keep_old_keeps_the_original_chunks(ctx, engine):
    batch = prefilled(ctx, engine, 2 * C)
    old = list(batch.streams[0].keys)
    m = batch.modify(lambda kv, t: (kv * 2, t), keep_old=True)
    assert m.salt_changes == 1 and m.chunks_deleted == 0
    assert ctx.client.lookup(MODEL, old) == 2


def test_partial_edited_tail_moves_into_the_suffix(ctx, engine):
    batch = prefilled(ctx, engine, 2 * C + 3)
    s = batch.streams[0]
    toks = list(s.tokens)
    m = batch.modify(lambda kv, t: (kv[:, :, 100:], t[100:]))  # 412 tokens: 1 chunk + 156
    assert len(s.tokens) == C and s.tokens == toks[100:100 + C]
    assert s.suffix[:156] == toks[100 + C:2 * C] and len(s.suffix) == 156 + 3 + 1
    assert m.tokens_after == C


@pytest.mark.parametrize("fn, reason", [
    (lambda kv, t: (kv[:, :, :-1], t), "len(tokens)"),
    (lambda kv, t: (kv.double(), t), "dtype torch.float64"),
    (lambda kv, t: (kv[:, :1], t), "shape"),
    (lambda kv, t: (kv[0], t), "shape"),
    (lambda kv, t: kv, "(kv, tokens)"),
    (lambda kv, t: (kv.numpy(), t), "torch.Tensor"),
    (lambda kv, t: (kv, [str(x) for x in t]), "int token ids"),
    (lambda kv, t: 1 / 0, "ZeroDivisionError"),
])
def test_bad_edit_leaves_stream_and_kv_unchanged(ctx, engine, fn, reason):
    batch = prefilled(ctx, engine, 2 * C + 1)
    s = batch.streams[0]
    state = (list(s.tokens), list(s.suffix), s.cache_salt, list(s.keys))
    before = stored(ctx, s.keys)
    with pytest.raises(ModifyError) as exc:
        batch.modify(fn)
    assert s.label in str(exc.value) and reason in str(exc.value)
    assert (s.tokens, s.suffix, s.cache_salt, s.keys) == state
    assert torch.equal(stored(ctx, s.keys), before)
    batch.decode({"max_tokens": 1})  # still usable
    assert engine.prompts[-1] == (state[0] + state[1], "")


def test_in_place_edit_then_exception_keeps_original(ctx, engine):
    batch = prefilled(ctx, engine, C)
    s = batch.streams[0]
    before = stored(ctx, s.keys)

    def bad(kv, t):
        kv.zero_()
        raise ValueError("half-way")

    with pytest.raises(ModifyError, match="half-way"):
        batch.modify(bad)
    assert torch.equal(stored(ctx, s.keys), before)


def test_several_failures_are_reported_together(ctx, engine):
    batch = prefilled(ctx, engine, C, count=3)
    good = batch.streams[0]

    def fn(kv, t):
        if t == good.tokens:
            return kv, t
        raise RuntimeError("nope")

    with pytest.raises(BatchError) as exc:
        batch.modify(fn)
    assert len(exc.value.errors) == 2
    assert all(s.label in str(exc.value) for s in batch.streams[1:])


def test_unprefilled_stream_fails_after_wait(ctx, engine):
    batch = BatchedStream([create_request(ctx, engine, prompt(C))], progress=False)
    with pytest.raises(ModifyError, match="0 of its 1 full chunks"):
        batch.modify(identity, wait_timeout=0.3)


def test_short_prompt_is_skipped(ctx, engine):
    batch = prefilled(ctx, engine, 100)
    m = batch.modify(identity)
    s = batch.streams[0]
    assert m.streams_skipped == 1 and m.bytes_retrieved == 0
    assert s.tokens == s.prompt_token_ids and len(s.suffix) == 1


def test_fn_gets_the_layout_when_it_asks(ctx, engine):
    batch = prefilled(ctx, engine, C)
    seen = []

    def fn(kv, tokens, layout=None):
        seen.append(layout)
        return kv, tokens

    batch.modify(fn)
    assert seen == [LAYOUT]


def test_pipelined_run_modifies_each_stream_after_its_own_prefill(ctx, engine):
    batch = BatchedStream(progress=False)
    for _ in range(3):
        batch.add(create_request(ctx, engine, prompt(2 * C + 7)))
    order = []

    def fn(kv, tokens):
        order.append(len(tokens))
        return kv[:, :, C:].clone(), tokens[C:]

    m = batch.run({"max_tokens": 1}, fn, {"max_tokens": 3})
    assert m.phase == "run" and set(m.parts) == {"prefill", "modify", "decode"}
    assert m.parts["modify"].chunks_stored == 3 and order == [2 * C] * 3
    assert m.output_tokens == 3 * (1 + 3)
    for s in batch:
        assert len(s.tokens) == C and s.output_token_ids == [7] * 4
        assert not s.done  # generated exactly max_tokens


def test_async_api(ctx, engine):
    async def main():
        batch = BatchedStream([create_request(ctx, engine, prompt(C + 1))], progress=False)
        await batch.aprefill({"max_tokens": 1})
        m = await batch.amodify(identity)
        d = await batch.adecode({"max_tokens": 2})
        return m, d

    m, d = asyncio.run(main())
    assert m.chunks_reused == 1 and d.output_tokens == 2


def test_retrieve_buffers_are_reused_only_when_free(kv_server, engine):
    ctx = connect(kv_server.url, None, MODEL, timeout=5, track_writes=False)  # copy path
    batch = prefilled(ctx, engine, C, count=3)
    batch.modify_concurrency = 1
    kept = []
    batch.modify(lambda kv, t: (kept.append(kv) or kv, t))  # fn keeps every view
    bufs = list(ctx.pool._bufs)
    assert len(bufs) == 2 and all(b.in_use() for b in bufs)
    assert all(ctx.pool.take(1) is not b for b in bufs)  # a held buffer is never handed out
    kept.clear()
    assert not any(b.in_use() for b in bufs)
    assert any(ctx.pool.take(1) is b for b in bufs)  # released: reused (touched memory)
    ctx.close()


@pytest.mark.skipif(not __import__("kvedit.sdk.buffers", fromlist=["x"])._cow_supported(),
                    reason="needs /proc/self/pagemap (Linux)")
def test_mapped_kv_kept_by_fn_stays_valid_until_dropped(kv_server, engine):
    ctx = connect(kv_server.url, None, MODEL, timeout=5)  # tracking on: kv is mapped from shm
    batch = prefilled(ctx, engine, 2 * C)
    before = stored(ctx, batch.streams[0].keys)
    leases = ctx.client.stats()["leases"]
    kept = []
    m = batch.modify(lambda kv, t: (kept.append(kv) or kv[:, :, :C], t[:C]))
    assert m.chunks_deleted == 1 and ctx.pool._bufs == []  # mapped: no copy buffer taken
    assert ctx.client.stats()["leases"] == leases + 1  # the deleted chunk stays leased
    prefilled(ctx, engine, 8 * C)  # new stores cannot land in the kept chunks' slots
    assert torch.equal(kept[0], before)
    kept[0][0, 0, 0, 0] = 5.0  # a write copies the page, never touching the stored chunk
    assert torch.equal(stored(ctx, batch.streams[0].keys), before[:, :, :C])
    kept.clear()  # last user gone: unmapped and released
    assert ctx.client.stats()["leases"] == leases
    ctx.close()


@pytest.mark.skipif(not __import__("kvedit.sdk.buffers", fromlist=["x"])._cow_supported(),
                    reason="needs /proc/self/pagemap (Linux)")
def test_mapped_kv_is_released_when_modify_returns(kv_server, engine):
    """The thread that ran fn keeps nothing of it (a pool thread used to hold its last job's
    kv until the next job, and with it the mapped chunks' read lease): once modify returns,
    the server holds no lease of this edit, sync or async."""
    ctx = connect(kv_server.url, None, MODEL, timeout=5)  # tracking on: kv is mapped from shm
    leases = ctx.client.stats()["leases"]
    batch = prefilled(ctx, engine, 2 * C, count=2)
    m = batch.modify(lambda kv, t: (kv[:, :, C:].clone(), t[C:]))
    assert m.chunks_stored == 2 and ctx.pool._bufs == []   # mapped, a new tensor stored
    assert ctx.client.stats()["leases"] == leases
    m = asyncio.run(batch.amodify(lambda kv, t: (kv * 2, t)))
    assert m.chunks_stored == 2 and ctx.client.stats()["leases"] == leases
    ctx.close()


def test_pool_hands_out_the_smallest_free_buffer_that_fits():
    from kvedit.sdk.buffers import BufferPool

    pool = BufferPool(max_buffers=3)
    small, big = pool.take(100), pool.take(1000)
    view = small.open()[:10]
    pool.give(big)
    pool.give(small)
    assert pool.take(50) is big  # small is still used through `view`
    del view
    pool.give(big)
    assert pool.take(50) is small and pool.take(500) is big
    assert pool.take(2000).nbytes == 2000


@pytest.mark.skipif(not __import__("kvedit.sdk.buffers", fromlist=["x"])._cow_supported(),
                    reason="needs memfd and /proc/self/pagemap (Linux)")
def test_untouched_chunks_skip_the_comparison_and_any_write_is_seen(kv_server, engine):
    import ctypes

    ctx = connect(kv_server.url, None, MODEL, timeout=5)  # fresh pool: tracking on
    batch = prefilled(ctx, engine, 3 * C)
    m = batch.modify(identity)
    assert (m.chunks_reused, m.chunks_compared, m.salt_changes) == (3, 0, 0)
    m = batch.modify(lambda kv, t: (kv[:, :, :2 * C], t[:2 * C]))  # a prefix: same keys
    assert (m.chunks_reused, m.chunks_compared, m.chunks_deleted) == (2, 0, 1)

    def numpy_write(kv, t):  # bypasses torch's version counters; the MMU still sees it
        kv.numpy()[1, 0, C + 3, 0] += 1.0
        return kv, t

    s = batch.streams[0]
    m = batch.modify(numpy_write)
    assert m.salt_changes == 1 and m.chunks_stored == 2 and s.cache_salt.startswith("~kvedit-")

    def write_same_bytes(kv, t):  # written but identical: compared, found equal, reused
        ctypes.memmove(kv.data_ptr(), kv.data_ptr(), 8)
        return kv, t

    m = batch.modify(write_same_bytes)
    assert (m.chunks_compared, m.chunks_reused, m.salt_changes) == (1, 2, 0)

    def rewrite_all(kv, t):  # write-heavy: the next buffers are handed out untracked
        kv.mul_(1.0)
        return kv, t

    batch.modify(rewrite_all)
    m = batch.modify(identity)
    assert (m.chunks_compared, m.chunks_reused, m.salt_changes) == (2, 2, 0)
    ctx.close()


def test_without_write_tracking_reused_chunks_are_byte_compared(kv_server, engine):
    with connect(kv_server.url, None, MODEL, timeout=5, track_writes=False) as plain:
        assert not plain.pool.cow
        batch = BatchedStream([create_request(plain, engine, prompt(2 * C))], progress=False)
        batch.prefill({"max_tokens": 1})
        m = batch.modify(identity)
        assert (m.chunks_reused, m.chunks_compared, m.salt_changes) == (2, 2, 0)

        def zero_k(kv, t):
            kv[0].zero_()
            return kv, t

        m = batch.modify(zero_k)
        assert m.salt_changes == 1 and m.chunks_stored == 2


def test_failed_store_leaves_stream_and_kv_unchanged():
    from kvedit.launch.server import start_server

    with start_server(0.01, chunk_size=C) as srv:  # 10 MB pool: the edit below cannot fit
        with KVClient(srv.url) as client:
            client.register(MODEL, LAYOUT)
            small = connect(srv.url, None, MODEL, timeout=5)
            s = create_request(small, None, prompt(2 * C))
            client.store(MODEL, s.keys, [torch.ones(LAYOUT.chunk_shape)] * 2)
            with pytest.raises(ModifyError, match="storing the edited KV failed.*too_large"):
                BatchedStream([s], progress=False).modify(
                    lambda kv, t: (kv.repeat(1, 1, 200, 1) * 2, t * 200))
            assert len(s.tokens) == 2 * C and s.cache_salt == "" and s.suffix == []
            assert torch.equal(stored(small, s.keys), torch.ones(2, 2, 2 * C, 32))
            small.close()


def test_a_sync_fn_runs_in_the_contexts_threads_side_by_side_for_sync_and_async_modify(
        ctx, engine):
    """By default (no glibc tuning) modify runs a synchronous fn in the context's thread
    pool, for batch.modify as for amodify: two streams' fns run at the same time (a barrier
    that both must reach proves it; in one thread the first would wait forever), never in
    the caller's thread, and fn's exception reaches the caller as itself."""
    import threading

    seen, both = [], threading.Barrier(2, timeout=20)

    def record(kv, tokens):
        seen.append(threading.current_thread().name)
        both.wait()
        return kv, tokens

    batch = prefilled(ctx, engine, 2 * C, count=2)
    batch.modify(record)
    assert len(seen) == 2 and all(n.startswith("kvedit-io") for n in seen), seen

    def boom(kv, tokens):
        raise KeyError("from a context thread")

    with pytest.raises(BatchError, match="fn raised KeyError"):
        batch.modify(boom)
    seen.clear()
    both.reset()
    asyncio.run(batch.amodify(record))
    assert len(seen) == 2 and all(n.startswith("kvedit-io") for n in seen), seen


def _cat_into(kv, tokens, new_kv):
    """Drop the middle half of the chunks into a tensor from new_kv."""
    q = len(tokens) // C // 4 * C
    out = new_kv((2, kv.shape[1], 2 * q, kv.shape[3]))
    torch.cat([kv[:, :, :q], kv[:, :, -q:]], dim=2, out=out)
    return out, tokens[:q] + tokens[-q:]


def test_new_kv_gives_fn_reused_kvedit_pages_for_its_output(ctx, engine):
    """An fn that declares `new_kv` builds its output on pages the context keeps: the edit
    is stored exactly, the next modify's output lands on the same pages (touched memory),
    and an output the caller still holds is never handed out again."""
    ptrs, kept = [], []

    def fn(kv, tokens, new_kv):
        out, toks = _cat_into(kv, tokens, new_kv)
        ptrs.append(out.data_ptr())
        return out, toks

    def keep(kv, tokens, new_kv):
        out, toks = fn(kv, tokens, new_kv)
        kept.append(out)
        return out, toks

    def edited(batch):
        s = batch.streams[0]
        before = stored(ctx, s.keys)
        return torch.cat([before[:, :, :C], before[:, :, -C:]], dim=2)

    batch = prefilled(ctx, engine, 4 * C)
    want = edited(batch)
    m = batch.modify(fn)
    assert m.chunks_stored == 1 and torch.equal(stored(ctx, batch.streams[0].keys), want)
    batch = prefilled(ctx, engine, 4 * C)
    batch.modify(keep)
    assert ptrs[1] == ptrs[0]            # the same pages again
    held = kept[0].clone()
    batch = prefilled(ctx, engine, 4 * C)
    want = edited(batch)
    batch.modify(fn)
    assert ptrs[2] != ptrs[1]            # kept[0] still lives: not handed out
    assert torch.equal(kept[0], held)    # and not overwritten
    assert torch.equal(stored(ctx, batch.streams[0].keys), want)
    with pytest.raises(ModifyError, match="new_kv takes a shape"):
        batch = prefilled(ctx, engine, 2 * C)
        batch.modify(lambda kv, tokens, new_kv: (new_kv("big"), tokens))

"""The parts of kvedit.compat.lmcache that need no server: argument checks made before any
connection, LMCache's report format, the QUERY tensor kvedit's queries become, and the
recording of post_completion calls (timings and text, sync and async)."""
from __future__ import annotations

import asyncio
import io
import json

import pytest
import torch

import kvedit.compat.lmcache as lmc_sdk
from kvedit.compat.lmcache.edit import KindsEdit, Peek, Peeked, lmcache_queries
from kvedit.compat.lmcache.errors import LMCacheSDKError
from kvedit.compat.lmcache.perf import StreamPerfMetrics
from kvedit.compat.lmcache.report import Metrics, StreamHandler, get_formatter
from kvedit.compat.lmcache.state import Recorder
from kvedit.sdk.errors import KVEditError

KIND = lmc_sdk.LMCacheSDKCacheKind


def test_kind_is_checked_before_connecting():
    for bad in ("kv", 0, None):
        with pytest.raises(ValueError, match="unsupported cache kind.*KV.*QUERY"):
            lmc_sdk.connect(bad, "tcp://127.0.0.1:1", "http://127.0.0.1:1", "m")
    with pytest.raises(LMCacheSDKError, match="grpc.*tcp://HOST:PORT") as e:
        lmc_sdk.qcache.connect("grpc://127.0.0.1:1", "http://127.0.0.1:1", "m")
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, KVEditError)


def test_kind_names_follow_kvedit_not_lmcache_suffixes():
    assert [k.value for k in KIND] == ["kv", "query"]
    assert KIND.QUERY.server_model_name("m") == "m"   # kvedit keeps queries under the model
    assert KIND.QUERY.base_model_name("m##query") == "m"
    assert KIND.KV.base_model_name("m##query") == "m##query"


def test_queries_become_lmcache_shape_from_position_zero():
    q = torch.arange(2 * 300 * 8, dtype=torch.float32).view(2, 300, 8)   # [L, rows, Hq*D]
    out = lmcache_queries(q, 0, 256)
    assert tuple(out.shape) == (1, 2, 256, 8) and torch.equal(out[0], q[:, :256])
    assert tuple(lmcache_queries(q, 0, 512).shape) == (1, 2, 300, 8)   # KV past the prompt
    with pytest.raises(ValueError, match="position 4, not 0"):
        lmcache_queries(q, 4, 256)


def test_kinds_edit_hands_fn_the_mapping():
    kv, q = torch.randn(2, 2, 256, 4), torch.randn(2, 260, 8)
    seen = {}

    def fn(tensors, tokens):
        seen.update(tensors)
        return tensors[KIND.KV][:, :, :128], tokens[:128]

    assert KindsEdit(fn, True).needs_queries and not KindsEdit(fn, False).needs_queries
    out, toks = KindsEdit(fn, True)(kv, list(range(256)), queries=q, query_start=0)
    assert set(seen) == {KIND.KV, KIND.QUERY} and toks == list(range(128))
    assert seen[KIND.KV] is kv and torch.equal(seen[KIND.QUERY][0], q[:, :256])
    seen.clear()
    KindsEdit(fn, False)(kv, list(range(256)))
    assert set(seen) == {KIND.KV}
    with pytest.raises(TypeError, match="fn must be callable"):
        KindsEdit("drop", False)


def test_peek_copies_what_it_reads():
    kv = torch.randn(2, 1, 256, 4)
    with pytest.raises(Peeked) as e:
        Peek(KIND.KV)(kv, [0] * 256)
    assert torch.equal(e.value.tensor, kv) and e.value.tensor.data_ptr() != kv.data_ptr()
    assert Peek(KIND.QUERY).needs_queries and not Peek(KIND.KV).needs_queries


def report() -> Metrics:
    m = Metrics("Batched Stream Metrics (decode)")
    m.add_section("config", "Configuration").add("num_request_streams", "Streams", 3)
    r = m.add_section("results", "Results")
    r.add("duration", "Total Duration (s)", 1.23456)
    r.add("output_tokens", "Total Output Tokens", 12)
    m.add("note", "Note", None)
    return m


def test_report_dict_and_terminal_table():
    m = report()
    assert m.to_dict() == {"title": "Batched Stream Metrics (decode)",
                           "metrics": {"note": None, "config": {"num_request_streams": 3},
                                       "results": {"duration": 1.23456, "output_tokens": 12}}}
    assert m["results"].to_dict()["output_tokens"] == 12
    with pytest.raises(ValueError, match="already exists"):
        m.add_section("results", "again")
    out = io.StringIO()
    m.add_handler(StreamHandler(get_formatter("terminal", 40), out))
    m.emit()
    lines = out.getvalue().splitlines()
    assert lines == [" Batched Stream Metrics (decode) ".center(40, "="),
                     "Note:" + " " * 32 + "N/A",
                     " Configuration ".center(40, "-"),
                     "Streams:" + " " * 31 + "3",
                     " Results ".center(40, "-"),
                     "Total Duration (s):" + " " * 17 + "1.23",
                     "Total Output Tokens:" + " " * 18 + "12",
                     "=" * 40]


def test_report_json_and_format_errors():
    m = report()
    out = io.StringIO()
    m.add_handler(StreamHandler(get_formatter("json", width=7), out))   # width: no effect
    m.emit()
    assert json.loads(out.getvalue()) == m.to_dict()
    with pytest.raises(ValueError, match="Unknown format 'csv'. Available: terminal, json"):
        get_formatter("csv")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="width must be a positive"):
            get_formatter("terminal", bad)


def test_stream_perf_from_token_times():
    p = StreamPerfMetrics.of(10.0, [10.5, 10.75, 11.0], 12.0, input_tokens=30, output_tokens=3)
    assert (p.duration, p.ttft, p.tpot) == (2.0, 0.5, [0.25, 0.25])
    assert (p.input_tput, p.output_tput) == (15.0, 1.5)
    empty = StreamPerfMetrics.of(1.0, [], 1.0, 5, 0)
    assert (empty.ttft, empty.tpot, empty.input_tput) == (0.0, [], 0.0)


def test_recorder_defers_a_blocking_call_and_records_texts():
    calls = []
    TE = lmc_sdk.request.TokenEvent

    def post(prompt_token_ids, sampling_params, cache_salt):   # returns a list, eagerly
        calls.append((prompt_token_ids, sampling_params, cache_salt))
        return [TE(5, "a"), TE(6, "bc"), 7]

    rec = Recorder(post)
    gen = rec([1, 2], {"max_tokens": 3}, "s")
    assert calls == []               # nothing runs until kvedit iterates (in its I/O thread)
    assert [getattr(e, "token_id", e) for e in gen] == [5, 6, 7]
    assert calls == [([1, 2], {"max_tokens": 3}, "s")]
    call = rec.last
    assert call.texts == ["a", "bc", ""] and len(call.stamps) == 3
    assert call.start <= call.stamps[0] <= call.stamps[-1] <= call.end
    with pytest.raises(TypeError, match="post_completion must be callable"):
        Recorder(None)


def test_recorder_passes_an_async_post_completion_through():
    class Post:
        async def __call__(self, prompt_token_ids, sampling_params, cache_salt):
            for t in prompt_token_ids:
                yield lmc_sdk.request.TokenEvent(t, str(t))

    rec = Recorder(Post())

    async def collect():
        return [e.token_id async for e in rec([3, 4], {}, "")]

    assert asyncio.run(collect()) == [3, 4] and rec.last.texts == ["3", "4"]

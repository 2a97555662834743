"""SDK pieces without vLLM: connect errors (real server / no server), the vLLM-down error,
result validation, the OpenAI stream parser and Metrics."""
from __future__ import annotations

import time

import pytest
import torch

from kvedit.client import KVClient
from kvedit.layout import ModelLayout
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.errors import CompletionError, ConnectError
from kvedit.sdk.metrics import Metrics, percentiles
from kvedit.sdk.contracts import check_result
from kvedit.sdk.openai import CompletionServerError, openai_completion, parse_choices
from kvedit.sdk.stream import create_request
from kvedit.launch.server import free_port

LAYOUT = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_size=256)
MODEL = "sdk-unit-model"


@pytest.fixture(scope="module")
def registered(kv_server):
    with KVClient(kv_server.url) as c:
        c.register(MODEL, LAYOUT)
    return kv_server


def test_connect_reads_the_layout(registered):
    with connect(registered.url, registered.http_url, MODEL, timeout=5) as ctx:
        assert ctx.layout == LAYOUT and ctx.client.transfer_mode == "shm"
    assert ctx.closed


def test_unknown_model_fails_in_time_listing_known_models(registered):
    t = time.monotonic()
    with pytest.raises(ConnectError) as exc:
        connect(registered.url, registered.http_url, "no-such-model", timeout=1.5)
    assert 1.4 < time.monotonic() - t < 5
    assert "no-such-model" in str(exc.value) and MODEL in str(exc.value)


def test_model_registered_while_connect_waits(registered):
    import threading

    late = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_size=256)

    def register_later():
        time.sleep(0.5)
        with KVClient(registered.url) as c:
            c.register("late-model", late)

    threading.Thread(target=register_later).start()
    with connect(registered.url, None, "late-model", timeout=10) as ctx:
        assert ctx.layout == late


def test_server_not_running_fails_in_time():
    t = time.monotonic()
    with pytest.raises(ConnectError, match="cannot reach the kvedit server"):
        connect(f"tcp://127.0.0.1:{free_port()}", None, MODEL, timeout=1.0)
    assert time.monotonic() - t < 3


def test_http_endpoint_not_running_fails_in_time(registered):
    with pytest.raises(ConnectError, match="does not answer /health"):
        connect(registered.url, f"http://127.0.0.1:{free_port()}", MODEL, timeout=2)


def test_vllm_not_running_is_a_clear_stream_error(registered):
    post = openai_completion(f"http://127.0.0.1:{free_port()}", MODEL, connect_timeout=2)
    with connect(registered.url, None, MODEL, timeout=5) as ctx:
        batch = BatchedStream([create_request(ctx, post, list(range(300)))], progress=False)
        t = time.monotonic()
        with pytest.raises(CompletionError) as exc:
            batch.prefill({"temperature": 0})
        assert time.monotonic() - t < 5
    assert "stream" in str(exc.value) and "is vLLM running" in str(exc.value)


def test_check_result_accepts_good_and_names_what_is_wrong():
    kv = torch.zeros(2, 2, 5, 16, dtype=torch.bfloat16)
    out, toks = check_result((kv, torch.arange(5)), LAYOUT)
    assert out.data_ptr() == kv.data_ptr() and toks == [0, 1, 2, 3, 4]  # no copy
    cases = [((kv, [1, 2]), "2 tokens but kv holds 5"),
             ((kv.float(), list(range(5))), "expected torch.bfloat16"),
             ((kv[:, :1], list(range(5))), "expected [2, 2, T, 16]"),
             ((kv, [0, 1, 2, 3, -1]), "[0, 2**32)"),
             ((kv, [0, 1, 2, 3, 4.0]), "float"),
             ((kv,), "(kv, tokens)")]
    for result, msg in cases:
        with pytest.raises(ValueError) as exc:
            check_result(result, LAYOUT)
        assert msg in str(exc.value)


def test_stream_rejects_bad_prompts(registered):
    with connect(registered.url, None, MODEL, timeout=5) as ctx:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            create_request(ctx, None, ["a", "b"])
        with pytest.raises(ValueError, match="empty"):
            create_request(ctx, None, [])
        s = create_request(ctx, None, [1, 2, 3])
        batch = BatchedStream([s], progress=False)
        with pytest.raises(ValueError, match="already in this batch"):
            batch.add(s)


def test_parse_choices_token_ids_and_text_error():
    chunk = {"choices": [{"text": "ab", "finish_reason": "length", "logprobs": {
        "tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-1.0, -2.0]}}]}
    events, finish = parse_choices(chunk, "u")
    assert [(e.token_id, e.logprob, e.finish_reason) for e in events] == \
        [(5, -1.0, None), (9, -2.0, "length")] and finish == "length"
    with pytest.raises(CompletionServerError, match="--return-tokens-as-token-ids"):
        parse_choices({"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]}, "u")
    with pytest.raises(CompletionServerError, match="without token ids"):
        parse_choices({"choices": [{"text": "a", "logprobs": None}]}, "u")


def test_metrics_percentiles_dict_and_table():
    assert percentiles([]) == {}
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p["p50"] == 3.0 and p["mean"] == 3.0 and p["p90"] == pytest.approx(4.6)
    m = Metrics("decode", num_streams=2, duration=2.0, output_tokens=10, ttft=[0.1, 0.3],
                tpot=[0.01, 0.02])
    d = m.to_dict()
    assert d["output_tput"] == 5.0 and d["ttft"]["p50"] == pytest.approx(0.2)
    assert "output throughput" in m.table() and "TTFT" in str(m)
    run = Metrics("run", duration=3.0, parts={"decode": m})
    assert run.to_dict()["parts"]["decode"]["output_tokens"] == 10 and "-- decode" in run.table()


def test_import_kvedit_is_light():
    import subprocess
    import sys

    code = ("import sys, kvedit; assert 'torch' not in sys.modules; "
            "from kvedit import connect, BatchedStream, openai_completion, Metrics, "
            "create_request, LMCacheBatchedStream, aconnect; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_post_completion_bugs_and_bad_items_are_reported_for_what_they_are(registered):
    """A bug inside post_completion is reported as its exception, never as a bad token; an
    item that is not a token is reported as such; the salt rule binds three arguments."""
    from kvedit.sdk.contracts import takes_salt

    async def buggy(prompt, params, cache_salt):
        yield 5
        None.token_id  # an AttributeError inside the engine call itself

    async def strings(prompt, params, cache_salt):
        yield "5"

    def two_args(prompt, params):
        yield 5

    assert takes_salt(buggy) and not takes_salt(two_args) and takes_salt(lambda *a: iter([5]))
    with connect(registered.url, None, MODEL, timeout=5) as ctx:
        for post, pattern in ((buggy, "post_completion raised AttributeError: 'NoneType'"),
                              (strings, "yielded str '5': neither a token id")):
            s = create_request(ctx, post, [1, 2, 3])
            with pytest.raises(CompletionError, match=pattern) as exc:
                BatchedStream([s], progress=False).prefill({"max_tokens": 3})
            assert "neither" not in str(exc.value) or post is strings
            assert s.suffix == [] and s.output_token_ids == []  # nothing half-applied
        s = create_request(ctx, two_args, [1, 2, 3])
        BatchedStream([s], progress=False).prefill({"max_tokens": 1})
        assert s.output_token_ids == [5]

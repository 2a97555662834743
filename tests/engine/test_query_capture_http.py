"""Query capture through vLLM's OpenAI API (the session's vLLM server on the tiny model):
the top-level body field `kv_transfer_params` reaches the connector, and a request that asks
wrongly is still served (with no queries stored)."""
from __future__ import annotations

import json
import urllib.request

import torch

from tests.engine.test_query_capture import ATOL, RTOL, prompt_of

MODEL = "tiny-qwen3"  # the vllm_server fixture's served name


def _complete(vp, prompt: list[int], params: dict | None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(vp.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _fetch(kv_server, tokens: list[int], w: int):
    from kvedit.client import KVClient
    from kvedit.keys import namespace, query_key

    with KVClient(kv_server.url) as c:
        layout = c.get_layout(MODEL)
        raw = c.fetch_queries(MODEL, query_key(namespace(MODEL, layout), tokens, w))
    return None if raw is None else \
        torch.from_numpy(raw).view(torch.float32).view(layout.num_layers, -1, 4 * 64)


def test_openai_body_field_asks_for_capture(vllm_server, kv_server, hf_queries):
    tokens = prompt_of(700, seed=501)  # > one 256-token chunk: chunks stored as well
    out = _complete(vllm_server, tokens, {"kvedit_capture_queries": 48})
    assert out["usage"]["prompt_tokens"] == 700
    got = _fetch(kv_server, tokens, 48)
    assert got is not None, "the response came back before its queries were stored"
    torch.testing.assert_close(got, hf_queries(tokens)[:, -48:], atol=ATOL, rtol=RTOL)
    assert _fetch(kv_server, tokens, 47) is None  # the key holds the W asked


def test_bad_window_is_served_without_queries(vllm_server, kv_server):
    tokens = prompt_of(100, seed=502)
    for bad in (0, -3, 5000, "64"):
        out = _complete(vllm_server, tokens, {"kvedit_capture_queries": bad})
        assert out["choices"][0]["text"] is not None
    assert _fetch(kv_server, tokens, 5000) is None and _fetch(kv_server, tokens, 64) is None
    assert _fetch(kv_server, tokens, 3) is None

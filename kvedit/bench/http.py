"""HTTP to a running vLLM or kvedit server, as the benchmarks speak it: a JSON POST, a text GET
(/metrics), a streamed completion timed to its first token.

A module of its own because every bench family sends the same few requests and each used to
write its own urllib lines (timeouts and parsing drifted between the copies). Only the standard
library: any bench module, light or heavy, can import it at its top.
"""
from __future__ import annotations

import json
import time
import urllib.request

JSON = {"Content-Type": "application/json"}


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    """POST `body` as JSON to `url` -> the JSON reply ({} for an empty one)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=JSON,
                                 method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def get_text(url: str, timeout: float = 10.0) -> str:
    """GET `url` -> its body as text (e.g. a /metrics page); an HTTP error status raises."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def stream_completion(base_url: str, body: dict, timeout: float = 1800.0) -> dict:
    """POST `body` to `base_url`/v1/completions with streaming on and usage asked for ->
    ttft_s (to the first streamed choice), total_s, output_tokens, cached_tokens (the prompt
    tokens vLLM's prefix cache or a connector supplied)."""
    body = {**body, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers=JSON, method="POST")
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if msg.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total,
            "output_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}

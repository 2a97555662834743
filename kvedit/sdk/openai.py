"""A ready `post_completion` for OpenAI-compatible servers (vLLM with --return-tokens-as-token-ids).

It streams `/v1/completions` with httpx (one connection pool per event loop, no thread per
request) and yields one `TokenEvent` per generated token. Token ids come from the logprobs
entries `"token_id:N"` that `--return-tokens-as-token-ids` makes vLLM send (or from
`token_ids` when the server adds them); a server that sends text tokens is a clear error.
The event of the last token carries `finish_reason` and the request's `usage`.
"""
from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, is_dataclass

import httpx

from kvedit.sdk.errors import KVEditError

TOKEN_PREFIX = "token_id:"


@dataclass(slots=True)
class TokenEvent:
    """One generated token (the shape of the LMCache SDK's TokenEvent, plus a few fields)."""
    token_id: int
    logprob: float | None = None
    finish_reason: str | None = None
    usage: dict | None = None


class CompletionServerError(KVEditError):
    """The completion server is unreachable or answered something unusable."""


def params_to_dict(params) -> dict:
    """Sampling params as a JSON-able dict: a mapping, a dataclass, or an object's public attrs."""
    if params is None:
        return {}
    if isinstance(params, Mapping):
        return dict(params)
    if is_dataclass(params):
        return asdict(params)
    if hasattr(params, "__struct_fields__"):  # msgspec Struct
        return {f: getattr(params, f) for f in params.__struct_fields__}
    return {k: v for k, v in vars(params).items() if not k.startswith("_")}


class OpenAICompletion:
    """post_completion(prompt_token_ids, sampling_params, cache_salt) for /v1/completions."""

    def __init__(self, base_url: str, model: str, *, connect_timeout: float = 10.0,
                 read_timeout: float = 600.0, max_connections: int = 1024):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._timeout = httpx.Timeout(connect_timeout, read=read_timeout)
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
        # httpx clients belong to one event loop: keep one per loop that uses us.
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
            self._clients[loop] = client
        return client

    def body(self, prompt_token_ids, sampling_params, cache_salt: str) -> dict:
        body = {k: v for k, v in params_to_dict(sampling_params).items() if v is not None}
        body.update(model=self.model, prompt=[int(t) for t in prompt_token_ids], stream=True,
                    stream_options={"include_usage": True})
        # logprobs=0 still returns the sampled token, which is where the token id is.
        body["logprobs"] = max(int(body.get("logprobs") or 0), 0)
        if cache_salt:
            body["cache_salt"] = cache_salt
        return body

    async def __call__(self, prompt_token_ids, sampling_params=None,
                       cache_salt: str = "") -> AsyncIterator[TokenEvent]:
        url = f"{self.base_url}/v1/completions"
        body = self.body(prompt_token_ids, sampling_params, cache_salt)
        held: TokenEvent | None = None  # the finishing token waits for the usage chunk
        try:
            async with self._client().stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise CompletionServerError(
                        f"{url} answered HTTP {resp.status_code}: {text[:800]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise CompletionServerError(f"{url} streamed an error: {chunk['error']}")
                    if chunk.get("usage") and held is not None:
                        held.usage = chunk["usage"]
                    events, finish = parse_choices(chunk, url)
                    if not events and finish is not None and held is not None:
                        held.finish_reason = finish
                    for event in events:
                        if held is not None:
                            yield held
                            held = None
                        if event.finish_reason is None:
                            yield event
                        else:
                            held = event
        except httpx.TransportError as e:
            raise CompletionServerError(
                f"cannot reach the completion server at {self.base_url} "
                f"({type(e).__name__}: {e or 'no detail'}); is vLLM running there?") from e
        if held is not None:
            yield held

    async def aclose(self) -> None:
        for client in list(self._clients.values()):
            await client.aclose()
        self._clients.clear()

    def __repr__(self) -> str:
        return f"openai_completion({self.base_url!r}, {self.model!r})"


def parse_choices(chunk: dict, url: str) -> tuple[list[TokenEvent], str | None]:
    """TokenEvents of one streamed chunk (zero, one or several) and its finish_reason."""
    events: list[TokenEvent] = []
    finish = None
    for choice in chunk.get("choices") or ():
        finish = choice.get("finish_reason") or finish
        lp = choice.get("logprobs") or {}
        names = lp.get("tokens") or []
        ids = choice.get("token_ids") or [parse_token(n, url) for n in names]
        if not ids and choice.get("text"):
            raise CompletionServerError(
                f"{url} returned text {choice['text']!r} without token ids; request logprobs "
                f"and start vLLM with --return-tokens-as-token-ids")
        logprobs = lp.get("token_logprobs") or []
        for i, tid in enumerate(ids):
            events.append(TokenEvent(int(tid), logprobs[i] if i < len(logprobs) else None))
    if events and finish is not None:
        events[-1].finish_reason = finish
    return events, finish


def parse_token(name: str, url: str) -> int:
    if not name.startswith(TOKEN_PREFIX):
        raise CompletionServerError(
            f"{url} returned the text token {name!r} instead of 'token_id:N': start vLLM with "
            f"--return-tokens-as-token-ids")
    return int(name[len(TOKEN_PREFIX):])


def openai_completion(base_url: str, model: str, **kwargs) -> OpenAICompletion:
    """A post_completion for the OpenAI-compatible server at `base_url` serving `model`."""
    return OpenAICompletion(base_url, model, **kwargs)

"""The kvedit SDK: connect, request streams, batched prefill → modify → decode.

Modules (one concern each):
- `context`  connect()/close(): a Context = KVClient + model layout + key reference counts.
- `stream`   Stream (tokens, suffix, salt) and create_request(); one completion request.
- `batch`    BatchedStream: prefill / modify / decode / pipelined run, sync and async.
- `modify`   retrieve → fn → validate → store → swap → delete, and the keys/salt rule.
- `queries`  captured queries: asking vLLM at prefill, which fn gets them, their lifetime.
- `rowcopy`  memcpy/memcmp between chunk slices of [2, L, T, D] and contiguous chunks.
- `buffers`  reused retrieve buffers; copy-on-write tracking of what fn writes.
- `metrics`  Metrics: counters, throughputs, TTFT/TPOT percentiles, to_dict(), table().
- `openai`   openai_completion(): post_completion for OpenAI-compatible servers.
- `loop`     the background event loop behind the synchronous facade.
- `errors`   the exceptions (each names the stream, what was wrong, what was expected).
- `kvcache`  seed-compatible names (LMCache SDK): connect, close.
See docs/sdk.md for the user guide.
"""

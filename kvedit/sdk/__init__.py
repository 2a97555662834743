"""The kvedit SDK: connect, request streams, batched prefill → modify → decode.

Modules (one concern each):
- `context`  connect()/close(): a Context = KVClient + model layout + key reference counts.
- `stream`   Stream (tokens, suffix, salt) and create_request(); one completion request.
- `batch`    BatchedStream: prefill / modify / decode / pipelined run, sync and async.
- `driver`   the budgeted run: decode rounds + edits keeping each stream's KV under a budget.
- `modify`   one mechanism, one rank or tensor parallel: region → wait → queries → open →
             fn → store → swap → delete, and the keys/salt rule.
- `contracts` the EditFn / PostCompletion protocols; fn's keyword rules (layout, queries,
             query_start, new_kv) and result checks, decided there only.
- `source`   KVSource: where modify's kv comes from (mapped from shm, or copied and, under
             tensor parallel, gathered from every rank), chosen once.
- `store`    the store target: fn's result under every rank's keys, staged; the salt rule.
- `output`   new_kv: tensors fn builds, on kvedit's own reused pages.
- `chunkmap` MappedKV: stored chunks mapped copy-on-write into one tensor (no copy).
- `originals` the chunks compressed streams came from, kept for repair under a byte budget.
- `repair`   a compressed stream mended for a new question from its original: capture the
             question's queries on the original, re-select within the same budget, swap.
- `queries`  captured queries: asking vLLM at prefill, fetching every rank's, their lifetime.
- `tp`       tensor parallel: the head split, gather and scatter (pure).
- `buffers`  reused retrieve buffers; copy-on-write tracking of what fn writes.
- `geometry` where chunk i's rows lie in a [2, L, T, D] tensor (the one helper).
- `rowcopy`  memcpy/memcmp between chunk slices of [2, L, T, D] and contiguous chunks.
- `libc`     libc through ctypes, loaded once (memcpy, memcmp, mmap, munmap, mallopt).
- `glibc_tuning` opt-in only (connect(tune_glibc_heap=True)): process-wide malloc settings
             and the main-arena fn pool.
- `metrics`  Metrics: counters, throughputs, TTFT/TPOT percentiles, to_dict(), table().
- `openai`   openai_completion(): post_completion for OpenAI-compatible servers.
- `loop`     the background event loop behind the synchronous facade.
- `errors`   the exceptions (each names the stream, what was wrong, what was expected).
- `kvcache`  seed-compatible names (LMCache SDK): connect, close.
See docs/sdk.md for the user guide.
"""

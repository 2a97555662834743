"""kvedit's vLLM side: only what vLLM imports.

The connector core (this folder):
connector       KVEditConnector: the class vLLM loads; routes hooks to the two sides
scheduler_side  what the server holds, what to load before / store after each step
worker_side     registers the rank's layout; runs each step's loads, stores and captures
metadata        the per-step plan the scheduler side hands to the workers
settings        kv_connector_extra_config (grouped by sub-room) and the registered layout
scheduler_stats time in kvedit's scheduler hooks, as a stats line in vLLM's log
tier_events     what the server holds for this engine, as vLLM's KV events (for routers)
link            the server connection, kept usable across server outages
hooks           every vLLM internal kvedit shadows, and the vLLM releases each was checked on
paged           paged KV layouts (CPU vec/AMX, CUDA FlashAttention/FlashInfer) and copies
paged_kernels   one Triton launch per gather/scatter across a per-layer CUDA cache

Sub-rooms, one concern each:
transfer/       store and load: the copier, admission (store modes), pins, in-flight keys
capture/        query capture: which requests ask (scheduler), the attention hook (worker)
budget/         in-engine budgets: the plan, when to compact (scheduler), compaction and
                input shifts (worker), recent queries, compaction's data movement

Launching vLLM, the tiny model and `kvedit vllm serve` are tooling: see kvedit/harness/ and
kvedit/launch/.
"""

"""kvedit's vLLM side.

connector       KVEditConnector: the class vLLM loads; routes hooks to the two sides
scheduler_side  what the server holds, what to load before / store after each step
worker_side     copies between the server's chunks and vLLM's paged blocks
paged           paged KV layouts (CPU vec/AMX, CUDA FlashAttention/FlashInfer) and copies
metadata        the per-step plan the scheduler side hands to the workers
link            the server connection, kept usable across server outages
settings        kv_connector_extra_config and the registered model layout (+ RoPE)
query_window    query capture, scheduler side: which requests ask, their window's slots
query_capture   query capture, worker side: the per-step attention hook and row copies
budget_*        in-engine budgets: the plan, the scheduler side (when to compact, which
                blocks), the worker side (compaction, input shifts), recent queries
compact         compaction's data movement over the paged cache (pure torch)

Launching vLLM, the tiny model and `kvedit vllm serve` are tooling: see kvedit/harness/.
"""

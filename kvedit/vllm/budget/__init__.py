"""In-engine budgets: a request's KV kept within its budget, compacted in place in vLLM.

plan       what the scheduler side tells the workers each step (compactions, stashes, ...)
scheduler  KVCacheManager hooks: when to compact, which blocks to keep, stash, time slicing
worker     runs the plan before the step; shifts compacted requests' inputs
recent     the recent-queries rings of query-aware budgets (SnapKV, TOVA)
compact    compaction's data movement over the paged cache (pure torch)
"""

"""Store and load: chunks between the kvedit server and vLLM's paged blocks.

plan          ChunkRun: consecutive chunks of one request to load or store this step
admission     store modes: which computed chunks are stored, and when (eager, evict, reuse)
pins          leases on the chunks a lookup reported, held until they are loaded
inflight      keys handed to the workers to store in the background, with deadlines
copier        PagedCopier: the worker's copies (CPU: straight into shm; GPU: staged)
copier_stats  store and load stats lines in vLLM's log, and their parsers
gpu_memory    page-locked host mappings, the device staging ring, copy streams
"""

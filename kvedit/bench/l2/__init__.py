"""`kvedit bench l2`: the Redis second tier against plain redis-py on the same bytes, same run.

Qwen3-8B-shaped chunks (36 layers, 8 KV heads, head_dim 128, bf16, 256 tokens = 36 MiB),
--chunks of them (default 16: a 4096-token prompt), one redis-server started here:
- l2_store_vs_redis: bytes/s of the server's write-behind (the writer thread's own time for
  one commit of all chunks: live checks, hash, MULTI/EXEC; counted by the tier) / bytes/s of
  redis-py SETs of the same bytes. Target >= 0.8. store_until_in_l2_s: the client's store
  plus the write-behind, until the tier counts every chunk written.
- l2_fetch_vs_redis: chunks/s of promotion (a lookup on a second server with an empty L1
  that falls through to Redis and promotes every chunk into L1) / chunks/s of redis-py GETs
  of the same records. Target >= 0.8.
- promotion overhead per chunk: the same fall-through with small chunks (16 KiB), where the
  bytes cost little and the per-chunk work (probe, slot, GET, CRC, commit, wake) shows.
- write-behind on commit vs on eviction: the client's store time with an L1 of a quarter of
  the data (so most stores evict), in each mode, and how much of the data reached L2.
- with --vllm: l2_hit_ttft_vs_recompute: two tiny-model vLLMs, each with its own server,
  sharing the Redis; a 4096-token prompt prefilled on A is served to B from L2 (B's first
  sight of it) / a fresh prompt recomputed on B. Target <= 0.3.
Ratios divide paths run alternately in each round (noise hits both sides); the best round of
each side counts.
With --cluster: the same store and fetch paths on a Redis Cluster against one Redis, in the
same run, plus keys per master and a failover phase (cluster.py, failover.py).

The modules: cli (options; light, the rest loads when the command runs), run (the single-Redis
mode: throughput against redis-py, promotion overhead, write modes; --cluster hands over to
cluster), paths (the paths both modes measure: a server pair on one L2, the two-engine L2-hit
TTFT, the chunks), cluster (`--cluster`: the cluster against one Redis, keys per master),
failover (`--cluster`'s failover phase).
"""
from kvedit.bench.l2.cli import register

__all__ = ["register"]

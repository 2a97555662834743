"""Two engines, one tier: prefill on engine A, edit the KV, decode on engine B.

Disaggregated prefill and decode with an edit in between. Each vLLM has its own kvedit
server; the two servers share one Redis, or one Redis Cluster (--cluster), as their second
tier (`kvedit server --l2-url`):

    vLLM A --connector--> server A --write-behind--> Redis <--promotion-- server B <-- vLLM B
       prefill              edit (SDK, on A)                                decode

1. vLLM A prefills the prompts; its connector stores every chunk in server A, which writes
   them behind to Redis.
2. The SDK edits each stream's KV on server A (here: drop the middle half of the chunks and
   re-rotate the kept keys); the edited chunks are stored in A and written behind too.
3. `wait_l2_written(A)`: A's write-behind queue is empty, so the edited chunks are in Redis.
4. vLLM A stops. vLLM B starts against server B (whose memory holds nothing of this). The
   streams decode on B: B's connector looks up the edited prefix, server B falls through to
   Redis and promotes the chunks into its memory, and B loads them instead of computing them
   (`cached_tokens` in B's usage shows it).
With --reference the same edit is first decoded on A alone (single engine) and the outputs
are compared token by token. One vLLM runs at a time, so this fits a small machine; on two
hosts, run A and B side by side (give both servers the same --l2-url).

    python examples/two_engines/prefill_edit_decode.py --reference          # all local
    python examples/two_engines/prefill_edit_decode.py --reference --cluster   # on a cluster
    python examples/two_engines/prefill_edit_decode.py --redis-url redis://host:6379/0
    python examples/two_engines/prefill_edit_decode.py --redis-url redis+cluster://h1:7000,h2:7000

By default it builds the tiny random-weight Qwen3 (kvedit tiny-model) and starts its own
redis-server, or with --cluster a cluster of 3 masters + 3 replicas (`make setup` installs
redis-server); --model-dir serves another model.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random

import kvedit
from kvedit import auth
from kvedit.client.http_proof import found
from kvedit.edits import DropMiddle
from kvedit.harness.tiny_model import default_tiny_model
from kvedit.launch.vllm import start_vllm
from kvedit.client.l2_wait import wait_l2_written
from kvedit.launch.server import start_server
from kvedit.launch.redis import RedisProcess
from kvedit.launch.redis_cluster import RedisClusterProcess

SERVED = "tiny-qwen3"


def _status(server) -> dict:
    """The server's GET /status, with the bearer token sent only once it proved its secret
    (kvedit.client.http_proof: a loopback server of this user is recognised by its proof)."""
    conn, _, key = found(server.http_url, timeout=10)
    try:
        conn.request("GET", "/status", headers=auth.bearer_header(key))
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {server.http_url}/status answered {r.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def _streams(ctx, post, prompts, salt: str) -> kvedit.BatchedStream:
    batch = kvedit.BatchedStream(max_concurrency=1)   # one request at a time: same batches
    for i, p in enumerate(prompts):                   # on both engines, so same numerics
        batch.add(kvedit.create_request(ctx, post, p, cache_salt=salt, name=f"p{i}"))
    return batch


def run(model_dir, prompts: list[list[int]], params: dict, redis_url: str | None,
        reference: bool, kv_cache_gib: float = 0.25, cluster: bool = False) -> dict:
    out: dict = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts]}
    vllm_kw = dict(served_model_name=SERVED, dtype="float32", kv_cache_gib=kv_cache_gib,
                   max_model_len=4096, dev_mode=True)
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(RedisClusterProcess() if cluster
                                            else RedisProcess()).url
        out["l2_scheme"] = redis_url.split("://", 1)[0]
        l2 = ["--l2-url", redis_url, "--l2-lookup-wait", "1.5"]
        sa = stack.enter_context(start_server(0.5, extra_args=l2))
        sb = stack.enter_context(start_server(0.5, extra_args=l2))

        # ---- engine A: prefill and edit (and, with --reference, the single-engine decode)
        with start_vllm(model_dir, server=sa, **vllm_kw) as va:
            ctx = stack.enter_context(kvedit.connect(sa.url, sa.http_url, SERVED))
            post_a = kvedit.openai_completion(va.base_url, SERVED)
            if reference:
                ref = _streams(ctx, post_a, prompts, "single-engine")
                ref.prefill(params)
                ref.modify(DropMiddle(0.5))
                ref.decode(params)
                out["single_engine_outputs"] = [s.output_token_ids for s in ref.streams]
            batch = _streams(ctx, post_a, prompts, "two-engines")
            batch.prefill(params)
            batch.modify(DropMiddle(0.5))
            out["edited_tokens"] = [len(s.tokens) for s in batch.streams]
            out["server_a_l2"] = wait_l2_written(sa.http_url)   # the edit is in Redis now

        # ---- engine B: decode the edited KV, loaded through server B from Redis
        with start_vllm(model_dir, server=sb, **vllm_kw) as vb:
            post_b = kvedit.openai_completion(vb.base_url, SERVED)
            for s in batch.streams:
                s.post_completion = post_b
            batch.decode(params)
            # B's connector follows B's keys (a watch lives as long as its engine)
            out["server_b_key_watches"] = _status(sb)["counters"]["key_watches"]
        out["two_engine_outputs"] = [s.output_token_ids for s in batch.streams]
        out["decode_cached_tokens"] = [s.generations[-1].cached_tokens for s in batch.streams]
        out["server_b_l2"] = _status(sb)["l2"]
    if reference:
        out["outputs_equal_single_engine"] = (out["two_engine_outputs"]
                                              == out["single_engine_outputs"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default=None,
                    help="shared Redis or cluster, redis://... or redis+cluster://h1:p1,... "
                         "(default: start a throwaway redis-server here)")
    ap.add_argument("--cluster", action="store_true",
                    help="without --redis-url: start a throwaway Redis Cluster (3 masters + 3 "
                         "replicas) instead of one redis-server")
    ap.add_argument("--model-dir", default=None, help="default: the tiny random Qwen3")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reference", action="store_true",
                    help="also decode the same edit on engine A alone and compare outputs")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 8000) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.max_tokens}
    res = run(args.model_dir or default_tiny_model(), prompts, params, args.redis_url,
              args.reference, cluster=args.cluster)
    if args.json:
        print(json.dumps(res))
        return
    print(f"edited prompts: {res['prompt_tokens']} -> {res['edited_tokens']} tokens")
    print(f"engine B loaded {res['decode_cached_tokens']} prompt tokens from server B "
          f"(L2 promotions: {res['server_b_l2']['hits']} chunks)")
    print(f"engine B output of prompt 0: {res['two_engine_outputs'][0]}")
    if args.reference:
        print(f"same as the single-engine decode of the same edit: "
              f"{res['outputs_equal_single_engine']}")


if __name__ == "__main__":
    main()

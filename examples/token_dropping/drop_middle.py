"""Drop the middle half of each long prompt's KV cache, then decode on what is left.

This is the LMCache SDK's token-dropping example written against kvedit's public API.
Start a kvedit server and a vLLM with the kvedit connector first, for example:

    kvedit server --l1-size-gb 4                    # ZMQ :6555, HTTP :8080
    kvedit tiny-model /tmp/tiny-qwen3               # or any model vLLM serves
    kvedit vllm serve /tmp/tiny-qwen3 --served-model-name tiny-qwen3 --dtype bfloat16 \\
        --kvedit-url tcp://127.0.0.1:6555 --kvedit-http-url http://127.0.0.1:8080 --port 8000
    python examples/token_dropping/drop_middle.py

(`kvedit demo` does all of this, and the baseline arm, in one command.)
"""
from __future__ import annotations

import argparse
import random

import kvedit
from kvedit.edits import DropMiddle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-url", default="tcp://127.0.0.1:6555")
    ap.add_argument("--server-http-url", default="http://127.0.0.1:8080")
    ap.add_argument("--vllm-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-qwen3", help="vLLM's served model name")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 8192) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.max_tokens}

    with kvedit.connect(args.server_url, args.server_http_url, args.model) as ctx:
        post = kvedit.openai_completion(args.vllm_url, args.model)
        batch = kvedit.BatchedStream()
        for p in prompts:
            batch.add(kvedit.create_request(ctx, post, p))

        prefill = batch.prefill(params)          # KV computed by vLLM, stored in kvedit
        modify = batch.modify(DropMiddle(0.5))   # keep first/last chunks, re-rotate RoPE
        decode = batch.decode(params)            # vLLM loads the edited KV, decodes on it

        print(f"prefill: {prefill.input_tput:,.0f} tok/s")
        print(f"modify:  {modify.duration:.2f} s, {modify.tokens_before:,} -> "
              f"{modify.tokens_after:,} tokens")
        print(f"decode:  {decode.output_tput:,.0f} tok/s")
        print(f"first stream's output: {batch.streams[0].output_token_ids[:16]} ...")

    # One call does the same pipelined (each stream moves on as soon as its own step is done):
    #   metrics = batch.run(prefill_params, DropMiddle(0.5), decode_params)


if __name__ == "__main__":
    main()

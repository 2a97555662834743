"""`kvedit bench long`: long generations under a per-stream KV budget, against plain vLLM.

One kvedit server and one vLLM with a KV pool of `--kv-blocks` blocks (or `--pool`, a share
of the working set), so N streams that each generate O tokens do not all fit at once. The
arms, all on the same prompts (greedy, ignore_eos, so every arm decodes the same work):

| arm | engine | requests | what it is |
|---|---|---|---|
| `vllm_full` | plain vLLM | one completion of O per stream | what a user runs without kvedit |
| `vllm_two_phase` | plain vLLM | prefill every stream (1 token), then decode O | the SDK's flow, no connector |
| `connector_one_phase` | vLLM + connector | one completion of O per stream | the connector as `kvedit vllm serve` runs it (its default store mode), no budget |
| `none` | vLLM + connector | `BatchedStream` prefill, then decode | the SDK's flow, no budget |
| `host` | vLLM + connector | `BatchedStream.run(HostBudget)`: rounds of K, edits between | the budget kept by host round trips |
| `in_engine` | vLLM + connector | `BatchedStream.run(EngineBudget)`: one request each | the budget kept inside vLLM |

So `connector_one_phase ÷ vllm_full` is the connector's own cost, `vllm_two_phase ÷
vllm_full` the two-phase flow's, and `none ÷ vllm_two_phase` the connector's under that
flow (`costs` in the JSON). The plain engine and kvedit's are started with the same
arguments but the connector, and the run is refused when their effective settings (what
vLLM logs at start) differ in anything else (`engine_configs`).

More arms: `--engine-policies LIST` (one in-engine arm per policy, `in_engine_policies`),
`--budgets LIST` (the in-engine arm again at each budget: `frontier`, also printed as a
table), `in_engine_matched` (in-engine at the host arm's real footprint; off with
--no-matched-arm), `--no-host-arm`, `--no-vllm-full`.

Figures. decode throughput: an arm's output tokens over its wall time (prefill included);
tokens per engine step and preemptions: vLLM's counters (free of CPU contention: the KV
pool bounds how many streams one step decodes, so tokens per step is what a budget moves);
`vs_vllm_full_decode_throughput` / `vs_vllm_full_step_gain` for every arm. Each arm's KV
bound: min(N, pool / mean footprint), the footprint measured from its requests
(`kv_limit_blocks` counts it in the blocks vLLM hands out); `gain_vs_bound` compares an
arm's step gain over `none` with the ratio of the bounds. In-engine arms add their edit
overhead (the workers' compaction time over wall time), blocks freed and reused, and
leaked blocks (vLLM's KV usage once idle). `budget` says what the budget held: the
prefill computes each prompt whole (a prompt longer than the budget is held whole until
its first compaction), every later round or step stays within it.

Answers in the same run (a real `--model` with `--tasks count,restate`): the prompts are
long-generation tasks (kvedit.harness.eval.longgen) and every arm's outputs are scored
(`answers`, per arm and task with a 95% interval), under the same KV pressure as its speed.
`--preset real-cpu` is the CPU-sized run of that (docs/in-engine.md); `--dry-run` prints the
sizes, the pool's share of the working set and an estimate of the time, and starts nothing.

Accuracy of SmolLM2 on the same tasks without KV pressure (`--accuracy-model`, default
smollm2 when built): kvedit.bench.long.accuracy.

The modules: cli (options, presets), sizing (what the run needs, checked before anything
starts), prompts, speed (the engines and the order of the arms), arms (the SDK's arms),
engine (the in-engine arm), full (plain-vLLM flows, engine settings), figures (the JSON),
policies (--engine-policies entries), accuracy.
"""
from kvedit.bench.long.cli import register

__all__ = ["register"]

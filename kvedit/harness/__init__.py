"""kvedit's tooling: what builds models and runs experiments (processes start in kvedit/launch/).

Neither an edit (kvedit/edits/ stays pure torch) nor what vLLM imports (kvedit/vllm/ holds
only the connector and its parts).

tiny_model   the tiny random-weight Qwen3 + BPE tokenizer for tests, demo and benchmarks
models       real models converted from packaged weights (`kvedit model smollm2`)
experiment   the baseline-vs-dropped experiment shared by the demo and `bench dropping`
cli          `kvedit vllm serve`, `kvedit tiny-model`, `kvedit model`
"""

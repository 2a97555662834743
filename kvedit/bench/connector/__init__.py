"""The benches of vLLM with the kvedit connector: `kvedit bench connector` (what the connector
saves and costs: a server hit's TTFT vs recompute, prefill with and without storing, with and
without query capture; `--paged`: the copies alone; `--kv-events`: its KV events' cost and
exactness) and `kvedit bench route` (routing by those events with vLLM's router). Each module's
docstring says what it measures and against which same-run baseline.

The modules: cli (both commands' options; light, it loads the module of the mode or command
that runs), run (`connector`'s default two-vLLM run), paged (`--paged`), events
(`--kv-events`), route (`route`), calls (what they send an engine: one completion, a batch's
prefill throughput, a process tree's CPU seconds). HTTP goes through kvedit.bench.http.
"""
from kvedit.bench.connector.cli import register, register_route

__all__ = ["register", "register_route"]

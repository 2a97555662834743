"""Whether query capture can run in this vLLM: the connector's setting ("auto", "on",
"off"), the releases its attention hook was checked on (kvedit.vllm.hooks) and CUDA graphs
that would run the steps it needs without Python between layers. Both connector roles ask,
and the in-engine budgets ask for their recent queries, which need decode steps too.
"""
from __future__ import annotations

from kvedit.vllm.hooks import capture_span, capture_supported, check_capture_version


def graph_blocker(vllm_config, decodes: bool = False) -> str | None:
    """Why CUDA graphs keep the hook from seeing the steps it needs, or None: prefill steps
    (query capture) replayed as full graphs under cudagraph_mode FULL, or, with `decodes`
    (the in-engine budgets' recent queries), decode steps under any mode with full graphs
    (vLLM's default FULL_AND_PIECEWISE replays decode-only batches as full graphs)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or not hasattr(mode, "has_full_cudagraphs"):
        return None
    if decodes and mode.has_full_cudagraphs():
        what = "decode steps"
    elif mode.mixed_mode().name == "FULL":
        what = "prefill steps"
    else:
        return None
    return (f"vLLM runs {what} as full CUDA graphs (cudagraph_mode {mode.name}), which run "
            "no Python between layers; start vLLM with --compilation-config "
            "'{\"cudagraph_mode\": \"PIECEWISE\"}' or --enforce-eager")


def capture_unavailable(mode: str, version: str, vllm_config=None,
                        decodes: bool = False) -> str | None:
    """Why query capture is off in this process (None: it is on). Mode "on" on an
    unsupported vLLM, or with prefill steps in full CUDA graphs, raises instead. `decodes`:
    asked for the in-engine budgets, which need decode steps too (graph_blocker)."""
    if mode == "off":
        return 'query_capture is "off" in kv_connector_extra_config'
    if not capture_supported(version):
        if mode == "on":
            check_capture_version(version)
        return f"query capture does not support vLLM {version} (supported: {capture_span()})"
    why = graph_blocker(vllm_config, decodes)
    if why and mode == "on" and graph_blocker(vllm_config) is not None:
        raise RuntimeError(f"kvedit query capture: {why}")
    return why

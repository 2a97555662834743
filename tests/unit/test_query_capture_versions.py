"""Query capture against every vLLM release it supports, without those releases installed:
vllm_hook_shapes.json records, per release, what the hook relies on as read from its wheel's
source (vllm_hook_shapes.py), and these tests run the hook through stand-in impl classes of
each recorded forward signature, called the way vLLM's attention op calls them. Also the
per-release adapters: no external hits for requests that skip reading the cache (vLLM
0.26-0.30 would load them), full-CUDA-graph steps (the V2 runner binds the metadata outside a
forward context for them) never armed."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvedit.vllm.capture.plan import QueryRun
from kvedit.vllm.capture.support import capture_unavailable, graph_blocker
from kvedit.vllm.capture.worker import STATS, QueryCapture, _check_impl
from kvedit.vllm.hooks import SUPPORTED_CAPTURE_VLLM
from tests.unit.vllm_hook_shapes import shapes

RECORDED = json.loads((Path(__file__).with_name("vllm_hook_shapes.json")).read_text())
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_every_supported_minor_release_is_recorded():
    (lo, hi) = SUPPORTED_CAPTURE_VLLM
    assert lo[0] == hi[0]
    assert sorted(RECORDED, key=lambda v: tuple(map(int, v.split(".")))) == \
        [f"{lo[0]}.{m}.0" for m in range(lo[1], hi[1] + 1)]


def test_installed_vllm_reads_as_recorded():
    """The reader, on the vLLM installed here, gives what was recorded for that release."""
    import vllm

    got = shapes(Path(vllm.__file__).resolve().parents[1])
    base = vllm.__version__.split("+")[0]
    if base not in RECORDED:
        pytest.skip(f"vLLM {vllm.__version__} is not among the recorded releases")
    assert got == RECORDED[base]


@pytest.mark.parametrize("version", sorted(RECORDED))
def test_what_the_hook_relies_on_holds(version):
    s = RECORDED[version]
    for key in ("op_calls_layer_impl_forward", "op_is_a_splitting_op",
                "forward_context_slot_mapping_per_layer", "forward_context_available_fn",
                "v1_runner_binds_before_forward", "scheduler_calls_on_new_request",
                "request_kv_transfer_params_from_extra_args",
                "request_skip_reading_prefix_cache", "cache_manager_honours_skip_reading",
                "openai_kv_transfer_params_to_extra_args",
                # the adapter for these: current_forward_context / full_graph_step
                "v2_runner_full_graph_binds_outside_forward_context"):
        assert s[key], f"vLLM {version}: {key}"
    # the adapter for this one: the scheduler side reports no external hits itself
    minor = int(version.split(".")[1])
    assert s["scheduler_drops_external_hits_of_skip_reading"] == (minor >= 31)


def _impl_class(params: list[str]):
    """A stand-in impl whose forward has exactly the recorded parameters (the leading ones
    positional, the rest with defaults, as in vLLM) and records the query it got."""
    head, tail = params[:8], params[8:]   # self .. output, then the optional scales
    sig = ", ".join(head + [f"{p}=None" for p in tail])
    ns: dict = {}
    exec(f"def forward({sig}):\n    {params[0]}.seen = {params[2]}\n    return {params[7]}", ns)
    return type("Impl", (), {"forward": ns["forward"]})


def _op(layer, query):
    """How vLLM's unified_attention_with_output calls the impl (0.26 to 0.33 alike)."""
    out = torch.empty_like(query)
    layer.impl.forward(layer, query, query, query, None, None, output=out,
                       output_scale=None, output_block_scale=None)
    return out


@pytest.mark.parametrize("version,cls", [(v, c) for v in sorted(RECORDED)
                                         for c in RECORDED[v]["impl_forward"]])
def test_hook_through_each_recorded_impl_forward(version, cls):
    params = RECORDED[version]["impl_forward"][cls]
    assert params is not None, f"vLLM {version} has no {cls}.forward"
    impl_cls = _impl_class(params)
    _check_impl("layer", impl_cls())
    layers = [SimpleNamespace(impl=impl_cls(), num_heads=2, head_size=3) for _ in NAMES]
    cap = QueryCapture(layers, NAMES, tp_rank=0)
    slots = torch.tensor([40, 9, 41, -1])   # the padded tail of a CUDA graph: -1
    fc = SimpleNamespace(slot_mapping={n: slots for n in NAMES},
                         cudagraph_runtime_mode=SimpleNamespace(name="PIECEWISE"))
    cap.arm([QueryRun("r", [b"k"], rows=2, row0=0, slots=[41, 9])], fc)
    q = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    for i, layer in enumerate(layers):
        _op(layer, q + i)
        assert layer.impl.seen is not None   # vLLM's method still ran
    (ready,) = cap.finish()
    want = torch.stack([(q + i).view(4, 6)[[2, 1]] for i in range(2)])
    assert torch.equal(ready.data, want)
    assert all("forward" not in layer.impl.__dict__ for layer in layers)


def test_full_graph_steps_are_never_armed():
    impl_cls = _impl_class(RECORDED["0.26.0"]["impl_forward"]["FlashAttentionImpl"])
    layers = [SimpleNamespace(impl=impl_cls(), num_heads=1, head_size=2) for _ in NAMES]
    cap = QueryCapture(layers, NAMES, tp_rank=0)
    run = QueryRun("r", [b"k"], rows=1, row0=0, slots=[5])
    full = SimpleNamespace(slot_mapping={NAMES[0]: torch.tensor([5])},
                           cudagraph_runtime_mode=SimpleNamespace(name="FULL"))
    for fc in (None, full):   # V2 runner: no forward context; V1 runner: mode FULL
        dropped = STATS.dropped
        cap.arm([run], fc)
        assert cap.step is None and STATS.dropped == dropped + 1
        assert all("forward" not in layer.impl.__dict__ for layer in layers)


def test_cuda_graph_modes_that_hide_the_steps_are_refused():
    from vllm.config import CUDAGraphMode

    def cfg(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    for mode in ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        assert graph_blocker(cfg(CUDAGraphMode[mode])) is None   # prefill runs eagerly
        assert capture_unavailable("on", "0.26.0", cfg(CUDAGraphMode[mode])) is None
    assert "prefill steps as full CUDA graphs (cudagraph_mode FULL)" in graph_blocker(
        cfg(CUDAGraphMode.FULL))
    with pytest.raises(RuntimeError, match="cudagraph_mode FULL.*PIECEWISE"):
        capture_unavailable("on", "0.26.0", cfg(CUDAGraphMode.FULL))
    # the in-engine budgets' recent queries need decode steps too
    for mode in ("NONE", "PIECEWISE"):
        assert capture_unavailable("on", "0.26.0", cfg(CUDAGraphMode[mode]), True) is None
    for mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        why = capture_unavailable("on", "0.26.0", cfg(CUDAGraphMode[mode]), decodes=True)
        assert f"decode steps as full CUDA graphs (cudagraph_mode {mode})" in why
        assert "--enforce-eager" in why


class _Client:
    """Holds every chunk asked about."""

    def lookup(self, model, keys, tp_rank=0, **kw):
        return len(keys)


def test_no_external_hits_for_requests_that_skip_reading_the_cache():
    """vLLM >= 0.31 drops a connector's hits for such requests itself; 0.26-0.30 would load
    them, and a capture window's tokens would never be computed."""
    from kvedit.vllm.scheduler_side import SchedulerSide
    from kvedit.vllm.settings import ConnectorSettings
    from tests.unit.test_query_capture_units import _sched_config

    side = SchedulerSide(_sched_config(), ConnectorSettings.from_extra(dict(
        kvedit_url="tcp://127.0.0.1:1", chunk_size=256, timeout=0.2, pin_max_chunks=0)), 16)
    try:
        side.link.client = _Client()

        def ask(req_id, skip):
            tokens = list(range(10, 10 + 600))
            req = SimpleNamespace(request_id=req_id, prompt_token_ids=tokens,
                                  all_token_ids=tokens, num_tokens=600, cache_salt=None,
                                  kv_transfer_params=None, skip_reading_prefix_cache=skip,
                                  sampling_params=None)
            side.on_new_request(req)
            return side.get_num_new_matched_tokens(req, 0)

        assert ask("plain", False) == 512
        assert ask("skips", True) == 0
    finally:
        side.link.client = None
        side.close()

"""Query capture without starting vLLM: the version refusal, how a request asks (bad W), the
bound on windows in flight, the hook's arm/finish on stand-in layers, and that vLLM 0.32's
own CPU and CUDA (FlashAttention) impl classes have the forward the hook relies on (the other
releases' shapes: test_query_capture_versions.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvedit.request_params import CAPTURE_FIELD, read_asks
from kvedit.vllm.capture.plan import QueryRun
from kvedit.vllm.capture.scheduler import WindowPlanner
from kvedit.vllm.capture.support import capture_unavailable
from kvedit.vllm.capture.worker import STATS, QueryCapture
from kvedit.vllm.hooks import check_capture_version
from kvedit.vllm.settings import ConnectorSettings


def test_other_vllm_versions_are_refused_with_a_clear_message(monkeypatch):
    monkeypatch.delenv("KVEDIT_ALLOW_ANY_VLLM", raising=False)
    for v in ("0.26.0+cu130", "0.29.1", "0.32.0", "0.32.3+cpu", "0.33.0"):
        check_capture_version(v)
    for v in ("0.25.1", "0.34.0", "1.0.0"):
        with pytest.raises(RuntimeError) as e:
            check_capture_version(v)
        msg = str(e.value)
        assert f"vLLM {v} is not supported" in msg and "vLLM 0.26 to 0.33" in msg
        assert '"query_capture": "off"' in msg  # how to run the connector without it
    # "on" refuses to start; "auto" says why each asking request gets nothing; "off" is off.
    with pytest.raises(RuntimeError, match="vLLM 0.34.0 is not supported"):
        capture_unavailable("on", "0.34.0")
    assert "does not support vLLM 0.34.0 (supported: 0.26 to 0.33)" in capture_unavailable(
        "auto", "0.34.0")
    assert capture_unavailable("auto", "0.26.0") is None
    assert capture_unavailable("off", "0.32.0") == 'query_capture is "off" in ' \
                                                   'kv_connector_extra_config'
    monkeypatch.setenv("KVEDIT_ALLOW_ANY_VLLM", "1")
    assert capture_unavailable("on", "0.34.0") is None


def test_bad_settings_and_bad_windows_name_what_was_expected():
    with pytest.raises(ValueError, match=r"query_capture 'yes'; expected one of \['auto', "):
        ConnectorSettings.from_extra({"query_capture": "yes"})
    assert read_asks(None).capture == read_asks({}).capture == 0
    assert read_asks({CAPTURE_FIELD: 0}).capture == 0
    assert read_asks({CAPTURE_FIELD: 64, "other": 1}).capture == 64
    for bad in (-1, 4097, 1.5, "64", True, [64]):
        asks = read_asks({CAPTURE_FIELD: bad})
        assert asks.capture == 0
        assert "expected an integer number of prompt tokens in [1, 4096]" in asks.capture_error


def _request(req_id: str, n: int, w):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(10, 10 + n)),
                           cache_salt=None, kv_transfer_params={CAPTURE_FIELD: w},
                           skip_reading_prefix_cache=False)


def test_planner_slots_bound_and_refusals(caplog):
    layout = SimpleNamespace(dtype="float32", num_layers=4, num_kv_heads=2, head_dim=64,
                             chunk_size=256, tp_rank=0, tp_size=1)
    row = 4 * 256 * 4
    planner = WindowPlanner("m", block_size=4, row_bytes=row, max_bytes=100 * row)
    a, b, bad = _request("a", 10, 6), _request("b", 95, 95), _request("c", 10, 5000)
    for r in (a, b, bad):
        planner.add(r, read_asks(r.kv_transfer_params))
    assert a.skip_reading_prefix_cache and planner.asks("a")
    assert not planner.asks("b")  # 95 rows would pass the 100-row bound with a's 6 in flight
    assert not bad.skip_reading_prefix_cache and not planner.asks("c")
    assert "request b asked for query capture but gets none" in caplog.text
    # a's window is tokens [4, 10); blocks [7, 3, 9]: token p sits in slot 4*block + p%4.
    first = planner.plan("a", [7, 3, 9], 0, 6, [layout])   # tokens [0, 6): rows 0-1
    second = planner.plan("a", [7, 3, 9], 6, 4, [layout])  # tokens [6, 10): rows 2-5
    assert (first.rows, first.row0, first.slots) == (6, 0, [12, 13])
    assert (second.row0, second.slots) == (2, [14, 15, 36, 37])
    assert planner.in_flight == 0  # fully planned: the worker stores it this step
    assert planner.plan("a", [7, 3, 9], 10, 1, [layout]) is None   # past the window
    planner.finished("a")
    assert planner.take_drops() == ["a"] and planner.take_drops() == []


class _Short:
    def forward(self, query):
        return query


class _Impl:
    """Stands in for a vLLM attention impl: same forward parameters, records the query."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        self.seen = query
        return output


def test_hook_is_in_place_only_on_capturing_steps():
    layers = [SimpleNamespace(impl=_Impl(), num_heads=2, head_size=3) for _ in range(2)]
    cap = QueryCapture(layers, ["model.layers.0.attn", "model.layers.1.attn"], tp_rank=0)
    fc = SimpleNamespace(slot_mapping={"model.layers.0.attn": torch.tensor([40, 9, 41, -1])})

    before = STATS.gathers
    for impl in cap.impls:
        assert "forward" not in impl.__dict__  # no capture: vLLM's own method runs
    cap.arm([QueryRun("r", [b"k"], rows=2, row0=0, slots=[41, 9])], fc)
    q = torch.arange(4 * 6, dtype=torch.float32).view(4, 2, 3)
    for layer in layers:
        layer.impl.forward(layer, q * (1 + (layer is layers[1])), None, None, None, None)
    (ready,) = cap.finish()
    assert STATS.gathers - before == 2
    assert all("forward" not in impl.__dict__ for impl in cap.impls)  # removed again
    want = torch.stack([q.view(4, 6)[[2, 1]], 2 * q.view(4, 6)[[2, 1]]])
    assert ready.key == b"k" and torch.equal(ready.data, want)


def test_vllm_impl_classes_have_the_hooked_signature():
    """The CUDA class is only inspected (its module imports on CPU); no kernel runs."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from kvedit.vllm.capture.worker import _check_impl

    for cls in (CPUAttentionBackendImpl, FlashAttentionImpl):
        _check_impl("layer", object.__new__(cls))
    with pytest.raises(RuntimeError, match="expected it to start with"):
        _check_impl("layer", _Short())


def _sched_config():
    dims = dict(get_num_layers=lambda pc: 4, get_num_attention_heads=lambda pc: 4,
                get_head_size=lambda: 64, dtype=torch.float32)
    from transformers import Qwen3Config

    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="m", hf_config=Qwen3Config(),
                                     get_num_kv_heads=lambda pc: 2, **dims),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"))


def test_connector_scheduler_refuses_or_warns_on_another_vllm(monkeypatch, caplog):
    """The connector's scheduler side on a vLLM capture does not support: "on" stops vLLM's
    start with the refusal, "auto" serves and says why."""
    import vllm

    from kvedit.vllm.scheduler_side import SchedulerSide

    monkeypatch.delenv("KVEDIT_ALLOW_ANY_VLLM", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    settings = dict(kvedit_url="tcp://127.0.0.1:1", chunk_size=256, timeout=0.2)
    with pytest.raises(RuntimeError, match=r"kvedit query capture: vLLM 0.34.0 is not "
                                           r"supported; .*vLLM 0.26 to 0.33"):
        SchedulerSide(_sched_config(), ConnectorSettings.from_extra(
            {"query_capture": "on", **settings}), 128)
    side = SchedulerSide(_sched_config(), ConnectorSettings.from_extra(settings), 128)
    try:
        req = _request("r1", 50, 16)
        side.on_new_request(req)
        assert not side.queries.asks("r1") and not req.skip_reading_prefix_cache
        assert "request r1 asked for query capture but gets none: query capture does not " \
               "support vLLM 0.34.0 (supported: 0.26 to 0.33)" in caplog.text
    finally:
        side.close()


def test_split_window_fills_across_steps_and_is_freed_when_dropped():

    layers = [SimpleNamespace(impl=_Impl(), num_heads=1, head_size=2) for _ in range(2)]
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    cap = QueryCapture(layers, names, tp_rank=0)
    q = torch.arange(8, dtype=torch.float32).view(4, 1, 2)

    def step(runs, slots, run_layers=layers):
        cap.arm(runs, SimpleNamespace(slot_mapping={names[0]: torch.tensor(slots)}))
        for layer in run_layers:
            layer.impl.forward(layer, q, None, None, None, None)
        return cap.finish()

    # Window of 3 rows: rows 0-1 in one step, row 2 in the next -> one object.
    assert step([QueryRun("a", [b"ka"], 3, 0, [5, 6])], [4, 5, 6, -1]) == []
    assert set(cap.partial) == {"a"}
    (ready,) = step([QueryRun("a", [b"ka"], 3, 2, [7])], [7, -1, -1, -1])
    assert torch.equal(ready.data[0], torch.tensor([[2., 3.], [4., 5.], [0., 1.]]))
    assert cap.partial == {}
    # A request that finishes (or is aborted) mid-window: its rows are freed.
    dropped = STATS.dropped
    step([QueryRun("b", [b"kb"], 3, 0, [4])], [4, 5, 6, 7])
    cap.drop(["b"])
    assert cap.partial == {} and STATS.dropped == dropped + 1
    # A step where a layer ran without the hook (e.g. a CUDA graph replay): nothing stored.
    assert step([QueryRun("c", [b"kc"], 1, 0, [4])], [4, 5, 6, 7], layers[:1]) == []
    assert STATS.dropped == dropped + 2
    # Wanted slots that are not in the batch: the step is not armed, nothing is hooked.
    cap.arm([QueryRun("d", [b"kd"], 1, 0, [99])],
            SimpleNamespace(slot_mapping={names[0]: torch.tensor([4, 5])}))
    assert cap.step is None and all("forward" not in i.__dict__ for i in cap.impls)

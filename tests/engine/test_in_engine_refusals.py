"""What in-engine budgets refuse, and how: a request asking for a budget where one cannot apply
is finished with an error (HTTP 500 from the OpenAI server; the reason, naming the feature,
in vLLM's log) without being scheduled, while other requests run as usual; an unsupported
vLLM or model runner is refused when the engine starts, naming the version or the setting.

Engines: the session vLLM (in-engine budgets off), and one vLLM running speculative
decoding with budgets on. The decisions for pipeline and tensor parallel are checked on
vLLM's own config objects (building those starts nothing).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest

from kvedit.engine_budget import EngineBudget
from kvedit.request_params import RequestAsks
from tests.engine.test_in_engine import MODEL, prompt_of
from tests.fixtures_vllm import CHUNK


BUDGET = RequestAsks(budget=EngineBudget(256, 64, "key_norm")).to_params()


def post(vp, model: str, body: dict) -> dict:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(vp.base_url + "/v1/completions",
                                 data=json.dumps({"model": model, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code}


def refused_beside_a_plain_request(vp, model: str, why: str) -> None:
    prompt = prompt_of(200, seed=1)
    plain = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = post(vp, model, plain)["choices"][0]["text"]
    with cf.ThreadPoolExecutor(2) as ex:
        bad = ex.submit(post, vp, model, {**plain, "kv_transfer_params": BUDGET})
        good = ex.submit(post, vp, model, plain)
        assert bad.result() == {"status": 500}
        assert good.result()["choices"][0]["text"] == alone
    log = vp.log_path.read_text()
    assert re.search(r"refused \(finished with an error\): it asks for an in-engine budget, "
                     r"but " + why, log), why


def test_budgets_are_refused_where_the_connector_runs_without_them(vllm_server):
    refused_beside_a_plain_request(vllm_server, "tiny-qwen3",
                                   r'in-engine budgets are off in this vLLM \(start it with '
                                   r'kv_connector_extra_config \{"in_engine": true\}\)')


def test_budgets_are_refused_beside_speculative_decoding(tiny_model, kv_server):
    from kvedit.launch.vllm import start_vllm

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with start_vllm(tiny_model, server=kv_server, served_model_name=MODEL, dtype="float32",
                    kv_cache_gib=0.25, max_model_len=2048, chunk_size=CHUNK,
                    connector_config={"in_engine": True},
                    extra_args=["--speculative-config", spec]) as vp:
        refused_beside_a_plain_request(vp, MODEL, "this vLLM runs speculative decoding")


@pytest.mark.parametrize("kw,why", [
    ({"pipeline_parallel_size": 2}, "pipeline parallel"),
    ({"tensor_parallel_size": 2}, "tensor parallel"),
])
def test_parallel_engines_refuse_budgets_with_the_reason(tiny_model, kw, why):
    from vllm.engine.arg_utils import EngineArgs

    from kvedit.vllm.scheduler_side import _budget_scheduler
    from kvedit.vllm.settings import ConnectorSettings

    cfg = EngineArgs(model=str(tiny_model), enforce_eager=True, **kw).create_engine_config()
    on = ConnectorSettings.from_extra({"in_engine": True})
    budgets = _budget_scheduler(cfg, on, 128)
    assert why in budgets.unavailable
    plain = EngineArgs(model=str(tiny_model), enforce_eager=True).create_engine_config()
    assert _budget_scheduler(plain, on, 128).unavailable is None


def test_an_unchecked_vllm_is_refused_at_start_naming_version_and_setting(monkeypatch):
    from kvedit.vllm.hooks import ALLOW_ANY_VLLM_ENV, check_in_engine_version

    monkeypatch.delenv(ALLOW_ANY_VLLM_ENV, raising=False)
    check_in_engine_version("0.32.0")
    check_in_engine_version("0.26.1+cu130")
    with pytest.raises(RuntimeError, match=r'"in_engine": true\) do not support vLLM 0\.29\.2; '
                                           r'.*checked on vLLM 0\.26 and 0\.32 only'):
        check_in_engine_version("0.29.2")


def test_the_v2_model_runner_is_refused_naming_the_setting():
    # A stand-in for CUDA vLLM 0.26's Model Runner V2 (this machine has no CUDA): only its
    # module name and its lack of the V1 runner's attributes matter to the check.
    from kvedit.vllm.budget.worker import check_runner

    mrv2 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})()
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_runner(mrv2)
    with pytest.raises(RuntimeError, match="could not find vLLM's model runner"):
        check_runner(None)

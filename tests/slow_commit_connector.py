"""kvedit's connector with a slowed background commit, for tests/engine/test_connector_async.py.

vLLM imports this module (kv_connector_module_path) in its engine process. Everything is the
real connector; only the background thread's copy + commit of each store waits first for the
number of seconds written in the file named by $KVEDIT_TEST_COMMIT_DELAY_FILE (read at each
commit, so one vLLM serves several cases). On a GPU that commit takes ~22 ms for an 8k
Qwen3-8B prompt; on the tiny model on a CPU it takes ~1 ms, less than a client's round trip,
so without the delay a test could not tell whether the scheduler side waited for it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from kvedit.vllm.connector import KVEditConnector
from kvedit.vllm.transfer import copier

DELAY_FILE_ENV = "KVEDIT_TEST_COMMIT_DELAY_FILE"
_finish = copier.PagedCopier._finish


def _delay() -> float:
    try:
        return float(Path(os.environ[DELAY_FILE_ENV]).read_text() or 0)
    except (KeyError, OSError, ValueError):
        return 0.0


def _slow_finish(self, job) -> None:
    time.sleep(_delay())
    _finish(self, job)


copier.PagedCopier._finish = _slow_finish


class SlowCommitConnector(KVEditConnector):
    pass

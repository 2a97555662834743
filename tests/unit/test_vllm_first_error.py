"""When vLLM fails at start its log ends with the API server's traceback ("See root cause
above"); start_vllm's error names the engine core's or a worker's first exception instead."""
from kvedit.launch.vllm import first_error

LOG = """\
(APIServer pid=965) WARNING 12-01 21:16:12 [system_utils.py:299] Found ulimit of 20000 and failed to automatically increase: can cause fd limit errors like `OSError: [Errno 24] Too many open files`.
(EngineCore pid=4300) ERROR 12-01 21:05:10 [core.py:700] EngineCore failed to start.
(EngineCore pid=4300) ERROR 12-01 21:05:10 [core.py:700] Traceback (most recent call last):
(EngineCore pid=4300) ERROR 12-01 21:05:10 [core.py:700]   File "gpu_worker.py", line 1, in init
(EngineCore pid=4300) ERROR 12-01 21:05:10 [core.py:700] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
(EngineCore pid=4300) ERROR 12-01 21:05:10 [core.py:700] ValueError: a later error
(APIServer pid=4274) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_engine_cores_first_exception_not_the_api_servers_or_a_warning():
    assert first_error(LOG.splitlines()).endswith(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_falls_back_to_any_exception_then_to_nothing():
    api_only = [line for line in LOG.splitlines() if "EngineCore" not in line]
    assert first_error(api_only).startswith("(APIServer pid=4274) RuntimeError: Engine core")
    assert first_error(api_only[:1]) == ""      # a warning that mentions an error is not one
    assert first_error([]) == ""

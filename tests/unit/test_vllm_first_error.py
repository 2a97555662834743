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


def _serve(status: int):
    """A real HTTP server on 127.0.0.1 whose /health answers `status`."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def test_a_vllm_that_stopped_serving_is_named_with_its_logs_first_error(tmp_path):
    """An engine that dies mid-run (the OOM kill of 2026-12-07) failed every stream in flight
    with HTTP 500s; the eval now says the engine stopped, and why its log says."""
    from kvedit.launch.server import free_port
    from kvedit.launch.vllm import engine_down

    ok, ok_url = _serve(200)
    dead, dead_url = _serve(500)
    try:
        assert engine_down(ok_url) is None
        log = tmp_path / "vllm.log"
        log.write_text(LOG)
        msg = engine_down(dead_url, log)
        assert "answered HTTP 500" in msg and "CUDA out of memory" in msg and str(log) in msg
    finally:
        ok.shutdown()
        dead.shutdown()
    gone = engine_down(f"http://127.0.0.1:{free_port()}", timeout=2)
    assert gone is not None and "unreachable" in gone

"""The server runs without the `l2` extra (redis, xxhash); only --l2-url needs it, and then it
says which extra to install. The extra is hidden in a child process by a sitecustomize that
makes any import of redis/xxhash fail, as on a machine that never installed them."""
from __future__ import annotations

import subprocess
import sys

import httpx

from kvedit.launch.server import free_port, start_server

HIDE = """import sys
for name in ("redis", "xxhash"):
    sys.modules[name] = None   # import now raises ImportError
"""


def _hidden_env(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{sys.path[0]}")


def test_server_starts_and_serves_without_the_l2_extra(tmp_path, monkeypatch):
    _hidden_env(tmp_path, monkeypatch)
    probe = subprocess.run([sys.executable, "-c", "import redis"], capture_output=True)
    assert probe.returncode != 0   # the hiding works in children
    with start_server(0.05) as srv:
        status = httpx.get(f"{srv.http_url}/status", timeout=10).json()
    assert status["objects"]["ready"] == 0 and "l2" not in status


def test_l2_url_without_the_extra_is_a_clear_error(tmp_path, monkeypatch):
    _hidden_env(tmp_path, monkeypatch)
    r = subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--l1-size-gb", "0.05",
                        "--port", str(free_port()), "--http-port", str(free_port()),
                        "--shm-name", "", "--l2-url", "redis://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "needs the `l2` extra" in out and "pip install 'kvedit[l2]'" in out, out[-2000:]

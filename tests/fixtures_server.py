"""Session fixture `kv_server`: one real kvedit server process (shm, LRU, 2 GiB lazy, chunk 256)."""
from __future__ import annotations

import pytest

from kvedit.server.launch import start_server


@pytest.fixture(scope="session")
def kv_server():
    server = start_server(2.0, chunk_size=256, shm=True, eviction="LRU", lazy=True)
    try:
        yield server
    finally:
        server.stop()

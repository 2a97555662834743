"""Shared session fixtures: one kvedit server and one vLLM for the whole test session."""
pytest_plugins = ["tests.fixtures_server", "tests.fixtures_vllm"]

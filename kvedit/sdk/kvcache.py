"""Seed-compatible module (LMCache SDK name): `from kvedit.sdk.kvcache import connect, close`."""
from kvedit.sdk.context import Context, aclose, aconnect, close, connect

__all__ = ["Context", "connect", "close", "aconnect", "aclose"]

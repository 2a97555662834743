"""`kvcache.connect`: a context for the KV cache (LMCache SDK 0.5.x's module)."""
from __future__ import annotations

from kvedit.compat.lmcache.context import LMCacheSDKCacheKind, LMCacheSDKContext

__all__ = ["connect"]


def connect(url: str, http_url: str, model_name: str, timeout: float = 60.0) -> LMCacheSDKContext:
    """A KV context for `model_name` on the kvedit server at `url` (ZMQ) / `http_url`."""
    return LMCacheSDKContext(url, http_url, model_name, LMCacheSDKCacheKind.KV, timeout)

"""`qcache.connect`: a context for the query cache (LMCache SDK 0.5.x's module).

Request streams holding this context ask vLLM (kvedit's connector) to capture the queries of
their whole prompt at prefill; an edit function then finds them under
`LMCacheSDKCacheKind.QUERY` (docs/sdk.md, "Porting from LMCache's SDK").
"""
from __future__ import annotations

from kvedit.compat.lmcache.context import LMCacheSDKCacheKind, LMCacheSDKContext

__all__ = ["connect"]


def connect(url: str, http_url: str, model_name: str, timeout: float = 60.0) -> LMCacheSDKContext:
    """A QUERY context for `model_name` (the base name; kvedit keeps no `##query` model)."""
    return LMCacheSDKContext(url, http_url, model_name, LMCacheSDKCacheKind.QUERY, timeout)

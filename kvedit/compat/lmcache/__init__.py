"""LMCache's SDK (`lmcache.sdk`, 0.5.x) on kvedit: `import kvedit.compat.lmcache as lmc_sdk`.

The same modules and names: `connect(kind, ...)`, `LMCacheSDKCacheKind`, `kvcache`, `qcache`,
`context`, `request`, `batch`. Every stream, request and edit runs through kvedit's SDK
(kvedit.sdk); docs/sdk.md ("Porting from LMCache's SDK") lists each name's kvedit
counterpart and where behaviour differs.
"""
from __future__ import annotations

from kvedit.compat.lmcache import batch, context, kvcache, qcache, request
from kvedit.compat.lmcache.cache_kind import LMCacheSDKCacheKind

__all__ = ["batch", "context", "kvcache", "qcache", "request", "LMCacheSDKCacheKind",
           "connect"]


def connect(kind: LMCacheSDKCacheKind, url: str, http_url: str, model_name: str,
            timeout: float = 60.0) -> context.LMCacheSDKContext:
    """A context of `kind` (KV or QUERY) for `model_name` on the kvedit server at `url`."""
    kind = context.check_kind(kind)
    if kind is LMCacheSDKCacheKind.KV:
        return kvcache.connect(url=url, http_url=http_url, model_name=model_name,
                               timeout=timeout)
    return qcache.connect(url=url, http_url=http_url, model_name=model_name, timeout=timeout)

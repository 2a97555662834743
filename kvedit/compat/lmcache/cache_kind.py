"""LMCacheSDKCacheKind: which tensor family a context serves (LMCache SDK 0.5.x's enum).

LMCache keeps each kind under its own server model name (`<model>##query` for queries).
kvedit keeps captured queries under the model's own name, as the server's object kind
`queries` (docs/queries.md), so `server_model_name` is the identity here; it stays because
LMCache code may call it.
"""
from __future__ import annotations

import enum

QUERY_SUFFIX = "##query"   # LMCache's model-name suffix for its query cache


class LMCacheSDKCacheKind(enum.Enum):
    """KV: the model's keys and values. QUERY: the prompt's queries, captured at prefill."""

    KV = "kv"
    QUERY = "query"

    def server_model_name(self, model_name: str) -> str:
        """The name the kvedit server keeps this kind under: the model's own, for both."""
        return model_name

    def base_model_name(self, model_name: str) -> str:
        """The model name without LMCache's query suffix (accepts LMCache-style names)."""
        if self is LMCacheSDKCacheKind.QUERY:
            return model_name.removesuffix(QUERY_SUFFIX)
        return model_name

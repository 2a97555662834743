"""Small helpers shared by the server/client tests: a tiny layout and content tied to its key."""
from __future__ import annotations

import hashlib

import torch

from kvedit.layout import ModelLayout

# 256 KiB a chunk: small enough for pools of a few MiB in eviction tests.
SMALL = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32", chunk_size=256)


def key(i: int, tag: str = "") -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()


def chunk_for(k: bytes, layout: ModelLayout = SMALL) -> torch.Tensor:
    """Deterministic content derived from the key: any torn or swapped read shows."""
    g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little") & (2**63 - 1))
    return torch.randn(layout.chunk_shape, generator=g).to(getattr(torch, layout.dtype))


def matches(k: bytes, t: torch.Tensor, layout: ModelLayout = SMALL) -> bool:
    return torch.equal(t, chunk_for(k, layout))

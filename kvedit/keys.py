"""Chunk keys: a prefix-hash chain over token ids, shared by the connector and the SDK.

h_0 = H(namespace), h_i = H(h_{i-1} || little-endian uint32 tokens of chunk i). Only full
chunks get keys. The namespace binds the model name, cache salt, KV dtype/layout and the
tensor-parallel rank, so two of them never share a key. blake2b is deterministic across
processes and machines (unlike Python's hash()).
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import numpy as np

from kvedit.layout import ModelLayout

KEY_BYTES = 16


def namespace(model: str, layout: ModelLayout, cache_salt: str = "") -> bytes:
    parts = [
        "kvedit-v1", model, cache_salt, layout.dtype,
        f"L{layout.num_layers}H{layout.num_kv_heads}D{layout.head_dim}C{layout.chunk_size}",
        f"tp{layout.tp_rank}/{layout.tp_size}",
    ]
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:  # length-prefixed so ("ab","c") and ("a","bc") differ
        b = p.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian uint32 bytes of `tokens`; ValueError unless every id is in [0, 2**32).
    A list goes through array('I'), which range-checks as it converts (4x faster than
    numpy for the lists vLLM hands the connector's scheduler side)."""
    if not isinstance(tokens, (list, tuple)):   # numpy, torch, other sequences
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)")
        return arr.astype("<u4").tobytes()
    try:
        a = array.array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be in [0, 2**32) ({e})") from None
    if a.itemsize != 4:   # C unsigned int is 4 bytes on every platform torch runs on
        return np.asarray(a, dtype="<u4").tobytes()
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def chunk_keys(tokens: Sequence[int] | np.ndarray, chunk_size: int, ns: bytes,
               max_chunks: int | None = None, known: Sequence[bytes] = ()) -> list[bytes]:
    """Keys of the full chunks of `tokens` (at most `max_chunks` of them). `known`: the
    keys of its leading chunks already computed (for the same tokens and namespace), which
    are kept and extended: only the chunks after them are read and hashed."""
    n = len(tokens) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    have = min(len(known), n)
    keys = list(known[:have])
    if have == n:
        return keys
    data = _token_bytes(tokens[have * chunk_size: n * chunk_size])
    step = chunk_size * 4
    prev = keys[-1] if keys else ns
    for i in range(n - have):
        prev = hashlib.blake2b(prev + data[i * step:(i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def request_keys(model: str, layout: ModelLayout, tokens: Sequence[int] | np.ndarray,
                 cache_salt: str = "") -> list[bytes]:
    """The keys the connector stores `tokens` under (and the SDK looks them up with)."""
    return chunk_keys(tokens, layout.chunk_size, namespace(model, layout, cache_salt))


def query_key(ns: bytes, prompt_tokens: Sequence[int] | np.ndarray, window: int) -> bytes:
    """Key of the captured queries of the last `window` tokens of a whole prompt (not only its
    full chunks: the window may end in the partial last chunk). Shares the namespace with the
    chunk keys (model, salt, layout, TP rank) but can never equal one: a chunk key hashes
    prev-key || tokens, this one a fixed tag first."""
    arr = np.asarray(prompt_tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    if window <= 0:
        raise ValueError(f"query window must be a positive number of tokens, got {window}")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(b"kvedit-queries\0" + ns + int(window).to_bytes(4, "little")
             + len(arr).to_bytes(8, "little") + arr.astype("<u4").tobytes())
    return h.digest()

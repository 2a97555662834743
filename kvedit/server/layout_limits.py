"""What the server accepts as a model layout, beyond ModelLayout.validate's own rules.

Why bounds: a registered layout is echoed in every store and retrieve reply, compared on
every Register, listed in /status, and its numbers drive clients (the SDK waits for
`tp_size` ranks and gathers `total_kv_heads` heads). `validate()` only asks for positive
numbers, so a layout with `tp_size` 2^63-1 or a RoPE `scaling` map of a hundred thousand
entries was accepted. The bounds below are far above any real model (the largest today:
~128 layers, 128 KV heads, head_dim 576, tensor parallelism of 64) and keep each field a
size the loop handles in microseconds.
"""
from __future__ import annotations

import math

from kvedit.layout import ModelLayout

MAX_LAYERS = 1024
MAX_KV_HEADS = 4096          # per rank, and over all ranks
MAX_HEAD_DIM = 16384
MAX_TP_SIZE = 4096
MAX_ROPE_ENTRIES = 64        # entries of RopeParams.scaling
MAX_ROPE_STRING = 256        # characters of rope_type, of a scaling key or string value
MAX_POSITIONS = 1 << 40


def check(layout: ModelLayout) -> None:
    """Raise ValueError naming the field over its bound and the bound."""
    for name, bound in (("num_layers", MAX_LAYERS), ("num_kv_heads", MAX_KV_HEADS),
                        ("head_dim", MAX_HEAD_DIM), ("tp_size", MAX_TP_SIZE),
                        ("total_kv_heads", MAX_KV_HEADS)):
        if getattr(layout, name) > bound:
            raise ValueError(f"layout.{name} {getattr(layout, name)} is over the server's bound "
                             f"{bound}")
    rope = layout.rope
    if rope is None:
        return
    if not (math.isfinite(rope.theta) and rope.theta > 0):
        raise ValueError(f"layout.rope.theta must be a finite positive number, got {rope.theta}")
    if not 0 <= rope.rotary_dim <= layout.head_dim:
        raise ValueError(f"layout.rope.rotary_dim {rope.rotary_dim} must be 0..head_dim "
                         f"({layout.head_dim})")
    if not 0 <= rope.max_position_embeddings <= MAX_POSITIONS:
        raise ValueError(f"layout.rope.max_position_embeddings "
                         f"{rope.max_position_embeddings} must be 0..{MAX_POSITIONS}")
    if len(rope.rope_type) > MAX_ROPE_STRING:
        raise ValueError(f"layout.rope.rope_type is {len(rope.rope_type)} characters, at most "
                         f"{MAX_ROPE_STRING}")
    if len(rope.scaling) > MAX_ROPE_ENTRIES:
        raise ValueError(f"layout.rope.scaling has {len(rope.scaling)} entries, at most "
                         f"{MAX_ROPE_ENTRIES}")
    for k, v in rope.scaling.items():
        if len(k) > MAX_ROPE_STRING or (isinstance(v, str) and len(v) > MAX_ROPE_STRING):
            raise ValueError(f"layout.rope.scaling entry {k[:40]!r} is over "
                             f"{MAX_ROPE_STRING} characters")

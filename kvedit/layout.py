"""A model's KV layout and RoPE parameters: what the connector registers and edits need."""
from __future__ import annotations

import msgspec

# dtype names on the wire are torch's attribute names.
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
}


class RopeParams(msgspec.Struct, frozen=True, kw_only=True):
    """Rotary embedding of the keys, as the model config describes it.

    `rope_type` is transformers' name ("default", "linear", "llama3", "yarn", "dynamic", ...);
    `scaling` holds the rest of the config's `rope_scaling` dict (factor, low_freq_factor, ...).
    `rotary_dim` < head_dim means partial rotary (only the first rotary_dim dims rotate).
    `is_neox` is the rotate-half style (Llama, Qwen); False is GPT-J's interleaved pairs.
    """
    theta: float = 10000.0
    rotary_dim: int = 0
    is_neox: bool = True
    rope_type: str = "default"
    scaling: dict[str, float | int | str | bool | None] = {}
    max_position_embeddings: int = 0


class ModelLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of one KV chunk object: [2, num_layers, chunk_size, num_kv_heads * head_dim].

    `num_kv_heads` is per tensor-parallel rank (what this rank's worker holds).
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rope: RopeParams | None = None

    @property
    def hidden(self) -> int:
        """D: the last dimension of the KV tensor."""
        return self.num_kv_heads * self.head_dim

    @property
    def chunk_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_layers, self.chunk_size, self.hidden)

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.num_layers * self.chunk_size * self.hidden * DTYPE_SIZES[self.dtype]

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"layout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"layout.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"layout.tp_rank {self.tp_rank} outside [0, {self.tp_size})")

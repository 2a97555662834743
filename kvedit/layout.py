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


class ModelLayout(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Shape of one KV chunk object: [2, num_layers, chunk_size, num_kv_heads * head_dim].

    `num_kv_heads` is per tensor-parallel rank (what this rank's worker holds).
    `total_kv_heads`: the model's KV heads over all ranks. The per-rank fields cannot say it
    when tp_size exceeds the head count (vLLM then replicates each head on several ranks, and
    1 head per rank fits several totals), and the SDK needs it to gather the ranks' heads
    (kvedit.sdk.tp). Connectors set it when tp_size > 1; 0 = not said (one rank, or an older
    connector). omit_defaults: fields at their default are not sent, so a peer that predates
    a field decodes the layout (it ignores the ones it does not know, and fills in defaults).
    `num_q_heads`: the attention query heads per rank, the width of the captured-queries
    object (kvedit.query_contract); 0 = not said (a connector that predates it: captured
    queries of such a registration are refused, naming why).
    """
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rope: RopeParams | None = None
    total_kv_heads: int = 0
    num_q_heads: int = 0

    def with_total_kv_heads(self, total: int) -> ModelLayout:
        """This layout saying the model's total KV head count (only when tp_size > 1: with
        one rank it is num_kv_heads, and the layout stays as older connectors sent it)."""
        if self.tp_size == 1:
            return self
        return msgspec.structs.replace(self, total_kv_heads=int(total))

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
        if self.total_kv_heads:
            self._validate_total(self.total_kv_heads)
        if self.num_q_heads < 0 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"layout.num_q_heads {self.num_q_heads} must be a multiple of "
                             f"layout.num_kv_heads {self.num_kv_heads} (grouped-query "
                             f"attention; 0 = not said)")

    def _validate_total(self, total: int) -> None:
        """vLLM's split: n ranks over h heads hold h // n each (n divides h), or 1 each with
        every head replicated on n // h ranks (h divides n)."""
        n = self.tp_size
        if total <= 0 or (n <= total and total % n) or (n > total and n % total):
            raise ValueError(f"layout.total_kv_heads {total} cannot be split over tp_size {n} "
                             f"ranks: expected a positive count that divides or is divided "
                             f"by tp_size")
        if max(1, total // n) != self.num_kv_heads:
            raise ValueError(f"layout.total_kv_heads {total} over tp_size {n} gives "
                             f"{max(1, total // n)} heads per rank; layout.num_kv_heads is "
                             f"{self.num_kv_heads}")

"""The query-capture contract, shared by both sides of the wire.

A request asks vLLM (through the kvedit connector) to keep the post-RoPE queries of its last
W prompt tokens (the capture field of its kv_transfer_params: kvedit.request_params); the
connector stores them in the kvedit server as one object per tensor-parallel rank, and the
SDK reads them back for an edit function. Both sides import this module, so the bound on W,
how the SDK's setting is checked and what the stored object looks like are written once:

- `MAX_WINDOW`, `is_window`: the largest W and the check of a W (a request's, read by
  kvedit.request_params);
- `check_window`: the SDK's setting (None, 0 = off, or 1..MAX_WINDOW);
- `CaptureRows`: which prompt rows a window holds (the last min(W, prompt length));
- `QueryShape`: the stored object, `[num_layers, rows, num_q_heads * head_dim]` C-contiguous
  in the model dtype, from the rank's registered `ModelLayout` (which says `num_q_heads`), so
  a reader never infers the shape from the byte count.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvedit.layout import DTYPE_SIZES, ModelLayout

MAX_WINDOW = 4096                          # the most prompt tokens one request may ask for


def is_window(w, low: int = 1) -> bool:
    """Whether `w` is a window: an int (not a bool) in [low, MAX_WINDOW]."""
    return not isinstance(w, bool) and isinstance(w, int) and low <= w <= MAX_WINDOW


def check_window(window, what: str) -> int | None:
    """A window setting of the SDK: None (not set) or an int in [0, MAX_WINDOW] (0 = off);
    ValueError naming `what` otherwise."""
    if window is None:
        return None
    if not is_window(window, 0):
        raise ValueError(f"{what} must be a number of prompt tokens in 1..{MAX_WINDOW} (0 or "
                         f"None = off), got {window!r}")
    return window


@dataclass(frozen=True, slots=True)
class CaptureRows:
    """The prompt rows a window of `window` tokens holds: the last `rows` of the prompt."""
    window: int
    prompt_len: int

    @property
    def rows(self) -> int:
        return min(self.window, self.prompt_len)

    @property
    def start(self) -> int:
        """Prompt position of row 0."""
        return self.prompt_len - self.rows


@dataclass(frozen=True, slots=True)
class QueryShape:
    """One rank's stored queries object: [num_layers, rows, num_q_heads * head_dim]."""
    num_layers: int
    rows: int
    num_q_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, layout: ModelLayout, rows: int) -> QueryShape:
        """The object `rows` rows make on the rank `layout` describes; ValueError when the
        layout does not say its query heads (registered by a connector that predates
        ModelLayout.num_q_heads)."""
        if not layout.num_q_heads:
            raise ValueError(
                f"the model's registered layout (tp_rank {layout.tp_rank}) does not say its "
                f"query heads (num_q_heads): it was registered by a kvedit connector older "
                f"than captured-queries shapes; restart vLLM with this kvedit's connector "
                f"(and the kvedit server, or unregister the model) so it registers them")
        return cls(layout.num_layers, rows, layout.num_q_heads, layout.head_dim, layout.dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.rows, self.num_q_heads * self.head_dim)

    @property
    def row_bytes(self) -> int:
        """One window row on this rank (every layer)."""
        return self.num_layers * self.num_q_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def check(self, nbytes: int) -> None:
        """ValueError unless a stored object of `nbytes` bytes has this shape."""
        if nbytes != self.nbytes:
            raise ValueError(f"the stored queries are {nbytes} bytes, not {list(self.shape)} "
                             f"{self.dtype} ({self.nbytes} bytes)")

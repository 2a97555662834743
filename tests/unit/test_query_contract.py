"""The query-capture contract (kvedit.query_contract) and the layout field it reads.

Both sides of the wire import one module: the SDK's window setting and the engine's reading
of a request (kvedit.request_params) agree on the bound; the stored object's shape comes from
the registered layout (`num_q_heads`), which older peers ignore and which a registration
from an older connector lacks (then refused by name, never guessed from a byte count).
"""
from __future__ import annotations

import msgspec
import pytest

from kvedit import query_contract as QC
from kvedit.layout import ModelLayout
from kvedit.request_params import CAPTURE_FIELD, RequestAsks, read_asks
LAY = ModelLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_size=256,
                  num_q_heads=4)


@pytest.mark.parametrize("w", [1, 64, QC.MAX_WINDOW])
def test_both_sides_accept_the_same_windows(w):
    assert QC.check_window(w, "w") == w == read_asks(RequestAsks(capture=w).to_params()).capture


@pytest.mark.parametrize("bad", [-1, QC.MAX_WINDOW + 1, 2.5, True, "32", [8]])
def test_both_sides_refuse_the_same_windows(bad):
    with pytest.raises(ValueError, match=r"w must be a number of prompt tokens in 1\.\.4096"):
        QC.check_window(bad, "w")
    asks = read_asks({CAPTURE_FIELD: bad})
    assert asks.capture == 0 and "kvedit_capture_queries'] is" in asks.capture_error
    assert "expected an integer number of prompt tokens in [1, 4096]" in asks.capture_error


def test_off_and_absent():
    assert QC.check_window(None, "w") is None and QC.check_window(0, "w") == 0
    assert read_asks(None).capture == read_asks({"x": 1}).capture == 0
    assert read_asks({CAPTURE_FIELD: 0}) == read_asks({}) == RequestAsks()


def test_capture_rows_are_the_last_rows_of_the_prompt():
    assert (QC.CaptureRows(32, 100).rows, QC.CaptureRows(32, 100).start) == (32, 68)
    assert (QC.CaptureRows(400, 100).rows, QC.CaptureRows(400, 100).start) == (100, 0)


def test_query_shape_comes_from_the_layout():
    shape = QC.QueryShape.of(LAY, 8)
    assert shape.shape == (3, 8, 64) and shape.row_bytes == 3 * 64 * 2
    assert shape.nbytes == 8 * shape.row_bytes
    shape.check(shape.nbytes)
    with pytest.raises(ValueError, match=r"are 1536 bytes, not \[3, 8, 64\] bfloat16"):
        shape.check(shape.nbytes // 2)   # two query heads would fit a byte count; refused
    older = msgspec.structs.replace(LAY, num_q_heads=0)
    with pytest.raises(ValueError, match="does not say its query heads .*restart vLLM"):
        QC.QueryShape.of(older, 8)


class _LayoutBefore(msgspec.Struct, frozen=True, kw_only=True):
    """ModelLayout as it was before num_q_heads (an older peer)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rope: object = None
    total_kv_heads: int = 0


def test_num_q_heads_is_compatible_both_ways_and_validated():
    enc, dec = msgspec.msgpack.encode, msgspec.msgpack.decode
    old = dec(enc(LAY), type=_LayoutBefore)            # an older peer ignores the field
    assert (old.num_layers, old.num_kv_heads) == (3, 2)
    assert dec(enc(old), type=ModelLayout).num_q_heads == 0   # from an older peer: not said
    assert b"num_q_heads" not in enc(msgspec.structs.replace(LAY, num_q_heads=0))
    for bad in (3, -2):
        with pytest.raises(ValueError, match="num_q_heads .* must be a multiple of"):
            msgspec.structs.replace(LAY, num_q_heads=bad).validate()

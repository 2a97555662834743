"""Wire messages between KVClient and the kvedit server (msgpack via msgspec; never pickle).

Every ZMQ message is multipart: [request id, message]. The request id is an opaque client
token (≤ 16 bytes) echoed in the reply, so a client can drop late replies of a timed-out call.
The message is a msgpack map tagged by its "t" field. Chunk bytes never ride on ZMQ: in
shared-memory mode they move through slot offsets in the segment, in socket mode through the
server's data link (kvedit.server.datalink, raw TCP). See docs/protocol.md.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from kvedit.layout import ModelLayout

MAX_RID_BYTES = 16
MAX_KEY_BYTES = 64


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, kw_only=True):
    pass


# ---- requests -------------------------------------------------------------------------
class Hello(_Msg, tag="hello"):
    """Ask for ServerInfo (what a client needs to attach to the shared-memory segment)."""


class Register(_Msg, tag="register"):
    model: str
    layout: ModelLayout


class GetLayout(_Msg, tag="get_layout"):
    model: str
    tp_rank: int = 0


class ListModels(_Msg, tag="list_models"):
    pass


class Lookup(_Msg, tag="lookup"):
    """Count leading ready keys; with wait_timeout > 0 the reply waits until all are ready."""
    model: str
    keys: list[bytes]
    tp_rank: int = 0
    wait_timeout: float = 0.0


class PrepareStore(_Msg, tag="prepare_store"):
    model: str
    keys: list[bytes]
    tp_rank: int = 0


class Commit(_Msg, tag="commit"):
    """Publish a prepared store (its bytes are in the slots: shm copy or data-link PUT)."""
    store_id: int


class Abort(_Msg, tag="abort"):
    store_id: int


class Retrieve(_Msg, tag="retrieve"):
    """Lease the leading ready keys. with_data: the client fetches them with a data-link GET,
    after which the server releases the lease itself."""
    model: str
    keys: list[bytes]
    tp_rank: int = 0
    with_data: bool = False


class Release(_Msg, tag="release"):
    lease_id: int


class Delete(_Msg, tag="delete"):
    model: str
    keys: list[bytes]
    tp_rank: int = 0


class Stats(_Msg, tag="stats"):
    pass


Request = Union[Hello, Register, GetLayout, ListModels, Lookup, PrepareStore, Commit, Abort,
                Retrieve, Release, Delete, Stats]


# ---- replies --------------------------------------------------------------------------
class ServerInfo(_Msg, tag="server_info"):
    version: str
    instance: int            # random per server start: tells a client that the server restarted
    chunk_size: int
    shm_name: str            # "" = no shared memory (socket transfers only)
    data_port: int           # TCP port of the data link (socket-mode transfers)
    segment_bytes: int       # size of /dev/shm/<shm_name> (header + pool)
    pool_offset: int         # where the pool starts in the segment
    pool_bytes: int
    lazy: bool
    eviction: str
    lease_ttl: float
    write_ttl: float


class Ok(_Msg, tag="ok"):
    pass


class LayoutReply(_Msg, tag="layout"):
    layout: ModelLayout | None


class Models(_Msg, tag="models"):
    models: dict[str, list[ModelLayout]]


class Count(_Msg, tag="count"):
    n: int


class StoreSlots(_Msg, tag="store_slots"):
    """missing: indices into the request's keys that need data; offsets: their slots."""
    store_id: int
    missing: list[int]
    offsets: list[int]
    present: int
    layout: ModelLayout
    instance: int


class Committed(_Msg, tag="committed"):
    stored: int


class Leased(_Msg, tag="leased"):
    """count leading keys leased; offsets (shm slots) are empty for with_data retrieves."""
    lease_id: int
    count: int
    offsets: list[int]
    layout: ModelLayout
    instance: int


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict[str, Any]


class Error(_Msg, tag="error"):
    code: str
    message: str


Reply = Union[ServerInfo, Ok, LayoutReply, Models, Count, StoreSlots, Committed, Leased,
              StatsReply, Error]

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)

"""Wire messages between KVClient and the kvedit server (msgpack via msgspec; never pickle).

Every ZMQ message is multipart: [request id, message]. The request id is an opaque client
token (≤ 16 bytes) echoed in the reply, so a client can drop late replies of a timed-out call.
The message is a msgpack map tagged by its "t" field. Chunk bytes never ride on ZMQ: in
shared-memory mode they move through slot offsets in the segment, in socket mode through the
server's data link (kvedit.server.datalink, raw TCP; its framing is in kvedit.wire).
See docs/protocol.md.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

import msgspec

from kvedit.layout import ModelLayout

MAX_RID_BYTES = 16
MAX_KEY_BYTES = 64
# The most keys one message may carry, checked while decoding (msgspec reads the array's
# length before its items): a message of millions of tiny keys is refused without building
# them. A server's --max-keys-per-request is at most this.
MAX_KEYS = 65536
Keys = Annotated[list[bytes], msgspec.Meta(max_length=MAX_KEYS)]
MAX_WATCH_RANKS = 1024   # tp_ranks one WatchKeys may follow

# The wire's version: Hello carries the client's, and a server speaking another answers a
# `protocol` error naming both (a peer never meets a message it cannot decode). Bump it with
# any change an older peer cannot follow. 1: before versions (a Hello without the field).
# 2: key-watch snapshots in parts with acknowledgements; the data link's mutual handshake.
PROTOCOL = 2

# Every code an Error reply (or a data-link error) can carry; docs/protocol.md says when.
ErrorCode = Literal[
    "malformed",        # undecodable message, wrong frame count, request id too long
    "unknown_type",     # a message type the server does not handle
    "unknown_model",    # model (tp_rank) not registered
    "bad_layout",       # Register with an invalid layout or name
    "layout_conflict",  # Register of a name already registered with another layout
    "bad_key",          # a key of 0 or more than MAX_KEY_BYTES bytes
    "bad_wait",         # Lookup.wait_timeout out of range
    "too_large",        # one store bigger than the pool, or a message over the size cap
    "too_many_keys",    # more keys in one request than --max-keys-per-request
    "too_many_models",  # Register beyond --max-models
    "name_too_long",    # model name over --max-model-name bytes
    "too_many_waits",   # parked lookups over the per-client or total cap
    "pool_full",        # no room even after evicting every unleased object
    "unknown_store",    # store id never existed or was committed/aborted
    "unknown_lease",    # lease id never existed or was released
    "store_expired",    # the store passed its write TTL: its bytes were discarded
    "lease_expired",    # the lease passed its TTL: bytes read under it may be wrong
    "not_holder",       # the store/lease belongs to another client session
    "busy",             # the object is in use (e.g. Unregister of a model with leases)
    "over_quota",       # the session (or all sessions) holds as many leases, stores, leased
                        # keys or pinned bytes as the server allows
    "unauthorized",     # data-link handshake failed (wrong or missing secret)
    "protocol",         # Hello from a client of another protocol version (both named)
    "internal",         # a server bug; the request had no effect it can rely on
]
ERROR_CODES: frozenset[str] = frozenset(get_args(ErrorCode))

# What an object holds. "kv": one chunk [2, L, chunk_size, heads*head_dim] of a registered
# layout. "queries": one request's captured query rows, a byte string of any size
# up to --max-query-bytes; its shape is the caller's business (kvedit.sdk.queries reads it).
# Each kind has its own key space: a "queries" key never names a "kv" object.
ObjectKind = Literal["kv", "queries"]


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=True, kw_only=True,
           omit_defaults=True):
    """omit_defaults: a field added later with a default is not sent while it holds that
    default, so peers that predate it (and forbid unknown fields) still decode the message."""


# ---- requests -------------------------------------------------------------------------
class Hello(_Msg, tag="hello", forbid_unknown_fields=False):
    """Ask for ServerInfo (what a client needs to attach to the shared-memory segment).
    `protocol`: the client's PROTOCOL; a server speaking another answers Error("protocol").
    Unknown fields are ignored here alone, so that a Hello of any later version still
    decodes and gets that clear answer instead of `malformed`."""
    protocol: int = 1


class Register(_Msg, tag="register"):
    model: str
    layout: ModelLayout


class Unregister(_Msg, tag="unregister"):
    """Forget a model's layout (tp_rank) and delete its objects -> Count(objects deleted);
    fails `busy` while any of them is leased or being stored."""
    model: str
    tp_rank: int = 0


class GetLayout(_Msg, tag="get_layout"):
    model: str
    tp_rank: int = 0


class ListModels(_Msg, tag="list_models"):
    pass


class Lookup(_Msg, tag="lookup"):
    """Count leading ready keys; with wait_timeout > 0 the reply waits until all are ready."""
    model: str
    keys: Keys
    tp_rank: int = 0
    wait_timeout: float = 0.0
    kind: ObjectKind = "kv"


class PrepareStore(_Msg, tag="prepare_store"):
    """kind "queries": exactly one key, `nbytes` its size; a ready object under that key is
    replaced (one being written by another store is reported present)."""
    model: str
    keys: Keys
    tp_rank: int = 0
    kind: ObjectKind = "kv"
    nbytes: int = 0          # "queries" only: the object's byte size (1..--max-query-bytes)


class Commit(_Msg, tag="commit"):
    """Publish a prepared store (its bytes are in the slots: shm copy or data-link PUT)."""
    store_id: int


class Abort(_Msg, tag="abort"):
    store_id: int


class Retrieve(_Msg, tag="retrieve"):
    """Lease the leading ready keys. with_data: the client fetches them with a data-link GET,
    after which the server releases the lease itself."""
    model: str
    keys: Keys
    tp_rank: int = 0
    with_data: bool = False
    kind: ObjectKind = "kv"


class Release(_Msg, tag="release"):
    lease_id: int


class Delete(_Msg, tag="delete"):
    model: str
    keys: Keys
    tp_rank: int = 0
    kind: ObjectKind = "kv"


class Stats(_Msg, tag="stats"):
    pass


class WatchKeys(_Msg, tag="watch_keys"):
    """Follow which "kv" keys of `model` (these tp_ranks) are ready (kvedit.client.key_watch).
    renew=False (re)subscribes: the server sends a KeySnapshot in parts, and KeyEvents as keys
    become ready or go, every message of the subscription numbered by `seq` from 0 (the first
    part). renew=True keeps the watch alive and acknowledges what arrived: `seen` is the last
    seq the client applied (-1: none), so the server knows how many bytes it still has queued
    for this client (docs/protocol.md, "Key watches") -> WatchAck. `epoch` (the client's
    subscription number) is echoed in every message, so an earlier subscription's are told
    apart."""
    model: str
    tp_ranks: Annotated[list[int], msgspec.Meta(max_length=MAX_WATCH_RANKS)]
    epoch: int
    renew: bool = False
    seen: int = -1


Request = Union[Hello, Register, Unregister, GetLayout, ListModels, Lookup, PrepareStore,
                Commit, Abort, Retrieve, Release, Delete, Stats, WatchKeys]


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
    # limits a client checks before sending (0 = unknown, e.g. an older server); a message
    # over max_message_bytes is dropped by libzmq with the connection, so no reply would come
    max_keys_per_request: int = 0
    max_message_bytes: int = 0
    # seconds the data link keeps an idle connection (0 = not announced): a client reconnects
    # well before rather than find it closed
    data_idle_timeout: float = 0.0
    # the server has a second tier (--l2-url): a key missing from the pool may still be
    # found by a lookup, so a watch of the pool's keys (WatchKeys) cannot answer misses
    l2: bool = False
    protocol: int = 1        # the server's PROTOCOL (only sent to a client that speaks it)


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
    nbytes: int = 0          # kind "queries": the size of each slot (0: layout.chunk_bytes)


class Committed(_Msg, tag="committed"):
    stored: int


class Leased(_Msg, tag="leased"):
    """count leading keys leased; offsets (shm slots) are empty for with_data retrieves."""
    lease_id: int
    count: int
    offsets: list[int]
    layout: ModelLayout
    instance: int
    sizes: list[int] = []    # kind "queries": each leased object's bytes ([]: chunk_bytes)


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict[str, Any]


class KeySnapshot(_Msg, tag="key_snapshot"):
    """One part of a watch's snapshot: ready keys of the watched model, by tp_rank. Part seq 0
    starts the copy; parts and KeyEvents then come in seq order (events sent while the
    snapshot is built are applied on top of it); the part with more=False ends it."""
    epoch: int
    keys: dict[int, list[bytes]]
    seq: int = 0
    more: bool = False


class KeyEvents(_Msg, tag="key_events"):
    """Pushed to a watch: keys that became ready or went (evicted, deleted) since the last
    push, by tp_rank. seq numbers the subscription's messages (snapshot parts too); a gap
    means one was lost (a queue was full) and the client subscribes again."""
    epoch: int
    seq: int
    added: dict[int, list[bytes]] = {}
    removed: dict[int, list[bytes]] = {}


class WatchAck(_Msg, tag="watch_ack"):
    """A renewed watch -> the seq of its last message (-1: no such watch, or the server
    dropped it: subscribe again). Also pushed, with -1, to a watch the server drops."""
    epoch: int
    seq: int


class Error(_Msg, tag="error"):
    # str on the wire (not ErrorCode) so that an older client still decodes a newer code;
    # the server only sends members of ErrorCode (Service.fail takes an ErrorCode).
    code: str
    message: str


Reply = Union[ServerInfo, Ok, LayoutReply, Models, Count, StoreSlots, Committed, Leased,
              StatsReply, KeySnapshot, KeyEvents, WatchAck, Error]

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)

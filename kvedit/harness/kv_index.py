"""The router's side of vLLM's KV events: a subscriber with replay, and an index of what each
medium of one engine holds, decoded with vLLM's own types and hashed with vLLM's own hashing.

Why a module of its own: kvedit's tests, `kvedit bench connector --kv-events` and
`kvedit bench route` read an engine's events as a router does (docs/connector.md, "KV events
for routers"), and check what routers rely on as they apply them: every removal matches an
earlier store of that medium, a store names its tokens and a block size, each block's parent
was seen, a clear ends everything of the engine. Imports vLLM (its event types and hashing).

Wire (vLLM's ZmqEventPublisher): a PUB message is [topic, 8-byte big-endian seq, msgpack
KVEventBatch]; the replay socket (ROUTER) takes [b"", 8-byte start seq] and answers
[b"", topic, seq, payload] per buffered batch, then [b"", b"", -1, b""]. A batch is
positional ([ts, events, dp_rank]); its events are tagged maps in vLLM 0.32 and tagged
arrays in older releases: `decode_batch` reads both.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
EVENT_TYPES = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
END_SEQ = -1


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload -> vLLM's KVEventBatch, whether its events are tagged maps (this
    vLLM) or tagged arrays (older ones); ValueError naming what did not fit."""
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError:
        pass
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError(f"not a KVEventBatch: expected [ts, [events...], dp_rank], got "
                         f"{type(raw).__name__}")
    return KVEventBatch(ts=raw[0], events=[_event(e) for e in raw[1]],
                        data_parallel_rank=raw[2] if len(raw) > 2 else None)


def _event(e):
    if isinstance(e, dict):
        tag, fields = e.get("type"), {k: v for k, v in e.items() if k != "type"}
    elif isinstance(e, list) and e:
        tag = e[0]
        fields = dict(zip(EVENT_TYPES[tag].__struct_fields__, e[1:])) if tag in EVENT_TYPES \
            else {}
    else:
        raise ValueError(f"not a KV event: {e!r:.80}")
    cls = EVENT_TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown KV event type {tag!r}; expected one of {list(EVENT_TYPES)}")
    # fields one release lacks are None in another (medium, lora_name, ...)
    full = {name: fields.get(name) for name in cls.__struct_fields__}
    return msgspec.convert({k: v for k, v in full.items()
                            if k in fields or k not in _defaults(cls)}, cls)


def _defaults(cls) -> set[str]:
    n = len(cls.__struct_defaults__)
    return set(cls.__struct_fields__[len(cls.__struct_fields__) - n:]) if n else set()


class Subscriber:
    """SUB on one engine's publisher, with gaps filled from its replay socket. `from_seq`: the
    first seq wanted (0: everything the publisher still buffers; None: from the first that
    arrives). Its own ZMQ context; close() when done."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 from_seq: int | None = None):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.next_seq = from_seq           # the next seq expected
        self.replayed = 0                  # batches that came from the replay socket

    def poll(self, timeout_s: float) -> list[tuple[int, KVEventBatch]]:
        """Batches that arrived within `timeout_s` (then whatever is queued), in seq order,
        with any gap before them filled by a replay."""
        out: list[tuple[int, KVEventBatch]] = []
        wait = int(timeout_s * 1000)
        while self.sub.poll(wait):
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if self.next_seq is not None and seq > self.next_seq and self.replay_endpoint:
                out += [b for b in self.replay(self.next_seq) if b[0] < seq]
            if self.next_seq is None or seq >= self.next_seq:
                out.append((seq, decode_batch(payload)))
                self.next_seq = seq + 1
            wait = 0
        return out

    def replay(self, start: int, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
        """The publisher's buffered batches from seq `start` on."""
        if not self.replay_endpoint:
            raise ValueError("this subscriber was given no replay endpoint")
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay_endpoint)
        out = []
        try:
            s.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not s.poll(int(timeout_s * 1000)):
                    raise TimeoutError(f"no replay from {self.replay_endpoint} within "
                                       f"{timeout_s} s")
                _, _, seq_b, payload = s.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    break
                out.append((seq, decode_batch(payload)))
        finally:
            s.close()
        self.replayed += len(out)
        if out:
            self.next_seq = max(self.next_seq or 0, out[-1][0] + 1)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@dataclass
class EngineView:
    """What one engine's events say it holds, per medium, with what a router would trip on
    counted as it is applied (each list names the offending hashes or events)."""
    held: dict[str, Counter] = field(default_factory=dict)  # medium -> hash -> stores held
    blocks: dict[object, tuple] = field(default_factory=dict)  # hash -> (parent, tokens, extra)
    ever: dict[str, set] = field(default_factory=dict)  # medium -> every hash it announced
    stored: Counter = field(default_factory=Counter)    # medium -> blocks announced
    removed: Counter = field(default_factory=Counter)   # medium -> blocks removed
    clears: int = 0
    removed_unknown: list = field(default_factory=list)  # a removal no store of it precedes
    stored_twice: list = field(default_factory=list)     # a store of what the medium holds
    malformed: list = field(default_factory=list)        # no tokens, block size 0, ...
    orphans: list = field(default_factory=list)          # a parent never announced

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.clears += 1
                self.held.clear()
            elif isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                held = self.held.setdefault(ev.medium, Counter())
                for h in ev.block_hashes:
                    if held[h] <= 0:
                        self.removed_unknown.append((ev.medium, h))
                        continue
                    held[h] -= 1
                    if not held[h]:
                        del held[h]
                    self.removed[ev.medium] += 1

    def _stored(self, ev: BlockStored) -> None:
        n, bs = len(ev.block_hashes), ev.block_size
        if bs <= 0 or len(ev.token_ids) != n * bs:
            self.malformed.append(ev)
            return
        if ev.parent_block_hash is not None and ev.parent_block_hash not in self.blocks:
            self.orphans.append((ev.medium, ev.parent_block_hash))
        held = self.held.setdefault(ev.medium, Counter())
        self.ever.setdefault(ev.medium, set()).update(ev.block_hashes)
        parent = ev.parent_block_hash
        extra = ev.extra_keys or [None] * n
        for i, h in enumerate(ev.block_hashes):
            if held[h]:
                self.stored_twice.append((ev.medium, h))
            held[h] += 1
            self.blocks[h] = (parent, tuple(ev.token_ids[i * bs:(i + 1) * bs]), extra[i])
            parent = h
        self.stored[ev.medium] += n

    def holds(self, medium: str) -> set:
        return set(self.held.get(medium, ()))

    def leading(self, hashes: list, medium: str) -> int:
        """How many leading `hashes` (a request's, `block_hashes`) the medium holds."""
        held, n = self.held.get(medium, {}), 0
        for h in hashes:
            if not held.get(h):
                break
            n += 1
        return n

    def tokens_of(self, h) -> list[int]:
        """The whole token prefix that ends with block `h`, by its parents."""
        parts = []
        while h is not None:
            parent, tokens, _ = self.blocks[h]
            parts.append(tokens)
            h = parent
        return [t for part in reversed(parts) for t in part]


def block_hashes(tokens: list[int], block_size: int, cache_salt: str = "",
                 algo: str = "sha256") -> list:
    """vLLM's prefix-cache hashes of `tokens`' full blocks (as its events carry them), from
    vLLM's own hashing: what a router computes for a request to look it up. The engine must
    run with the same `--prefix-caching-hash-algo` and PYTHONHASHSEED (unset: vLLM's fixed
    seed for sha256). Sets nothing in vLLM's module state."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        hash_block_tokens,
        maybe_convert_block_hash,
        resolve_none_hash_seed,
    )

    fn = get_hash_fn_by_name(algo)
    if os.environ.get("PYTHONHASHSEED") is None and algo.startswith("xxhash"):
        raise ValueError(f"{algo} seeds its first block at random per process unless "
                         f"PYTHONHASHSEED is set; set it alike here and in vLLM, or use sha256")
    parent = fn(resolve_none_hash_seed(fn))   # vLLM's NONE_HASH for this seed
    out = []
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = hash_block_tokens(fn, parent, tokens[i * block_size:(i + 1) * block_size],
                                   extra)
        out.append(maybe_convert_block_hash(parent))
    return out

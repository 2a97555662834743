"""`kvedit bench route`'s forwarder (vLLM's ipc PUB -> a PUB on 127.0.0.1 for the router), with
real ZMQ sockets and vLLM's own KVEventBatch: batches pass unchanged, topic and sequence
frames included; in the gpu_only arm the CPU-medium events (kvedit's) are taken out and the
rest of each batch is kept in order, decodable with vLLM's types."""
from __future__ import annotations

import time

import msgspec
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("vllm.distributed.kv_events")

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvedit.bench.connector.route import Forwarder  # noqa: E402
from kvedit.harness.kv_index import decode_batch  # noqa: E402


def _stored(hashes, medium):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2, 3, 4],
                       block_size=2, lora_id=None, medium=medium, lora_name=None)


def _batch(seq: int) -> KVEventBatch:
    return KVEventBatch(ts=float(seq), events=[
        AllBlocksCleared(), _stored([seq, seq + 1], "GPU"), _stored([seq + 2], "CPU"),
        BlockRemoved(block_hashes=[seq + 2], medium="CPU"),
        BlockRemoved(block_hashes=[seq], medium="GPU")], data_parallel_rank=0)


def _through(tmp_path, drop_cpu: bool, n: int = 3):
    """Publish `n` batches as vLLM does ([topic, 8-byte seq, msgpack]) -> what the router's
    subscriber receives, and the forwarder."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    source = f"ipc://{tmp_path}/pub"
    pub.bind(source)
    fwd = Forwarder(source, drop_cpu=drop_cpu)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(fwd.endpoint)
    try:
        assert fwd.endpoint.startswith("tcp://127.0.0.1:")
        got, seq, deadline = [], 0, time.monotonic() + 10
        while not got:   # until both subscriptions are in place: the first message through
            assert time.monotonic() < deadline, "nothing came through the forwarder"
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"),
                                msgspec.msgpack.encode(_batch(seq))])
            seq += 1
            if sub.poll(200):
                got.append(sub.recv_multipart())
        for _ in range(n):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"),
                                msgspec.msgpack.encode(_batch(seq))])
            seq += 1
        while len(got) < n + 1:
            assert sub.poll(5000), f"only {len(got)} of {n + 1} batches came through"
            got.append(sub.recv_multipart())
        return got, fwd
    finally:
        fwd.close()
        ctx.destroy(linger=0)


def test_batches_pass_unchanged(tmp_path):
    got, fwd = _through(tmp_path, drop_cpu=False)
    seqs = [int.from_bytes(s, "big") for _, s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(got)))
    for topic, s, payload in got:
        assert topic == b"kv"
        assert payload == msgspec.msgpack.encode(_batch(int.from_bytes(s, "big")))
    assert fwd.dropped == 0


def test_gpu_only_drops_exactly_the_cpu_events(tmp_path):
    got, fwd = _through(tmp_path, drop_cpu=True)
    for _, s, payload in got:
        seq = int.from_bytes(s, "big")
        want = [e for e in _batch(seq).events if getattr(e, "medium", None) != "CPU"]
        assert decode_batch(payload).events == want
    assert fwd.dropped >= 2 * len(got)   # two CPU events a batch (earlier ones lost by PUB)

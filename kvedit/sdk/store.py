"""modify's store target: the edited chunks under every rank's keys, staged, with the salt rule.

`store_kv` writes fn's validated result (cut per rank by `Context.split`: the tensor itself
with one rank, each rank's heads under tensor parallel) under each rank's keys of the edited
tokens:

1. every rank's store is prepared (the server hands out slots for the keys it lacks);
2. for each present key whose chunk fn may have changed, the stored bytes are compared with
   the edited ones (the keys/salt rule of kvedit.sdk.modify). Chunks fn returned untouched
   in place under their original key are known identical and not compared;
3. the missing chunks are copied straight from the edited tensor into their slots (refused
   past the server's write TTL), every rank before any commit;
4. `check_source()` (a mapped kv's lease still held), then the commits, rank by rank.

A present key holding other bytes aborts every rank's store and starts again under one fresh
derived salt for all ranks (the salt is the stream's, not a rank's). What is guaranteed (the
server has no multi-store transaction): a failure before the commits (a prepare, a compare,
a fill, the write TTL, the lease check) aborts every rank, so no rank holds any edited
chunk. A commit failing after earlier ranks committed (server gone, a TTL between two
commits) deletes what those ranks wrote (best effort; only under the *edited* keys, never a
rank's original chunks, and vLLM's scheduler side loads a chunk only when every rank holds
it, so a half-committed edit is never decoded from). With one rank steps 1-4 are the plain
prepare, compare, fill and commit of one store.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvedit.client.handles import KVError, StoreHandle
from kvedit.sdk.rowcopy import chunk_equal, save_chunk


@dataclass(frozen=True, slots=True)
class Stored:
    """What store_kv committed: the salt and every rank's keys (index = rank) the edited
    chunks live under; the counts are rank 0's chunks (compared: over all ranks)."""
    salt: str
    rank_keys: list[list[bytes]]
    stored: int    # chunks written
    reused: int    # chunks already present (identical bytes on every rank)
    compared: int  # present chunks whose bytes were compared, all ranks

    @property
    def keys(self) -> list[bytes]:
        """The keys a stream holds: rank 0's."""
        return self.rank_keys[0]


def derive_salt(salt: str) -> str:
    return f"{salt}~kvedit-{uuid.uuid4().hex[:12]}"


class _Differs(Exception):
    """An edited chunk's key is present on some rank with other data: switch the salt."""

    def __init__(self, compared: int):
        super().__init__(compared)
        self.compared = compared


def store_kv(ctx, tokens: list[int], salt: str, kv: torch.Tensor,
             old_keys: list[list[bytes]], untouched: set[int],
             check_source: Callable[[], None] = lambda: None, fresh: bool = False) -> Stored:
    """Store the edited full chunks of `kv` (laid out as ctx.fn_layout, len(tokens) // C of
    them) under `salt` or, if a present key holds other bytes, under a fresh derived salt.
    `fresh`: straight to a fresh salt (a per-head edit, whose stand-in token ids do not say
    what its slots hold, kvedit.sdk.head_tokens: its keys must never meet another's).

    `old_keys`: every rank's keys of the chunks fn was given; `untouched`: chunks known
    identical to the given chunk at the same index (their stored object is the one given
    when the key is unchanged: no compare). `check_source()` runs just before the commits and
    raises if the bytes fn read can no longer be trusted (a mapped kv's lease ran out)."""
    pieces = ctx.split(kv)
    compared = 0
    if not fresh:
        try:
            return _store(ctx, tokens, salt, pieces, old_keys, untouched, check_source, 0)
        except _Differs as e:
            compared = e.compared
    return _store(ctx, tokens, derive_salt(salt), pieces, old_keys, set(), check_source,
                  compared, fresh=True)


def _store(ctx, tokens, salt: str, pieces: list[torch.Tensor], old_keys, untouched,
           check_source, compared: int, fresh: bool = False) -> Stored:
    per_rank = ctx.rank_keys_for(tokens, salt)
    handles: list[StoreHandle] = []
    try:
        for r, keys in enumerate(per_rank):
            h = ctx.client.prepare_store(ctx.model, keys, tp_rank=r)
            handles.append(h)
            present = sorted(set(range(len(keys))) - set(h.missing))
            if present and fresh:
                raise RuntimeError(f"fresh salt {salt!r} already has chunks in the server "
                                   f"(tensor-parallel rank {r})")
            old = old_keys[r]
            check = [j for j in present
                     if not (j in untouched and j < len(old) and keys[j] == old[j])]
            compared += len(check)
            if check and not _identical(ctx, r, [keys[j] for j in check], check, pieces[r]):
                raise _Differs(compared)
            for i, buf in h.writable():   # straight from the edited tensor into shm
                save_chunk(buf, pieces[r], i)
        check_source()
    except BaseException:
        _abort(handles)
        raise
    _commit_all(ctx, per_rank, handles)
    missing = len(handles[0].missing)
    return Stored(salt, per_rank, missing, len(per_rank[0]) - missing, compared)


def _identical(ctx, rank: int, keys: list[bytes], idx: list[int], piece) -> bool:
    """Are the stored chunks `keys` byte-identical to piece's chunks idx?"""
    with ctx.client.retrieve(ctx.model, keys, tp_rank=rank) as got:
        if len(got.tensors) < len(keys):
            return False   # cannot prove equality: the caller switches to a fresh salt
        return all(chunk_equal(piece, i, t) for i, t in zip(idx, got.tensors))


def _commit_all(ctx, per_rank: list[list[bytes]], handles: list[StoreHandle]) -> None:
    """Commit rank by rank; on a failure abort the rest and delete what the committed ranks
    wrote (their missing keys only: present ones were someone else's, identical)."""
    for r, h in enumerate(handles):
        try:
            h.commit()
        except BaseException:
            _abort(handles[r + 1:])
            for done in range(r):
                written = [per_rank[done][i] for i in handles[done].missing]
                try:
                    if written:
                        ctx.client.delete(ctx.model, written, tp_rank=done)
                except Exception:   # the original error is what raises; orphans only evict
                    pass
            raise


def _abort(handles: list[StoreHandle]) -> None:
    """Abort stores while another error is on its way out (a gone server must not hide it;
    the server drops an unfinished store at its write TTL anyway)."""
    for h in handles:
        try:
            h.abort()
        except KVError:
            pass

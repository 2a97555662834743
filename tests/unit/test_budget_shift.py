"""The in-engine worker's per-step input shift on the CPU (`BudgetWorker._shift_host`):
sequence lengths, RoPE positions (compact) and slots of compacted requests, logical minus
offset, against a plain per-token reference; both its paths (decode steps of one token per
row, element by element, and steps with several tokens in a row, vectorised)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvedit.vllm.budget.worker import BudgetWorker

BS = 16


def _runner(counts: list[int], seq: list[int], rng):
    n = len(counts)
    qsl = np.zeros(n + 2, dtype=np.int32)
    qsl[1:n + 1] = np.cumsum(counts)
    pos = np.concatenate([np.arange(s - c, s) for s, c in zip(seq, counts)]).astype(np.int64)
    blocks = rng.permutation(64 * 8).astype(np.int32).reshape(8, 64)[:n]
    table = SimpleNamespace(block_table=SimpleNamespace(np=blocks),
                            slot_mapping=SimpleNamespace(np=np.full(len(pos) + 3, -7, np.int64)),
                            block_size=BS)
    return SimpleNamespace(
        query_start_loc=SimpleNamespace(np=qsl), positions=torch.from_numpy(pos.copy()),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        optimistic_seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        input_batch=SimpleNamespace(block_table=[table]))


def _reference(r, rows):
    qsl = r.query_start_loc.np
    pos, seq = r.positions.numpy().copy(), r.seq_lens.numpy().copy()
    slots = r.input_batch.block_table[0].slot_mapping.np.copy()
    blocks = r.input_batch.block_table[0].block_table.np
    for i, off, compact in rows:
        seq[i] -= off
        for t in range(qsl[i], qsl[i + 1]):
            at = pos[t] - off
            if compact:
                pos[t] = at
            slots[t] = blocks[i, at // BS] * BS + at % BS
    return pos, seq, slots


@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1], [1, 3, 1, 2, 1], [4, 1, 1, 1, 5]])
def test_shift_host_matches_a_per_token_reference(counts):
    rng = np.random.default_rng(len(counts) + sum(counts))
    seq = [int(x) for x in rng.integers(300, 900, len(counts))]
    r = _runner(counts, seq, rng)
    # rows 0, 2, 3 compacted (offsets of whole and partial blocks, both position modes);
    # rows 1 and 4 not: they must come out unchanged
    rows = [(0, 128, True), (2, 37, False), (3, 200, True)]
    want = _reference(r, rows)
    BudgetWorker._shift_host(SimpleNamespace(runner=r), rows)
    assert np.array_equal(r.positions.numpy(), want[0])
    assert np.array_equal(r.seq_lens.numpy(), want[1])
    assert np.array_equal(r.optimistic_seq_lens_cpu.numpy(), want[1])
    assert np.array_equal(r.input_batch.block_table[0].slot_mapping.np, want[2])

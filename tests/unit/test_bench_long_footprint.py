"""`kvedit bench long --in-engine`'s footprints in tokens and in blocks: at budget 768 (every
128, blocks of 128) an in-engine stream holds 6 blocks at every step once compacted, a host
round sent with 513 tokens holds 5; the arm at the host's peak (641) holds 5 again."""
from __future__ import annotations

from types import SimpleNamespace

from kvedit.bench.long.arms import mean_footprint as host_footprint
from kvedit.bench.long.engine import mean_footprint


def test_in_engine_streams_hold_a_whole_block_more_at_the_same_budget():
    assert mean_footprint(768, 512, 768, 128, block_size=128) == 6.0
    assert mean_footprint(768, 512, 768, 128) == sum(
        [768] + [641 + i % 128 for i in range(512)]) / 513
    assert 5.0 < mean_footprint(641, 512, 641, 128, block_size=128) < 5.05


def test_host_rounds_are_counted_per_generated_token():
    g = SimpleNamespace(prompt_tokens=513, token_ids=list(range(128)))
    batch = [SimpleNamespace(generations=[g, g])]
    assert host_footprint(batch, 128) == 5.0
    assert host_footprint(batch) == 513 + 127 / 2
